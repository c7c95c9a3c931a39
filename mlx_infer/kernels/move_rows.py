"""The repacker's copy (kv/repack.py, issue 13): move rows inside one pool array, in place where the CPU
kernel runs; and a batched step's write of new rows into a pool array.

    a = move_rows(a, src, dst)      # a [R, W]; src, dst int32 [M]: row dst[i] gets row src[i]
    a = write_rows(a, x, dst)       # x [..., W] (M rows): row dst[i] gets row i of x

The reference (`mx.take` then a scatter into the same array) is correct everywhere, but its gather holds
the array while the scatter runs, so MLX cannot donate the buffer and the scatter copies all R rows: at a
long prompt a repack then costs its decode step a copy of the whole pool (bench/kv.py --step-times,
docs/kv.md#what-a-repack-costs-a-decode-step), where on the kernel it costs about nothing. The CPU kernel
(cpu_kernels/move.cpp) is one MLX operation: it takes the array's buffer when MLX can donate it and copies
only the M moved rows. On a GPU the reference runs (its copy is a device-memory pass).
"""

import mlx.core as mx

from . import cpu

__all__ = ["move_rows", "move_rows_backend", "reference_move_rows", "write_rows"]


def move_rows_backend() -> str:
    """Which implementation `move_rows` runs here: 'cpu-<isa>' (the kernel, on MLX's CPU device) or
    'reference'."""
    return cpu.cpu_backend()


def reference_move_rows(a: mx.array, src: mx.array, dst: mx.array) -> mx.array:
    """The oracle: a [R, W] with row dst[i] replaced by row src[i] of a (one gather, one scatter)."""
    moved = mx.take(a, src, axis=0)  # [M, W]
    a[dst] = moved
    return a


def move_rows(a: mx.array, src: mx.array, dst: mx.array) -> mx.array:
    """a [R, W] (any dtype) with row dst[i] replaced by row src[i] of a, src / dst int32 [M] in [0, R); the
    reads see a before any write, so src and dst may overlap. On the CPU kernel where it runs (in place
    when MLX can donate a's buffer), else the reference. Runs on the current default stream.

    Raises:
        ValueError: a not 2-D, or src / dst not int32 [M] of one size.
    """
    if a.ndim != 2 or src.ndim != 1 or src.shape != dst.shape or src.dtype != mx.int32 or dst.dtype != mx.int32:
        raise ValueError(f"move_rows: a must be [R, W] and src, dst int32 [M] of one size; got {tuple(a.shape)}, "
                         f"{src.dtype} {tuple(src.shape)}, {dst.dtype} {tuple(dst.shape)}")
    if move_rows_backend() == "reference":
        return reference_move_rows(a, src, dst)
    return cpu.cpu_move_rows(a, src, dst)


def write_rows(a: mx.array, x: mx.array, dst: mx.array) -> mx.array:
    """a [R, W] with row dst[i] replaced by row i of x [..., W] (a's dtype, leading axes flattened into M
    rows), dst int32 [M] in [0, R). On the CPU kernel where it runs: one operation, in place when MLX can
    donate a's buffer (MLX's scatter `a[dst] = x` wants x reshaped to [M, W] first: two operations, which
    run otherwise, on the current default stream).

    Raises:
        ValueError: a not 2-D, x of another width or dtype, or dst not int32 [M].
    """
    if a.ndim != 2 or x.shape[-1:] != a.shape[1:] or x.dtype != a.dtype or dst.dtype != mx.int32 \
            or dst.shape != (x.size // max(a.shape[1], 1),):
        raise ValueError(f"write_rows: a must be [R, W], x [..., W] of a's dtype and dst int32 [M]; got "
                         f"{tuple(a.shape)} {a.dtype}, {tuple(x.shape)} {x.dtype}, {tuple(dst.shape)} {dst.dtype}")
    if move_rows_backend() == "reference":
        a[dst] = x.reshape(-1, a.shape[1])
        return a
    return cpu.cpu_write_rows(a, x, dst)
