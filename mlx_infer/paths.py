"""Where mlx-infer keeps files on the user's disk."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache directory: `$MLX_INFER_CACHE`, else `$XDG_CACHE_HOME/mlx-infer`, else
    `~/.cache/mlx-infer`. Created on first use."""
    env = os.environ.get("MLX_INFER_CACHE")
    if env:
        path = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        path = Path(base) / "mlx-infer"
    path.mkdir(parents=True, exist_ok=True)
    return path
