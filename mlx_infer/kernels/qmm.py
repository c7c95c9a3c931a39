"""The kernel layer's quantized matmul: `qmm` picks the Metal, CUDA or CPU kernel, or the pure-mx
reference, by the default device and what is available (without a kernel for them, a wide path for prefill).

    y = qmm(x, w, scales, biases, group_size, bits)
      == mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

Skinny products (at most QMM_MAX_ROWS rows: decode, verify widths, block drafts) run on a kernel that
reads each weight group once for all rows (MLX's CPU quantized matmul is a plain loop: a 16-row product
costs 16x a 1-row one). On the CPU the kernel takes products of every row count (prefill too: in passes
of rows that stay in L2, each weight row dequantized once per pass into an L1 scratch), measured faster
than dequantizing the weight for BLAS at every size tried (docs/kernels.md). Without the CPU kernel, wider products
(prefill) never fall back to MLX's loop either: on the CPU the weight is dequantized once (in tiles of
WIDE_TILE_ROWS rows, bounding the float32 temporary) and multiplied by BLAS; on a GPU MLX's own quantized
matmul runs.
"""

import math
from typing import Optional

import mlx.core as mx

from . import cpu, switch
from .gpu_qmm import QMM_MAX_ROWS, cuda_available, cuda_qmm, metal_available, metal_qmm

#: Weight rows dequantized at a time by the CPU wide path (8192 x K float32: 19 MB at K = 576).
WIDE_TILE_ROWS = 8192

__all__ = ["QMM_MAX_ROWS", "WIDE_TILE_ROWS", "gpu_operands", "qmm", "qmm_backend", "reference_qmm", "result_dtype", "wide_qmm"]


def qmm_backend() -> str:
    """Which implementation `qmm` runs for skinny products here: 'metal', 'cuda' (only where the kernel
    self-check recorded it as correct and faster on this device: kernels/switch.py), 'cpu-avx512',
    'cpu-avx2', 'cpu-neon', 'cpu-generic' or 'reference' (MLX's own mx.quantized_matmul). On the CPU
    the first call may build the CPU kernels (see mlx_infer.kernels.cpu)."""
    if mx.default_device() == mx.gpu:
        if not switch.enabled("qmm"):
            return "reference"
        if metal_available():
            return "metal"
        if cuda_available():
            return "cuda"
        return "reference"
    return f"cpu-{cpu.isa()}" if cpu.available() else "reference"


def reference_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                  bits: int) -> mx.array:
    """The pure-mx oracle: mx.quantized_matmul(x, w, scales, biases, transpose=True, ...)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def result_dtype(x_dtype: mx.Dtype, scales_dtype: mx.Dtype) -> mx.Dtype:
    """The dtype of qmm's result, as mx.quantized_matmul promotes: the common dtype of x and scales
    (for float32 / float16 / bfloat16: the dtype itself when they match, else float32)."""
    return x_dtype if x_dtype == scales_dtype else mx.float32


def gpu_operands(x: mx.array, scales: mx.array, biases: mx.array):
    """scales / biases in x's dtype for the GPU kernels (which take them so), when that cast is exact
    (same dtype, or float16 / bfloat16 to float32); else None (the reference runs)."""
    if scales.dtype == x.dtype:
        return scales, biases
    if result_dtype(x.dtype, scales.dtype) == x.dtype:
        return scales.astype(x.dtype), biases.astype(x.dtype)
    return None


def _skinny(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
            bits: int) -> mx.array:
    """x [M, K], M <= QMM_MAX_ROWS -> y [M, N] on the GPU kernel available where the kernel self-check
    passed it on this device (switch.enabled("qmm")), else the reference (the CPU kernel takes its rows
    before this, in qmm)."""
    if mx.default_device() == mx.gpu and switch.enabled("qmm"):
        operands = gpu_operands(x, scales, biases)
        if operands is not None and metal_available():
            return metal_qmm(x, w, *operands, group_size, bits)
        if operands is not None and cuda_available():
            return cuda_qmm(x, w, *operands, group_size, bits)
    return reference_qmm(x, w, scales, biases, group_size, bits)


def wide_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
             bits: int) -> mx.array:
    """The prefill path: x [M, K] (any M) -> y [M, N] in promote_types(x, scales), accumulated in float32.

    On the CPU (without the CPU kernels, which take every row count) the weight is dequantized to float32
    once per call, WIDE_TILE_ROWS rows at a time, and multiplied by the float matmul (BLAS); on a GPU MLX's
    quantized matmul runs.
    """
    out_dtype = result_dtype(x.dtype, scales.dtype)
    if mx.default_device() == mx.gpu:
        return reference_qmm(x, w, scales, biases, group_size, bits)
    xf = x.astype(mx.float32)  # [M, K]
    tiles = []
    for n0 in range(0, w.shape[0], WIDE_TILE_ROWS):
        rows = slice(n0, n0 + WIDE_TILE_ROWS)
        wf = mx.dequantize(w[rows], scales[rows].astype(mx.float32), biases[rows].astype(mx.float32),
                           group_size=group_size, bits=bits)  # [T, K]
        tiles.append(xf @ wf.T)  # [M, T]
    y = tiles[0] if len(tiles) == 1 else mx.concatenate(tiles, axis=1)  # [M, N]
    return y.astype(out_dtype)


def qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
        residual: Optional[mx.array] = None) -> mx.array:
    """y = x @ dequantize(w, scales, biases).T for MLX's affine quantization, on the best path here.

    Args:
        x: [..., K] float32, float16 or bfloat16; the leading axes are flattened into M rows.
        w: [N, K * bits / 32] uint32 (value j of a word in bits [bits*j, bits*j + bits)).
        scales, biases: [N, K / group_size] float32 / float16 / bfloat16.
        group_size: 32, 64 or 128.
        bits: 4 or 8.
        residual: optional [..., N]: the result is then residual + y, bit for bit as that add gives it (on the
            CPU kernel, float32 operands, in the product's own operation: no add in the graph).

    Returns:
        y [..., N] in promote_types(x.dtype, scales.dtype), as mx.quantized_matmul(..., transpose=True)
        up to float32 rounding: on the CPU kernel every row count (a row's result never depends on how
        many rows the call has); elsewhere M <= QMM_MAX_ROWS on the GPU kernel available, more rows the
        wide path (wide_qmm).

    Raises:
        ValueError (MlxInferError from the GPU kernels): shapes, dtypes, bits or group size the kernels
            do not take.
    """
    shape = x.shape
    rows = math.prod(shape[:-1])
    kernel = rows > 0 and mx.default_device() == mx.cpu and cpu.available()
    if residual is not None:
        if (kernel and residual.dtype == mx.float32 and result_dtype(x.dtype, scales.dtype) == mx.float32
                and residual.shape == (*shape[:-1], w.shape[0])):
            return cpu.cpu_qmm(x, w, scales, biases, group_size, bits, residual)  # [..., N]
        return residual + qmm(x, w, scales, biases, group_size, bits)
    if rows == 0:  # nothing to multiply; MLX's op gives the empty result's shape and dtype
        return reference_qmm(x, w, scales, biases, group_size, bits)
    if kernel:
        return cpu.cpu_qmm(x, w, scales, biases, group_size, bits)  # [..., N]: no reshapes in the graph
    x2 = x if len(shape) == 2 else x.reshape(rows, shape[-1])  # [M, K]
    if rows <= QMM_MAX_ROWS:
        y = _skinny(x2, w, scales, biases, group_size, bits)
    else:
        y = wide_qmm(x2, w, scales, biases, group_size, bits)
    return y if len(shape) == 2 else y.reshape(*shape[:-1], w.shape[0])  # [..., N]
