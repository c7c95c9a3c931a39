"""The kernel layer's causal attention for prefill chunks (issue 14): `prefill_attention` runs query tiles
on the CPU (BLAS products around the CPU kernel's causal softmax) or the pure-mx reference (the oracle:
mx.fast.scaled_dot_product_attention with mask="causal") by the default device and what is available.

    out = prefill_attention(q, k, v, D ** -0.5)     # q [B, n_q, L, D], k / v [B, n_kv, S, D]

On MLX's CPU device, mx.fast.scaled_dot_product_attention runs unfused: the whole [n_q, L, S] score matrix,
a mask, and a softmax whose exponential is libm's scalar exp, one element at a time (on a long chunk the
exp alone is most of its time). Here a chunk runs
in tiles of PREFILL_TILE queries: per tile, the heads of a GQA group are stacked as rows ([B, n_kv,
n_rep * T, D], so each K/V head is multiplied once for its group), the scores cover only the keys the tile
sees (the causal upper part of the matrix is never computed), the softmax is the kernel's (vectorized e^x,
masking and scaling fused, in place), and P V is a second product. Memory holds one tile's scores, never
the chunk's [L, S].
"""

import mlx.core as mx

from . import cpu

#: Queries per tile (the scores of a tile are n_q * PREFILL_TILE * S float32).
PREFILL_TILE = 256
#: Fewest queries (L) that take the tiled path; shorter forwards (decode, verify widths) keep MLX's own.
PREFILL_MIN_QUERIES = 17

__all__ = ["PREFILL_MIN_QUERIES", "PREFILL_TILE", "causal_softmax", "prefill_attention", "prefill_attention_backend",
           "prefill_fits", "reference_causal_softmax", "reference_prefill_attention"]


def prefill_attention_backend() -> str:
    """Which implementation `prefill_attention` runs here: 'cpu-<isa>' (tiles around the CPU kernel's
    softmax, on MLX's CPU device) or 'reference' (mx.fast.scaled_dot_product_attention)."""
    return cpu.cpu_backend()


def prefill_fits(queries: mx.array, keys, mask) -> bool:
    """Whether the attention hook should hand this call to `prefill_attention`: a causal mask ("causal"),
    at least PREFILL_MIN_QUERIES queries, float keys (an array: not mlx-lm's quantized tuples), and the CPU
    path available."""
    return (isinstance(mask, str) and mask == "causal" and isinstance(keys, mx.array)
            and queries.shape[2] >= PREFILL_MIN_QUERIES and prefill_attention_backend() != "reference")


def reference_prefill_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """The oracle: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal") (queries
    aligned to the last L of the S keys)."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")


def reference_causal_softmax(scores: mx.array, scale: float, period: int, q0: int) -> mx.array:
    """The oracle of causal_softmax: a mask, then mx.softmax (float32)."""
    R, S = scores.shape[-2:]
    last = q0 + mx.arange(R)[:, None] % period  # [R, 1]: the last column row r sees
    seen = mx.arange(S)[None] <= last  # [R, S]
    p = mx.softmax(mx.where(seen, scores.astype(mx.float32) * scale, -mx.inf), axis=-1)
    return mx.where(seen, p, 0.0)


def causal_softmax(scores: mx.array, scale: float, period: int, q0: int) -> mx.array:
    """softmax(scale * scores) of [..., R, S] scores over the columns each row sees (row r: columns
    j <= q0 + r % period), 0 for the others, float32: the CPU kernel's (vectorized e^x, in place) where it
    runs, else reference_causal_softmax. Also the attention observer's (kv/observe.py).

    Raises:
        ValueError: period < 1 or q0 < 0 (the CPU kernel: also a dtype other than float32).
    """
    if period < 1 or q0 < 0:
        raise ValueError(f"causal_softmax: period must be >= 1 and q0 >= 0, got {period}, {q0}")
    if prefill_attention_backend() == "reference":
        return reference_causal_softmax(scores, scale, period, q0)
    return cpu.cpu_causal_softmax(scores.astype(mx.float32), scale, period, q0)


def _tiled(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    B, n_q, L, D = q.shape
    n_kv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    rep = n_q // n_kv
    offset = S - L  # the query at l is at position offset + l
    qg = q.reshape(B, n_kv, rep, L, D)  # [B, n_kv, rep, L, D]
    kf, vf = k.astype(mx.float32), v.astype(mx.float32)
    tiles = []
    for s in range(0, L, PREFILL_TILE):
        e = min(L, s + PREFILL_TILE)
        t, keys = e - s, offset + e  # the tile's queries see keys [0, offset + e)
        qt = qg[:, :, :, s:e].astype(mx.float32).reshape(B, n_kv, rep * t, D)  # [B, n_kv, rep * T, D]
        scores = qt @ kf[:, :, :keys].swapaxes(-1, -2)  # [B, n_kv, rep * T, keys]
        p = causal_softmax(scores, scale, t, offset + s)
        tiles.append((p @ vf[:, :, :keys]).reshape(B, n_kv, rep, t, Dv))  # [B, n_kv, rep, T, Dv]
    out = tiles[0] if len(tiles) == 1 else mx.concatenate(tiles, axis=3)
    return out.reshape(B, n_q, L, Dv).astype(q.dtype)  # [B, n_q, L, Dv]


def prefill_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """Causal attention of a prefill chunk: the L queries are the last L of the S positions.

    Args:
        q: [B, n_q, L, D] float32 / float16 / bfloat16 queries (RoPE applied), L <= S.
        k: [B, n_kv, S, D] keys, v: [B, n_kv, S, Dv] values (n_q a multiple of n_kv: query head g reads
            KV head g // (n_q // n_kv)).
        scale: the softmax scale (> 0; usually D ** -0.5).

    Returns:
        [B, n_q, L, Dv] in q's dtype, accumulated in float32: as reference_prefill_attention up to float32
        rounding (the CPU path), or it (elsewhere).

    Raises:
        ValueError: shapes that do not fit (n_q not a multiple of n_kv, L > S, k / v lengths differ).
    """
    B, n_q, L, _ = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    if n_q % n_kv or L > S or v.shape[2] != S or k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"prefill_attention: q {q.shape} does not fit k {k.shape} / v {v.shape}")
    if prefill_attention_backend() == "reference":
        return reference_prefill_attention(q, k, v, scale)
    return _tiled(q, k, v, scale)
