"""`python -m mlx_infer`: the `mlx-infer` command.

Installed, `mlx_infer.cli` is the repository's `cli/` folder (pyproject.toml's package-dir). Run from
a source checkout that is not installed (or is a different clone than the one installed), the
checkout's own `cli/` is mapped to `mlx_infer.cli` the same way before the command is imported.
"""

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Optional

#: The source checkout this package would sit in: <checkout>/mlx_infer/__main__.py.
CHECKOUT = Path(__file__).resolve().parent.parent


def checkout_cli() -> Optional[Path]:
    """The checkout's cli/ folder, or None when this package is installed (no pyproject.toml beside it)."""
    cli = CHECKOUT / "cli"
    if (CHECKOUT / "pyproject.toml").is_file() and (cli / "__init__.py").is_file() and (cli / "app.py").is_file():
        return cli
    return None


def map_cli(folder: Path) -> None:
    """Import `folder` as the package `mlx_infer.cli`, as the installed package-dir mapping does."""
    spec = importlib.util.spec_from_file_location(
        "mlx_infer.cli", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["mlx_infer.cli"] = module
    spec.loader.exec_module(module)


if __name__ == "__main__":
    folder = checkout_cli()
    if folder is not None:
        map_cli(folder)
    importlib.import_module("mlx_infer.cli.app").main()
