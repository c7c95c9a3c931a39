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

from . import cpu, switch
from .gpu_attention import ATTN_GPU_MAX_ROWS, ATTN_HEAD_DIMS, cuda_quant_attention, metal_quant_attention
from .gpu_qmm import cuda_available, metal_available
from .paged_attention import in_query_blocks
from .prefill_attention import PREFILL_MIN_QUERIES, prefill_attention

#: Most query rows per KV head the CPU kernel takes (n_rep * L: GQA group times verify width) for any
#: number of positions; fewer than PREFILL_MIN_QUERIES positions (decode and verify widths) always run on
#: it, whatever their rows, so that a verify row is computed as a one-token step's; more rows of a prefill
#: chunk run the tiled prefill path, of anything else the reference in row chunks.
ATTN_MAX_ROWS = 64
#: Query rows per chunk of the reference path (bounds its score matrix to [n_kv, rows, S]).
REFERENCE_ROW_CHUNK = 256

Packed = Tuple[mx.array, mx.array, mx.array]

__all__ = ["ATTN_MAX_ROWS", "attention_backend", "channel_keys_attention", "merge_attention", "packed_bits",
           "quant_attention", "reference_channel_keys_attention", "reference_quant_attention"]


def packed_bits(packed: Packed, group_size: int) -> Tuple[int, int]:
    """(bits, head_dim) of a packed cache (w [H, C, D * bits / 32] uint32, scales [H, C, D / group_size])."""
    w, scales, _ = packed
    dim = scales.shape[-1] * group_size
    return w.shape[-1] * 32 // dim, dim


def attention_backend() -> str:
    """Which implementation `quant_attention` runs for decode and verify rows here: 'metal', 'cuda' (the
    GPU kernel of metal_kernels/quant_attention.metal, only where the kernel self-check passed it on this
    device: kernels/switch.py), 'cpu-<isa>' (the CPU kernel) or 'reference'."""
    if metal_available() and switch.enabled("quant_attention"):
        return "metal"
    if cuda_available() and switch.enabled("quant_attention"):
        return "cuda"
    return cpu.cpu_backend()


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


def _in_position_blocks(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
                        group_size: int, k_bits: int, v_bits: int) -> mx.array:
    """The CPU kernel over blocks of at most PAGED_MAX_QUERIES of the query positions (quant_attention's
    operands; in_query_blocks): [n_kv, R, Dv], each row as a decode step at its position computes it."""
    n_kv, R, D = q.shape
    grouped = q.reshape(n_kv, R // positions, positions, D)  # row r of q is position r % positions

    def block(qb: mx.array, i: int) -> mx.array:  # qb [n_kv, n_rep, n, D], positions i .. i + n - 1
        n_rep, n = qb.shape[1], qb.shape[2]
        out = cpu.cpu_quant_attention(qb.reshape(n_kv, n_rep * n, D), keys, values, length - positions + i + n,
                                      scale, n, group_size, k_bits, v_bits)  # [n_kv, n_rep * n, Dv]
        return out.reshape(n_kv, n_rep, n, -1)

    return in_query_blocks(block, grouped).reshape(n_kv, R, -1)  # [n_kv, R, Dv]


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
        [n_kv, R, Dv] in q's dtype, accumulated in float32: the kernel for up to ATTN_MAX_ROWS rows or
        fewer than PREFILL_MIN_QUERIES positions (GPU: ATTN_GPU_MAX_ROWS rows), on the CPU a prefill
        chunk (positions >= PREFILL_MIN_QUERIES) on the tiled prefill attention over the dequantized K/V
        (where the products round x to int8, cpu.int8_activations(): on the kernel in blocks of
        PAGED_MAX_QUERIES positions), else the reference.

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
    elif backend != "reference" and (q.shape[1] <= ATTN_MAX_ROWS or positions < PREFILL_MIN_QUERIES):
        return cpu.cpu_quant_attention(q, keys, values, length, scale, positions, group_size, k_bits, v_bits)
    elif backend != "reference" and cpu.int8_activations():  # every row as a decode step computes it
        return _in_position_blocks(q, keys, values, length, scale, positions, group_size, k_bits, v_bits)
    elif backend != "reference" and positions >= PREFILL_MIN_QUERIES:  # a prefill chunk: tiled, dequantized K/V
        n_kv, R, _ = q.shape
        k = _dequantize_f32(keys, length, group_size, k_bits)[None]  # [1, n_kv, S, D]
        v = _dequantize_f32(values, length, group_size, v_bits)[None]  # [1, n_kv, S, Dv]
        out = prefill_attention(q.reshape(1, R // positions * n_kv, positions, dim), k, v, scale)  # [1, n_q, P, Dv]
        return out.reshape(n_kv, R, v.shape[-1])
    return reference_quant_attention(q, keys, values, length, scale, positions, group_size)


def reference_channel_keys_attention(q: mx.array, keys: Packed, values: Packed, length: int, scale: float,
                                     group_size: int) -> Tuple[mx.array, mx.array]:
    """The pure-mx oracle of channel_keys_attention: (out [H, R, Dv], lse [H, R]) float32."""
    w, s, b = keys
    k_bits = w.shape[-1] * 32 // (s.shape[-1] * group_size)
    v_bits, _ = packed_bits(values, group_size)
    k = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size, bits=k_bits)
    k = k[:, :, :length].swapaxes(1, 2)  # [H, S, D]
    v = _dequantize_f32(values, length, group_size, v_bits)  # [H, S, Dv]
    scores = (q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)  # [H, R, S]
    lse = mx.logsumexp(scores, axis=-1)  # [H, R]
    return mx.exp(scores - lse[..., None]) @ v, lse


def channel_keys_attention(q: mx.array, keys: Packed, values: Packed, length: int, scale: float,
                           group_size: int) -> Tuple[mx.array, mx.array]:
    """Attention over KIVI's packed tokens (arXiv 2402.02750), every one visible to every query row.

    Args:
        q: [n_kv, R, D] queries (R <= ATTN_MAX_ROWS on the kernel; more rows run the reference).
        keys: (w [n_kv, D, C * k_bits / 32] uint32, scales, biases [n_kv, D, C / group_size]): each channel
            quantized along tokens in groups of group_size tokens.
        values: per token, as quant_attention's.
        length: packed tokens attended to (a multiple of group_size).

    Returns:
        (out [n_kv, R, Dv], lse [n_kv, R]) float32, lse the log of the softmax denominator, for
        merge_attention with the float window's part.
    """
    k_bits = keys[0].shape[-1] * 32 // (keys[1].shape[-1] * group_size)
    v_bits, _ = packed_bits(values, group_size)
    if q.shape[1] <= ATTN_MAX_ROWS and attention_backend().startswith("cpu-"):
        return cpu.cpu_quant_attention(q, keys, values, length, scale, 1, group_size, k_bits, v_bits,
                                       channel_keys=True, with_lse=True)
    return reference_channel_keys_attention(q, keys, values, length, scale, group_size)


def merge_attention(parts) -> mx.array:
    """Attention over the union of disjoint key sets from each set's (out [..., Dv], lse [...]) float32:
    sum_i out_i exp(lse_i - m) / sum_i exp(lse_i - m), m = max_i lse_i."""
    m = parts[0][1]
    for _, lse in parts[1:]:
        m = mx.maximum(m, lse)
    weights = [mx.exp(lse - m) for _, lse in parts]
    total = sum(w[..., None] * out for (out, _), w in zip(parts, weights))
    return total / sum(weights)[..., None]
