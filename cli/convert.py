"""`mlx-infer convert MODEL.gguf OUT_DIR`: a GGUF file -> an MLX model directory."""

from pathlib import Path
from typing import Annotated

import typer

from .errors import user_errors
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
    (with the chat template). OUT_DIR is checked before converting, and nothing is left
    half-written if it fails.
    """
    from mlx_infer.loading.gguf import convert_gguf

    with user_errors(verbose):
        with ProgressBar("converting", always=verbose, activity=f"converting {gguf_file.name}", note="") as bar:
            convert_gguf(gguf_file, out_dir, progress=bar)
        stderr.print(f"wrote {out_dir}")
