"""Where mlx-infer keeps files on the user's disk, and what it does when it cannot write there.

The cache only saves work: a cache that cannot be written (read-only, full, a path under a file)
costs time, never a failure. Writes go to a unique temporary file in the same folder, renamed over
the target, so concurrent processes never see or leave half a file.
"""

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional, Set, Tuple

from .errors import ModelNotFoundError

#: Hex digits of the sha256 kept in cache file names and model fingerprints.
KEY_DIGITS = 16

#: The environment variable that names the cache directory.
CACHE_ENV = "MLX_INFER_CACHE"
#: Cache folders already warned about in this process (one warning line each).
_warned: Set[str] = set()


def cache_dir() -> Path:
    """The user cache directory: `$MLX_INFER_CACHE`, else `$XDG_CACHE_HOME/mlx-infer`, else
    `~/.cache/mlx-infer`. Created on first use when it can be; returned even when it cannot
    (read-only location), for reading what is there."""
    env = os.environ.get(CACHE_ENV)
    if env:
        path = Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
        path = Path(base) / "mlx-infer"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # read-only: reads still work, writes warn (see `warn_not_cached`)
    return path


def warn_not_cached(folder: Path, error: OSError, consequence: str = "results are not cached") -> None:
    """One warning line, once per process and folder, that a cache folder could not be written.

    Args:
        folder: the cache folder (cache_dir() / kind).
        error: what the OS said.
        consequence: what happens instead, for the user.
    """
    if str(folder) in _warned:
        return
    _warned.add(str(folder))
    reason = error.strerror or type(error).__name__
    warnings.warn(f"cannot write the cache folder {folder} ({reason}); {consequence} "
                  f"(set {CACHE_ENV} to a writable folder)", stacklevel=3)


def write_error(folder: Path) -> Optional[OSError]:
    """Why `folder` cannot be written (made first when missing), or None when it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return e
    return None if os.access(folder, os.W_OK) else PermissionError(13, "read-only")


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a unique temporary file in the same folder and `os.replace`.

    Raises:
        OSError: the folder or the file cannot be written (the temporary file is removed).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _cache_path(kind: str, ident: str) -> Path:
    """Where cached_json keeps the object of (kind, ident)."""
    return cache_dir() / kind / f"{hashlib.sha256(ident.encode()).hexdigest()[:KEY_DIGITS]}.json"


def _read_cached(path: Path, valid: Optional[Callable[[dict], bool]]) -> Tuple[Optional[dict], bool]:
    """(the cached object at path, or None; whether one was there but failed `valid`)."""
    if not path.is_file():
        return None, False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, False  # unreadable: compute again
    try:
        if isinstance(data, dict) and (valid is None or valid(data)):
            return data, False
    except (ValueError, KeyError, TypeError):
        return None, False  # from an older version: compute again
    return None, True


def read_cached_json(kind: str, ident: str, valid: Optional[Callable[[dict], bool]] = None) -> Optional[dict]:
    """The object cached_json(kind, ident, ..., valid) would return without computing, or None when none
    valid is cached (nothing is computed or written)."""
    return _read_cached(_cache_path(kind, ident), valid)[0]


def cached_json(kind: str, ident: str, compute: Callable[[], dict], valid: Optional[Callable[[dict], bool]] = None,
                say: Optional[Callable[[str], None]] = None, message: str = "",
                stale: str = "the cached one no longer fits") -> dict:
    """A JSON object computed once and kept under `cache_dir()/kind/<hash of ident>.json`.

    Args:
        kind: the subdirectory ("cost", "layerskip", ...).
        ident: what the result depends on (model fingerprint, backend, ...); hashed into the file name.
        compute: () -> dict, run when no valid cached object exists.
        valid: (dict) -> bool, whether a cached object can be used (default: any that parses).
        say: called with `message` (plus where it is cached, or why it is computed again: `stale`, when a
            cached object fails `valid`) before computing; not when cached.

    Returns:
        The cached or newly computed dict. Written atomically (a crash or a concurrent writer never
        leaves half a file); when it cannot be written, one line (`say`'s, else a warning once per
        process and folder) and the computed dict.
    """
    path = _cache_path(kind, ident)
    data, rejected = _read_cached(path, valid)
    if data is not None:
        return data
    if say:
        if write_error(path.parent) is not None:
            _warned.add(str(path.parent))  # said here; no warning besides
            say(f"{message} (not cached: {path.parent} cannot be written)")
        else:
            say(f"{message} ({f'again: {stale}' if rejected else 'once per model and install'}; cached in {path.parent})")
    data = compute()
    try:
        write_atomic(path, json.dumps(data))
    except OSError as e:
        warn_not_cached(path.parent, e)
    return data


def model_fingerprint(mlx_dir: Path) -> str:
    """A short identity of an MLX model directory that does not depend on where it lies.

    The sha256 of config.json's bytes and the names and sizes of its *.safetensors files, so a
    moved or copied cache keeps its measurements, and changed weights or config get new ones.

    Returns:
        KEY_DIGITS hex digits.

    Raises:
        ModelNotFoundError: the directory has no config.json.
    """
    mlx_dir = Path(mlx_dir)
    config = mlx_dir / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"{mlx_dir} has no config.json; it is not an MLX model directory")
    h = hashlib.sha256(config.read_bytes())
    for weights in sorted(mlx_dir.glob("*.safetensors")):
        h.update(f"\0{weights.name}\0{weights.stat().st_size}".encode())
    return h.hexdigest()[:KEY_DIGITS]
