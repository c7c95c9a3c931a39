"""pytest from the checkout's root. `python -m pytest` (unlike plain `pytest`) puts the checkout first on
sys.path, so `mlx_infer` is then the source tree, where the CLI is not `mlx_infer.cli` yet: an install maps
cli/ there (pyproject.toml's package-dir). Map it the same way, as `python -m mlx_infer` does from a checkout
(mlx_infer/__main__.py), so that both ways of running pytest test the same code."""

import importlib.util

# Before any test imports mlx.core: mlx_infer loads the optimized BLAS first (tests/conftest.py says why).
import mlx_infer  # noqa: F401
from mlx_infer.__main__ import checkout_cli, map_cli

if importlib.util.find_spec("mlx_infer.cli") is None and checkout_cli() is not None:
    map_cli(checkout_cli())
