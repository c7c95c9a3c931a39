"""The kernel layer's attention over a paged KV pool (issue 13): `paged_attention` (float blocks) and
`paged_quant_attention` (quantized blocks) run the CPU kernel (cpu_kernels/attn_body.h, PagedRows /
PagedQuantRows) or the pure-mx reference (the oracle) by the default device and what is available.

    out = paged_attention(q, *pool.layer_kv(layer), index, lengths, q_pos, k_pos, D ** -0.5)
    out = paged_quant_attention(q, *pool.layer_kv(layer), index, lengths, q_pos, k_pos,
                                D ** -0.5, group_size)      # layer_kv: (codes, scales, biases) each

The pool holds every request's K/V rows (BlockPool: row = head * slots + slot); a request's live tokens are
scattered over its blocks. The reference gathers them (`mx.take`: a [B, n_kv, S, D] copy per layer and per
K/V) and runs masked attention; the kernel reads each row in place through the token table's index, once
for all n_rep * L query rows of its KV head (decode: the GQA group; verify: times the draft width), with
an online softmax over tiles of 32 keys and the sequence split over the cores (flash-decoding, arXiv
2307.08691), so neither the gathered K/V nor the mask nor the score matrix is materialized. Over quantized
blocks (each row packed in MLX's affine layout, groups along head_dim) the kernel dequantizes a tile's rows
into its L1 scratch as it reads them; the reference gathers the packed rows and dequantizes them.
"""

import math
from typing import Sequence

import mlx.core as mx

from . import cpu

#: Most query positions per request (L: decode 1, verify widths) one kernel call takes; a longer forward
#: runs in blocks of this many (in_query_blocks). A lone request's longer forwards (prefill chunks) take the
#: tiled prefill attention instead (paged_kernel_fits), a batched forward's the kernel at every width.
PAGED_MAX_QUERIES = 16
#: The kernel's head dims (D and Dv) are multiples of this (its widest vector).
PAGED_HEAD_DIM_MULTIPLE = 16

__all__ = ["PAGED_MAX_QUERIES", "in_query_blocks", "packed_row_bits", "paged_attention", "paged_attention_backend",
           "paged_kernel_fits", "paged_kernel_runs", "paged_quant_attention", "reference_paged_attention",
           "reference_paged_quant_attention", "visible_keys"]


def paged_attention_backend() -> str:
    """Which implementation `paged_attention` runs for decode and verify rows here: 'cpu-<isa>' (the CPU
    kernel, on MLX's CPU device) or 'reference'."""
    return cpu.cpu_backend()


def paged_kernel_runs(k_dim: int, v_dim: int) -> bool:
    """Whether `paged_attention` / `paged_quant_attention` run the kernel here for head dims k_dim / v_dim (at
    any number of query positions, in blocks of PAGED_MAX_QUERIES): multiples of PAGED_HEAD_DIM_MULTIPLE and
    the CPU kernel available; else they run the reference."""
    return (k_dim % PAGED_HEAD_DIM_MULTIPLE == 0 and v_dim % PAGED_HEAD_DIM_MULTIPLE == 0
            and paged_attention_backend() != "reference")


def paged_kernel_fits(queries: int, k_dim: int, v_dim: int) -> bool:
    """Whether a lone request's forward of `queries` positions (L) should attend on the kernel here
    (paged_kernel_runs) rather than the tiled prefill attention: L <= PAGED_MAX_QUERIES (decode and verify
    widths: each row then equals a one-token step's), or any L where the products round x to int8
    (cpu.int8_activations(): then a prefill chunk's rows equal decode steps' too)."""
    return (queries <= PAGED_MAX_QUERIES or cpu.int8_activations()) and paged_kernel_runs(k_dim, v_dim)


def _check(q: mx.array, k_shape: tuple, v_shape: tuple, index: mx.array, lengths: mx.array,
           q_pos: mx.array, k_pos: mx.array, window: int) -> None:
    """k_shape / v_shape: the pool's (rows, D) and (rows, Dv) (quantized blocks: the dequantized rows')."""
    if q.ndim != 4 or len(k_shape) != 2 or len(v_shape) != 2 or index.ndim != 3:
        raise ValueError(f"paged_attention: q must be [B, n_q, L, D], the pools [rows, D], index [B, n_kv, S]; got "
                         f"{tuple(q.shape)}, {tuple(k_shape)}, {tuple(v_shape)}, {tuple(index.shape)}")
    B, n_q, L, D = q.shape
    _, n_kv, S = index.shape
    if k_shape[1] != D or k_shape[0] != v_shape[0] or index.shape[0] != B or n_q % n_kv:
        raise ValueError(f"paged_attention: shapes do not agree: q {tuple(q.shape)}, k_pool {tuple(k_shape)}, "
                         f"v_pool {tuple(v_shape)}, index {tuple(index.shape)} (n_q a multiple of n_kv)")
    for name, a, shape in (("index", index, (B, n_kv, S)), ("lengths", lengths, (B,)), ("q_pos", q_pos, (B, L)),
                           ("k_pos", k_pos, (B, S))):
        if a.dtype != mx.int32 or tuple(a.shape) != shape:
            raise ValueError(f"paged_attention: {name} must be int32 {list(shape)}, got {a.dtype} {list(a.shape)}")
    if window < 0:
        raise ValueError(f"paged_attention: window must be >= 0 (0: none), got {window}")


def _pool_rows(pool: mx.array) -> tuple:
    """(rows, dim) of a float pool given with any leading dims ([rows, dim], [B, n_kv, capacity, dim])."""
    return math.prod(pool.shape[:-1]), pool.shape[-1]


def visible_keys(index: mx.array, lengths: mx.array, q_pos: mx.array, k_pos: mx.array, rows: int,
                 window: int) -> mx.array:
    """bool [B, n_kv, 1, L, S]: which key each query sees (the kernel's rule): t < lengths[b], index a row
    of the pool, k_pos <= q_pos and, with window > 0, q_pos - k_pos < window."""
    S = index.shape[2]
    q, k = q_pos[:, :, None], k_pos[:, None, :]  # [B, L, 1], [B, 1, S]
    seen = (k <= q) & (mx.arange(S)[None, None, :] < lengths[:, None, None])  # [B, L, S]
    if window > 0:
        seen = seen & (q - k < window)
    in_pool = (index >= 0) & (index < rows)  # [B, n_kv, S]
    return seen[:, None, None] & in_pool[:, :, None, None, :]


def _gathered_attention(q: mx.array, k: mx.array, v: mx.array, index: mx.array, lengths: mx.array,
                        q_pos: mx.array, k_pos: mx.array, rows: int, scale: float, window: int) -> mx.array:
    """Masked softmax(scale * q k^T) v in float32 over gathered rows k [B * n_kv * S, D] and v [.., Dv]
    (index's order): [B, n_q, L, Dv] in q's dtype."""
    B, n_q, L, D = q.shape
    _, n_kv, S = index.shape
    k = k.reshape(B, n_kv, 1, S, D).astype(mx.float32)
    v = v.reshape(B, n_kv, 1, S, -1).astype(mx.float32)
    qg = q.astype(mx.float32).reshape(B, n_kv, n_q // n_kv, L, D) * scale  # [B, n_kv, n_rep, L, D]
    mask = visible_keys(index, lengths, q_pos, k_pos, rows, window)  # [B, n_kv, 1, L, S]
    scores = mx.where(mask, qg @ k.swapaxes(-1, -2), -float("inf"))  # [B, n_kv, n_rep, L, S]
    probs = mx.where(mask.any(axis=-1, keepdims=True), mx.softmax(scores, axis=-1, precise=True), 0.0)
    return (probs @ v).reshape(B, n_q, L, -1).astype(q.dtype)  # [B, n_q, L, Dv]


def reference_paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, index: mx.array,
                              lengths: mx.array, q_pos: mx.array, k_pos: mx.array, scale: float,
                              window: int = 0) -> mx.array:
    """The pure-mx oracle of paged_attention: gather every request's rows (`mx.take`), then masked
    softmax(scale * q k^T) v in float32. Same arguments and result as paged_attention."""
    rows = k_pool.shape[0]
    flat = mx.clip(index, 0, rows - 1).reshape(-1)  # [B * n_kv * S]
    return _gathered_attention(q, mx.take(k_pool, flat, axis=0), mx.take(v_pool, flat, axis=0), index, lengths,
                               q_pos, k_pos, rows, scale, window)


def packed_row_bits(packed: Sequence[mx.array], group_size: int) -> int:
    """The bits of packed pool rows (codes [rows, dim * bits / 32] uint32, scales [rows, dim / group_size])."""
    w, scales, _ = packed
    return w.shape[-1] * 32 // (scales.shape[-1] * group_size)


def reference_paged_quant_attention(q: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array],
                                    index: mx.array, lengths: mx.array, q_pos: mx.array, k_pos: mx.array,
                                    scale: float, group_size: int, window: int = 0) -> mx.array:
    """The pure-mx oracle of paged_quant_attention: gather every request's packed rows (`mx.take` of codes,
    scales and biases), dequantize them to float32 (mx.dequantize), then the float reference's masked
    attention. Same arguments and result as paged_quant_attention."""
    rows = keys[0].shape[0]
    flat = mx.clip(index, 0, rows - 1).reshape(-1)  # [B * n_kv * S]

    def rows_f32(packed):
        w, s, b = (mx.take(a, flat, axis=0) for a in packed)
        return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=group_size,
                             bits=packed_row_bits(packed, group_size))

    return _gathered_attention(q, rows_f32(keys), rows_f32(values), index, lengths, q_pos, k_pos, rows, scale,
                               window)


def _check_packed(q: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array], group_size: int) -> None:
    for name, packed, dim in (("keys", keys, q.shape[-1] if q.ndim == 4 else None), ("values", values, None)):
        if len(packed) != 3 or any(a.ndim != 2 for a in packed) or packed[0].dtype != mx.uint32:
            raise ValueError(f"paged_quant_attention: {name} must be (codes uint32 [rows, dim * bits / 32], scales, "
                             f"biases [rows, dim / group_size])")
        w, s, b = packed
        bits = packed_row_bits(packed, group_size)
        if (s.shape != b.shape or s.shape[0] != w.shape[0] or bits not in (4, 8)
                or w.shape[1] * 32 != bits * s.shape[1] * group_size or w.shape[0] != keys[0].shape[0]
                or (dim is not None and s.shape[1] * group_size != dim)):
            raise ValueError(f"paged_quant_attention: {name} codes {tuple(w.shape)}, scales {tuple(s.shape)}, biases "
                             f"{tuple(b.shape)} do not agree (group_size {group_size}, bits 4 / 8, the queries' "
                             f"head dim, the same rows as the keys)")


def in_query_blocks(run, q: mx.array) -> mx.array:
    """run(q_block, start) -> [B, n_q, Lb, Dv] over blocks of at most PAGED_MAX_QUERIES of q's L positions
    (q [B, n_q, L, D]; a block holds positions start .. start + Lb - 1), concatenated along L: a wider
    forward on the kernels computes each row exactly as a decode step does (their tiles and splits lie at
    fixed key positions, and keys a row does not see add exact zeros)."""
    L = q.shape[2]
    if L <= PAGED_MAX_QUERIES:
        return run(q, 0)
    blocks = [run(q[:, :, i:i + PAGED_MAX_QUERIES], i) for i in range(0, L, PAGED_MAX_QUERIES)]  # [B, n_q, Lb, Dv]
    return mx.concatenate(blocks, axis=2)  # [B, n_q, L, Dv]


def paged_quant_attention(q: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array], index: mx.array,
                          lengths: mx.array, q_pos: mx.array, k_pos: mx.array, scale: float, group_size: int,
                          window: int = 0) -> mx.array:
    """Attention of B requests' queries over their live tokens in a paged KV pool of quantized blocks, on
    the best path here (the CPU kernel where paged_kernel_runs, in blocks of PAGED_MAX_QUERIES positions; else
    the reference).

    Args:
        q: [B, n_q, L, D] float32 / float16 / bfloat16 queries (RoPE applied).
        keys: one layer's keys of the pool (BlockPool.layer_kv(layer)[0]): (codes uint32 [rows, D * k_bits / 32],
            scales, biases [rows, D / group_size] float16 / bfloat16 / float32), MLX's affine layout.
        values: the same for V ([rows, Dv * v_bits / 32], ...; its own bits).
        index, lengths, q_pos, k_pos, scale, window: as paged_attention.
        group_size: values per scale / bias along head_dim (32, 64 or 128).

    Returns:
        [B, n_q, L, Dv] in q's dtype, accumulated in float32; zeros for a query that sees no key.

    Raises:
        ValueError: shapes or dtypes that do not agree, bits other than 4 / 8, or window < 0.
    """
    _check_packed(q, keys, values, group_size)
    dim, v_dim = keys[1].shape[1] * group_size, values[1].shape[1] * group_size
    if q.ndim == 4 and paged_kernel_runs(dim, v_dim):
        if q.shape[2] > PAGED_MAX_QUERIES:  # (the blocks' calls would name a block's shapes)
            _check(q, (keys[0].shape[0], dim), (values[0].shape[0], v_dim), index, lengths, q_pos, k_pos, window)
        return in_query_blocks(lambda qb, i: cpu.cpu_paged_quant_attention(
            qb, keys, values, index, lengths, q_pos[:, i:i + qb.shape[2]], k_pos, scale, group_size, window), q)
    _check(q, (keys[0].shape[0], dim), (values[0].shape[0], v_dim), index, lengths, q_pos, k_pos, window)
    return reference_paged_quant_attention(q, keys, values, index, lengths, q_pos, k_pos, scale, group_size, window)


def paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, index: mx.array, lengths: mx.array,
                    q_pos: mx.array, k_pos: mx.array, scale: float, window: int = 0) -> mx.array:
    """Attention of B requests' queries over their live tokens in a float paged KV pool, on the best path
    here (the CPU kernel where paged_kernel_runs: head dims that are multiples of 16, in blocks of
    PAGED_MAX_QUERIES positions, each row as a one-token step computes it; else the reference).

    Args:
        q: [B, n_q, L, D] float32 / float16 / bfloat16 queries (RoPE applied).
        k_pool: [rows, D] one layer's keys of the pool (BlockPool.layer_kv(layer)[0]); v_pool: [rows, Dv], one dtype
            (or any leading dims, the same for both, taken together as the rows, such as a dense cache's
            buffer [B, n_kv, capacity, D]: no reshape operation in the graph).
        index: int32 [B, n_kv, S] pool rows of request b's live tokens for KV head h, right-padded (query
            head g reads KV head g // (n_q // n_kv)).
        lengths: int32 [B] live tokens per request (index entries past them are not read).
        q_pos: int32 [B, L], k_pos: int32 [B, S] original positions (RoPE positions: eviction keeps them).
        scale: the softmax scale.
        window: sliding window in positions (0: none): a query at p sees a key at k iff k <= p and
            p - k < window.

    Returns:
        [B, n_q, L, Dv] in q's dtype, accumulated in float32; zeros for a query that sees no key.

    Raises:
        ValueError: shapes or dtypes that do not agree, or window < 0.
    """
    if q.ndim == 4 and v_pool.ndim >= 2 and paged_kernel_runs(q.shape[3], v_pool.shape[-1]):
        if q.shape[2] > PAGED_MAX_QUERIES:  # (the blocks' calls would name a block's shapes)
            _check(q, _pool_rows(k_pool), _pool_rows(v_pool), index, lengths, q_pos, k_pos, window)
        return in_query_blocks(lambda qb, i: cpu.cpu_paged_attention(
            qb, k_pool, v_pool, index, lengths, q_pos[:, i:i + qb.shape[2]], k_pos, scale, window), q)  # checks
    if k_pool.ndim > 2 and v_pool.ndim == k_pool.ndim and k_pool.shape[:-1] == v_pool.shape[:-1]:
        k_pool, v_pool = k_pool.reshape(-1, k_pool.shape[-1]), v_pool.reshape(-1, v_pool.shape[-1])  # [rows, D]
    _check(q, tuple(k_pool.shape), tuple(v_pool.shape), index, lengths, q_pos, k_pos, window)
    return reference_paged_attention(q, k_pool, v_pool, index, lengths, q_pos, k_pos, scale, window)

