"""The kernel layer's attention over a quantized KV cache: `quant_attention` picks the CPU kernel or the
pure-mx reference (the oracle) by the default device and what is available.

    out = quant_attention(q, (k, k_scales, k_biases), (v, v_scales, v_biases), length=S, scale=D ** -0.5,
                          positions=L, group_size=64)

On a GPU the kernel is metal_kernels/quant_attention.metal (Metal, and CUDA through its prelude; up to
ATTN_GPU_MAX_ROWS rows, head dims 64 / 128 / 256); other shapes and prefill run the reference there.

The cache holds K and V in MLX's affine layout, one row per token (groups along head_dim), with room for
more tokens than `length`. The kernel reads each packed K/V row once for all query rows of a GQA group
(decode: the n_rep heads sharing a KV head; verify widths: n_rep x L rows), dequantizes it in registers
and keeps an online softmax (flash-decoding, arXiv 2307.08691: the sequence is split into chunks over the
cores and the partial results merged), so neither the float K/V nor the score matrix is ever materialized.
"""

from typing import Tuple

import mlx.core as mx

from . import cpu
from .gpu_attention import ATTN_GPU_MAX_ROWS, ATTN_HEAD_DIMS, cuda_quant_attention, metal_quant_attention
from .gpu_qmm import cuda_available, metal_available

#: Most query rows per KV head the CPU kernel takes (n_rep * L: GQA group times verify width); more
#: rows (prefill) run the reference in row chunks.
ATTN_MAX_ROWS = 64
#: Query rows per chunk of the reference path (bounds its score matrix to [n_kv, rows, S]).
REFERENCE_ROW_CHUNK = 256

Packed = Tuple[mx.array, mx.array, mx.array]

__all__ = ["ATTN_MAX_ROWS", "attention_backend", "packed_bits", "quant_attention", "reference_quant_attention"]


def packed_bits(packed: Packed, group_size: int) -> Tuple[int, int]:
    """(bits, head_dim) of a packed cache (w [H, C, D * bits / 32] uint32, scales [H, C, D / group_size])."""
    w, scales, _ = packed
    dim = scales.shape[-1] * group_size
    return w.shape[-1] * 32 // dim, dim


def attention_backend() -> str:
    """Which implementation `quant_attention` runs for decode and verify rows here: 'metal', 'cuda' (the
    GPU kernel of metal_kernels/quant_attention.metal), 'cpu-<isa>' (the CPU kernel) or 'reference'."""
    if metal_available():
        return "metal"
    if cuda_available():
        return "cuda"
    if mx.default_device() == mx.cpu and cpu.available():
        return f"cpu-{cpu.isa()}"
    return "reference"


def _causal_mask(rows: int, positions: int, length: int, row0: int = 0) -> mx.array:
    """[rows, length] bool: query row r (position (row0 + r) % positions of the last `positions` tokens)
    sees key s iff s <= length - positions + (row0 + r) % positions."""
    pos = (mx.arange(row0, row0 + rows) % positions) + (length - positions)  # [rows]
    return mx.arange(length)[None, :] <= pos[:, None]


def _dequantize_f32(packed: Packed, length: int, group_size: int, bits: int) -> mx.array:
    w, scales, biases = (a[:, :length] for a in packed)
    return mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)


def reference_quant_attention(q: mx.array, keys: Packed, values: Packed, length: int, scale: float,
                              positions: int, group_size: int) -> mx.array:
    """The pure-mx oracle of quant_attention: dequantize the first `length` K/V rows to float32, then
    softmax(q k^T * scale) v in float32, causal over the last `positions` tokens. Same arguments and
    result as quant_attention."""
    k_bits, _ = packed_bits(keys, group_size)
    v_bits, _ = packed_bits(values, group_size)
    k = _dequantize_f32(keys, length, group_size, k_bits)  # [H, S, D]
    v = _dequantize_f32(values, length, group_size, v_bits)  # [H, S, Dv]
    outs = []
    for r0 in range(0, q.shape[1], REFERENCE_ROW_CHUNK):
        qc = q[:, r0:r0 + REFERENCE_ROW_CHUNK].astype(mx.float32) * scale  # [H, r, D]
        scores = qc @ k.swapaxes(-1, -2)  # [H, r, S]
        if positions > 1:
            mask = _causal_mask(qc.shape[1], positions, length, r0)
            scores = mx.where(mask[None], scores, -float("inf"))
        outs.append(mx.softmax(scores, axis=-1, precise=True) @ v)  # [H, r, Dv]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return out.astype(q.dtype)


def quant_attention(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
                    group_size: int) -> mx.array:
    """Attention of query rows over a quantized KV cache, on the best path here.

    Args:
        q: [n_kv, R, D] float32 / float16 / bfloat16 queries (RoPE applied), R = n_rep * positions: row r
            is query position r % positions of a GQA group's heads.
        keys: (w [n_kv, C, D * k_bits / 32] uint32, scales, biases [n_kv, C, D / group_size]), C >= length.
        values: the same for V (its own bits and head dim Dv).
        length: tokens of the cache attended to (S >= positions; the last `positions` are the queries').
        scale: the softmax scale (usually D ** -0.5).
        positions: query positions per head (1: decode, every key visible; more: causal, query i of the
            last `positions` tokens sees keys 0 .. length - positions + i).
        group_size: quantization group along head_dim (32, 64 or 128).

    Returns:
        [n_kv, R, Dv] in q's dtype, accumulated in float32.

    Raises:
        ValueError: shapes that do not agree, or bits / group sizes other than 4 / 8 and 32 / 64 / 128.
    """
    k_bits, dim = packed_bits(keys, group_size)
    v_bits, _ = packed_bits(values, group_size)
    if q.ndim != 3 or q.shape[-1] != dim or q.shape[0] != keys[0].shape[0]:
        raise ValueError(f"quant_attention: q must be [n_kv={keys[0].shape[0]}, R, {dim}], got {tuple(q.shape)}")
    if not 1 <= positions <= length <= keys[0].shape[1] or q.shape[1] % positions:
        raise ValueError(f"quant_attention: need 1 <= positions ({positions}) <= length ({length}) <= cache rows "
                         f"({keys[0].shape[1]}) and R ({q.shape[1]}) a multiple of positions")
    backend = attention_backend()
    if backend in ("metal", "cuda"):
        fits = q.shape[1] <= ATTN_GPU_MAX_ROWS and dim in ATTN_HEAD_DIMS and packed_bits(values, group_size)[1] in ATTN_HEAD_DIMS
        if fits:
            run = metal_quant_attention if backend == "metal" else cuda_quant_attention
            return run(q, keys, values, length, scale, positions, group_size)
    elif backend != "reference" and q.shape[1] <= ATTN_MAX_ROWS:
        return cpu.cpu_quant_attention(q, keys, values, length, scale, positions, group_size, k_bits, v_bits)
    return reference_quant_attention(q, keys, values, length, scale, positions, group_size)
