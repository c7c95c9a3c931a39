"""The compute backend MLX runs on, and the CPU fast path (float32 weights where the CPU backend's quantized
matmul is slow and an optimized BLAS is loaded; see blas.py)."""

import ctypes
import ctypes.util
import os

import mlx.core as mx

from .blas import blas_in_use, openblas_core  # noqa: F401  (re-exported: what doctor and bench report)


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': where MLX's default device runs."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "gpu"


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


#: mallopt's parameter number for M_ARENA_MAX (glibc's malloc.h).
_M_ARENA_MAX = -8


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas at `arenas` (mallopt M_ARENA_MAX), unless the user set MALLOC_ARENA_MAX. Without
    a cap every thread that allocates may get an arena of its own (up to 8 per core): a long-running server's
    threads (decode, model loads, HTTP) leave freed pages spread over them that malloc_trim cannot give back
    whole. Call it before the threads start. True when applied; False elsewhere (not glibc, or the
    variable set)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    libc = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(libc), "mallopt", None) if libc else None
    return bool(mallopt is not None and mallopt(_M_ARENA_MAX, arenas))


def return_free_memory() -> None:
    """Give freed memory back to the system: MLX's cache of freed buffers (mx.clear_cache), then, with glibc,
    the C heap's free pages (malloc_trim: MLX's CPU buffers of up to 32 MiB come from the heap, whose free
    pages stay mapped otherwise; measured: after 16 batched requests and the pool shrunk, RSS 646 MiB
    without it, 259 MiB with it, against 263 MiB before the requests)."""
    mx.clear_cache()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
