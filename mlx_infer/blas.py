"""The BLAS under MLX's CPU backend: which one runs, and loading an optimized one before MLX.

Nothing here imports MLX: `preload_optimized_blas` must run before `mlx.core` is first imported.

On Linux the `mlx[cpu]` wheel links a bundled reference BLAS (a few GFLOP/s). Loading an
optimized BLAS (OpenBLAS) into the global symbol scope before `mlx.core` is imported makes MLX's
float matmuls resolve to it, several times faster (docs/cpu.md). `mlx_infer` does this on import when it can;
`MLX_INFER_BLAS=reference` turns it off.

OpenBLAS picks its kernels from the CPU model it recognizes, and a build older than the CPU falls back
to its SSE3 kernels ("Prescott"): Debian 12's OpenBLAS 0.3.21 does so on Sapphire Rapids, far slower
on a prefill-sized matmul than its AVX-512 kernels (docs/cpu.md). So on x86-64 the kernel family is named from the
CPU's feature flags (OPENBLAS_CORETYPE) before loading, unless the user already set OPENBLAS_CORETYPE.
Its idle worker threads spin for about 0.1 s after each product by default; here they sleep after 2 **
OPENBLAS_THREAD_TIMEOUT_LOG2 cycles (defaults.py), unless the user set OPENBLAS_THREAD_TIMEOUT.
"""

import ctypes
import glob
import os
import platform
import sys
from typing import Optional

from .defaults import OPENBLAS_THREAD_TIMEOUT_LOG2

#: Where Debian/Ubuntu (libopenblas0-pthread) and Fedora put OpenBLAS.
OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

_loaded_blas: Optional[str] = None
_blas_handle: Optional[ctypes.CDLL] = None


def openblas_core_for(flags: set) -> Optional[str]:
    """The widest OpenBLAS x86-64 kernel family that CPU feature flags (as in /proc/cpuinfo) support:
    'SkylakeX' (AVX-512 F/BW/DQ/VL), 'Haswell' (AVX2 + FMA), or None (leave it to OpenBLAS)."""
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def cpu_flags() -> set:
    """Feature flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
    settings = {}  # read once, as the library initializes; not left behind for other libraries or children
    if "OPENBLAS_CORETYPE" not in os.environ and platform.machine() in ("x86_64", "AMD64"):
        core = openblas_core_for(cpu_flags())
        if core:
            settings["OPENBLAS_CORETYPE"] = core
    if "OPENBLAS_THREAD_TIMEOUT" not in os.environ and "GOTO_THREAD_TIMEOUT" not in os.environ:
        settings["OPENBLAS_THREAD_TIMEOUT"] = str(OPENBLAS_THREAD_TIMEOUT_LOG2)
    os.environ.update(settings)
    try:
        handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    finally:
        for name in settings:
            del os.environ[name]
    global _blas_handle
    _loaded_blas, _blas_handle = path, handle
    return path


def openblas_core() -> Optional[str]:
    """The kernel family the loaded OpenBLAS runs (openblas_get_corename), or None."""
    try:
        get = _blas_handle.openblas_get_corename
    except AttributeError:  # nothing loaded, or a BLAS without it
        return None
    get.restype = ctypes.c_char_p
    return get().decode()


def blas_in_use() -> str:
    """'openblas (PATH)', 'accelerate' on macOS, or 'reference' (the slow bundled BLAS)."""
    if platform.system() == "Darwin":
        return "accelerate"
    if _loaded_blas:
        core = openblas_core()
        return f"openblas ({_loaded_blas}, {core} kernels)" if core else f"openblas ({_loaded_blas})"
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        return f"openblas ({os.environ['LD_PRELOAD']})"
    return "reference"
