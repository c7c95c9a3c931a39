"""The compute backend MLX runs on, and the CPU fast path.

On Linux the `mlx[cpu]` wheel links a bundled reference BLAS (a few GFLOP/s). Loading an
optimized BLAS (OpenBLAS) into the global symbol scope before `mlx.core` is imported makes MLX's
float matmuls resolve to it: about 8x faster here. `mlx_infer` does this on import when it can;
`MLX_INFER_BLAS=reference` turns it off.
"""

import ctypes
import glob
import os
import platform
import sys
from typing import Optional

#: Where Debian/Ubuntu (libopenblas0-pthread) and Fedora put OpenBLAS.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded_blas: Optional[str] = None


def find_openblas() -> Optional[str]:
    """Path of a system OpenBLAS shared library, or None."""
    explicit = os.environ.get("MLX_INFER_OPENBLAS")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    hits = sorted(glob.glob("/usr/lib/*/libopenblas*.so*"))
    return hits[0] if hits else None


def preload_optimized_blas() -> Optional[str]:
    """Load OpenBLAS with RTLD_GLOBAL so that MLX's CPU backend uses it.

    Only on Linux, only before `mlx.core` is imported, and not when MLX_INFER_BLAS=reference.

    Returns:
        The path loaded, or None when nothing was (not Linux, already imported, not found, off).
    """
    global _loaded_blas
    if _loaded_blas or platform.system() != "Linux" or "mlx.core" in sys.modules:
        return _loaded_blas
    if os.environ.get("MLX_INFER_BLAS", "").lower() == "reference":
        return None
    path = find_openblas()
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    _loaded_blas = path
    return path


def blas_in_use() -> str:
    """'openblas (PATH)', 'accelerate' on macOS, or 'reference' (the slow bundled BLAS)."""
    if platform.system() == "Darwin":
        return "accelerate"
    if _loaded_blas or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"openblas ({_loaded_blas or os.environ['LD_PRELOAD']})"
    return "reference"


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "gpu"


def total_memory_bytes() -> int:
    """Physical memory in bytes (0 if unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def prefer_float_weights(float_bytes: int) -> bool:
    """The CPU fast path: dequantize to float32 when MLX runs on the CPU with an optimized BLAS
    (its quantized matmul there is a plain loop) and the float weights take under a quarter of RAM."""
    return (
        backend_name() == "cpu"
        and blas_in_use() != "reference"
        and float_bytes < total_memory_bytes() // 4
    )
