"""`mlx-infer models` (alias `ls`): what `serve` would serve, with sizes, and the GGUF conversions in the cache."""

import json
from typing import Annotated, List, Optional

import typer

from .errors import user_errors
from .serve import ModelsDirOpt, ModelsOpt, serve_models

#: Units of human-readable sizes, largest first (powers of 1000, as disks are sold).
_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def human_size(size: Optional[int]) -> str:
    """A byte count as '98.4 MB' ('-' when unknown)."""
    if size is None:
        return "-"
    for unit, scale in _UNITS:
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def table(rows: List[List[str]]) -> str:
    """Rows as left-aligned columns separated by two spaces (the header is the first row)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def rows_of(models) -> List[List[str]]:
    return [["NAME", "FORMAT", "SIZE", "PATH"]] + [
        [m.name, m.format, human_size(m.size), str(m.path) if m.path is not None else "(downloaded on first use)"]
        for m in models]


def as_json(model) -> dict:
    return {"name": model.name, "format": model.format, "size": model.size,
            "path": str(model.path) if model.path is not None else None}


def models(
    model: ModelsOpt = None,
    models_dir: ModelsDirOpt = None,
    as_json_: Annotated[bool, typer.Option("--json", help="One JSON object on stdout: served and cached.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show tracebacks of errors.")] = False,
) -> None:
    """List the models `mlx-infer serve` would serve with the same --model / --models-dir (name, format, size on
    disk, path; the first is the default), then the GGUF conversions in mlx-infer's cache (converted once per
    GGUF file; delete one to reclaim its space).
    """
    from mlx_infer.paths import cache_dir
    from mlx_infer.server.models import cached_conversions

    with user_errors(verbose):
        served = serve_models(model, models_dir)
        cached = cached_conversions()
        if as_json_:
            print(json.dumps({"served": [as_json(m) for m in served], "cached": [as_json(m) for m in cached],
                              "cache": str(cache_dir() / "gguf")}))
            return
        print(table(rows_of(served)))
        print()
        if cached:
            print(f"cached conversions in {cache_dir() / 'gguf'}:")
            print(table(rows_of(cached)))
        else:
            print(f"no cached conversions in {cache_dir() / 'gguf'}")
