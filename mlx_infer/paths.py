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


def cached_json(kind: str, ident: str, compute, valid=None, say=None, message: str = "") -> dict:
    """A JSON object computed once and kept under `cache_dir()/kind/<hash of ident>.json`.

    Args:
        kind: the subdirectory ("cost", "layerskip", ...).
        ident: what the result depends on (model path, backend, ...); hashed into the file name.
        compute: () -> dict, run when no valid cached object exists.
        valid: (dict) -> bool, whether a cached object can be used (default: any that parses).
        say: called with `message` (plus where it is cached) before computing; not when cached.

    Returns:
        The cached or newly computed dict (written atomically: a crash never leaves half a file).
    """
    import hashlib
    import json

    path = cache_dir() / kind / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json"
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            if isinstance(data, dict) and (valid is None or valid(data)):
                return data
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or from an older version: compute again
    if say:
        say(f"{message} (once; cached in {path.parent})")
    data = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
    return data
