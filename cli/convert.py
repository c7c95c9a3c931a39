"""`mlx-infer convert MODEL.gguf OUT_DIR`: a GGUF file -> an MLX model directory."""

from pathlib import Path
from typing import Annotated

import typer

from .errors import fail, user_errors
from .options import VerboseOpt
from .progress import ProgressBar, stderr


def convert(
    gguf_file: Annotated[Path, typer.Argument(metavar="MODEL.gguf", help="The GGUF file to convert.",
                                              show_default=False)],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="New (or empty) directory to write.",
                                            show_default=False)],
    verbose: VerboseOpt = False,
) -> None:
    """Convert a GGUF file into an MLX model directory that `mlx_lm.load` opens.

    Writes config.json (with the quantization map), model.safetensors and the tokenizer files
    (with the chat template). Nothing is left half-written if it fails.
    """
    from mlx_infer.loading.gguf import convert_gguf

    with user_errors(verbose):
        if out_dir.exists() and not out_dir.is_dir():
            raise fail(f"{out_dir} exists and is not a directory; choose a new output directory")
        with ProgressBar("converting", always=verbose, activity=f"converting {gguf_file.name}") as bar:
            convert_gguf(gguf_file, out_dir, progress=bar)
        stderr.print(f"wrote {out_dir}")
