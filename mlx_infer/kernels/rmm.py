"""The kernel layer's reduced quantized matmul (RMM, arXiv 2608.13426): each row of x keeps the `keep`
quantization groups of the contraction axis with the largest activation mass and multiplies only those.

    y = rmm_qmm(x, w, scales, biases, group_size, bits, keep)

For row m, group g (columns [g*group_size, (g+1)*group_size)) scores s[m, g] = sum_j |x[m, j]| (the
paper's activation column norm ||A[:, j]||_2 of a one-row A, summed over the group), accumulated in
float32. Group g beats group h when s[m, g] > s[m, h], or the scores are equal and g < h; row m keeps the
groups beaten by fewer than `keep` others. Then

    y[m, n] = sum over kept g of sum_{j in g} x[m, j] * dequantize(w)[n, j].

Selection is per row, so the product of a row does not depend on the other rows of the call (a prompt
gives the same result in one chunk or token by token, and a verify forward the same as plain decoding).
The kernels (CPU: cpu_kernels/rmm.cpp; GPU: metal_kernels/rmm_qmm.metal and its CUDA twin, kernels.gpu_rmm)
compute the scores and the selection themselves (no host round trip) and read the packed weight only for
the groups some row keeps: with one row, keep/(K/group_size) of the weight groups.
keep = K/group_size is the exact product.
"""

import math

import mlx.core as mx

from . import cpu, switch
from .gpu_qmm import cuda_available, metal_available
from .gpu_rmm import RMM_MAX_GROUPS, cuda_rmm_qmm, metal_rmm_qmm
from .qmm import QMM_MAX_ROWS, gpu_operands, qmm, reference_qmm

__all__ = ["group_keep", "group_mask", "kept_columns", "reference_rmm_qmm", "rmm_backend", "rmm_qmm"]


def group_keep(k: int, group_size: int, retention: float) -> int:
    """Groups kept per row at retention ratio rho: ceil(rho * K / group_size), at least 1 (the paper's
    ceil(rho * d) counted in whole groups)."""
    groups = k // group_size
    return max(1, min(groups, math.ceil(retention * groups - 1e-9)))


def group_mask(x: mx.array, group_size: int, keep: int) -> mx.array:
    """The selection of rmm_qmm as a mask: x [M, K] -> [M, K / group_size] bool, True for the `keep`
    groups each row keeps (largest sum of |x| over the group; equal sums: the lower group index).

    The ranking compares every pair of groups ([M, G, G]), so ties are broken exactly as the kernels
    break them, with no dependence on a sort's stability."""
    rows, k = x.shape
    scores = mx.abs(x.astype(mx.float32)).reshape(rows, k // group_size, group_size).sum(axis=-1)  # [M, G]
    g = scores.shape[1]
    idx = mx.arange(g)
    # beats[m, g, h]: group h beats group g in row m
    beats = (scores[:, None, :] > scores[:, :, None]) | (
        (scores[:, None, :] == scores[:, :, None]) & (idx[None, None, :] < idx[None, :, None]))
    return beats.sum(axis=-1) < keep  # [M, G]


def reference_rmm_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                      keep: int) -> mx.array:
    """The pure-mx oracle: x [M, K] with its dropped groups zeroed, through mx.quantized_matmul. Returns
    y [M, N] in promote_types(x.dtype, scales.dtype)."""
    return reference_qmm(kept_columns(x, group_size, keep), w, scales, biases, group_size, bits)


def kept_columns(x: mx.array, group_size: int, keep: int) -> mx.array:
    """x [M, K] with the groups each row drops (group_mask) zeroed."""
    cols = mx.repeat(group_mask(x, group_size, keep), group_size, axis=1)  # [M, K]
    return mx.where(cols, x, mx.zeros_like(x))


def rmm_backend() -> str:
    """Which implementation rmm_qmm runs for skinny products here: 'metal', 'cuda', 'cpu-<isa>' or
    'reference' (the GPU kernels only where the kernel self-check passed them on this device: kernels/switch.py)."""
    if mx.default_device() == mx.gpu:
        if not switch.enabled("rmm_qmm"):
            return "reference"
        return "metal" if metal_available() else "cuda" if cuda_available() else "reference"
    return f"cpu-{cpu.isa()}" if cpu.available() else "reference"


def _skinny(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
            keep: int):
    """x [M, K], M <= QMM_MAX_ROWS -> y [M, N] on a kernel, or None where none takes the operands."""
    if mx.default_device() == mx.gpu:
        operands = gpu_operands(x, scales, biases)
        if operands is None or x.shape[1] // group_size > RMM_MAX_GROUPS or not switch.enabled("rmm_qmm"):
            return None
        if metal_available():
            return metal_rmm_qmm(x, w, *operands, group_size, bits, keep)
        if cuda_available():
            return cuda_rmm_qmm(x, w, *operands, group_size, bits, keep)
        return None
    if cpu.available():
        return cpu.cpu_rmm_qmm(x, w, scales, biases, group_size, bits, keep)
    return None


def rmm_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
            keep: int) -> mx.array:
    """The reduced product on the best path here (see the module docstring).

    Args:
        x: [..., K] float32 / float16 / bfloat16; leading axes are flattened into M rows.
        w: [N, K * bits / 32] uint32, MLX's affine packing; scales, biases [N, K / group_size].
        group_size: 32, 64 or 128. bits: 4 or 8.
        keep: groups kept per row, 1 <= keep <= K / group_size (K / group_size: the exact qmm).

    Returns:
        y [..., N] in promote_types(x.dtype, scales.dtype), accumulated in float32. Up to
        QMM_MAX_ROWS rows run the kernel of rmm_backend() (which reads only kept groups); more rows, or
        no kernel, the reference (dropped groups zeroed, then qmm).

    Raises:
        ValueError: keep out of range, or operands qmm does not take.
    """
    shape = x.shape
    k = shape[-1]
    groups = k // group_size
    if not 1 <= keep <= groups:
        raise ValueError(f"rmm_qmm: keep must be in [1, {groups}] for K={k} and group_size={group_size}, got {keep}")
    if keep == groups:
        return qmm(x, w, scales, biases, group_size, bits)
    rows = math.prod(shape[:-1])
    x2 = x.reshape(rows, k)  # [M, K]
    y = _skinny(x2, w, scales, biases, group_size, bits, keep) if rows <= QMM_MAX_ROWS else None
    if y is None:
        y = qmm(kept_columns(x2, group_size, keep), w, scales, biases, group_size, bits)
    return y.reshape(*shape[:-1], w.shape[0])  # [..., N]
