"""Decode and verify attention over a dense float KV cache (mlx-lm's KVCache) on the paged-attention kernel
(kernels/paged_attention.py), reading the cache's buffer in place.

    out = dense_attention(q, cache.keys, cache.values, cache.offset, D ** -0.5)   # q [B, n_q, L, D]

mlx-lm's KVCache keeps K and V in buffers [B, n_kv, capacity, D] that grow in steps and hands attention a
slice of the first `offset` tokens. Seen as a pool of rows (the kernel takes the buffer as it is, its
B * n_kv * capacity rows of D), those tokens are rows (b * n_kv + h) * capacity + t, so the paged kernel attends over
them through that index: each K/V row read once for all the query rows of its GQA group, online softmax
with a vector e^x, the sequence split over the cores. On MLX's CPU device mx.fast.scaled_dot_product_attention
instead runs unfused (scores, then libm's scalar exp per element), several times slower at long contexts
for a decode row and more for a verify (docs/kv.md#attention-over-the-pool-the-paged-attention-kernel).
"""

import mlx.core as mx
import numpy as np

from .paged_attention import paged_attention, paged_kernel_fits

__all__ = ["buffer_operands", "buffer_tables", "dense_attention", "dense_fits"]


def dense_fits(queries: int, k_dim: int, v_dim: int) -> bool:
    """Whether `dense_attention` runs the kernel for `queries` positions (paged_kernel_fits: L <=
    PAGED_MAX_QUERIES, any L where the products round x to int8) and head dims k_dim / v_dim here (else the
    caller keeps MLX's attention)."""
    return paged_kernel_fits(queries, k_dim, v_dim)


#: The token-table operands of the last calls (every layer of a step asks for the same ones), and the
#: per-buffer part of them (index and k_pos over the whole capacity: they change when the buffer grows),
#: for up to KEPT_BUFFERS buffers (a target and its draft model's caches take turns).
_last_operands: dict = {}
_last_tables: dict = {}
KEPT_BUFFERS = 4


def _remember(kept: dict, key: tuple, value: tuple) -> tuple:
    """Store value under key, forgetting the oldest entry beyond KEPT_BUFFERS."""
    if len(kept) >= KEPT_BUFFERS:
        del kept[next(iter(kept))]
    kept[key] = value
    return value


def buffer_tables(B: int, n_kv: int, capacity: int, start: int = 0) -> tuple:
    """(index int32 [B, n_kv, capacity - start], k_pos int32 [B, capacity - start]) of a buffer whose tokens
    sit from slot `start` on: row (b * n_kv + h) * capacity + start + t and position t of every slot, built
    on the host once per buffer shape and start."""
    key = (B, n_kv, capacity, start)
    found = _last_tables.get(key)
    if found is None:
        t = np.arange(capacity - start, dtype=np.int32)
        heads = np.arange(B * n_kv, dtype=np.int32).reshape(B, n_kv, 1) * capacity + start
        found = _remember(_last_tables, key, (mx.array(heads + t), mx.array(np.broadcast_to(t, (B, t.size)))))
    return found


def buffer_operands(B: int, n_kv: int, capacity: int, length: int, L: int, start: int = 0) -> tuple:
    """(index int32 [B, n_kv, capacity - start], lengths [B], q_pos [B, L], k_pos [B, capacity - start]) for
    `length` tokens from slot `start` of each head's rows in a buffer of `capacity` (a dense cache: 0; a paged
    request whose tokens fill consecutive slots of the pool: TokenTable.run; the kernel reads slots t <
    lengths[b] only), as arrays that hold their values: no operations for every layer's graph to evaluate
    again. Per step only lengths and q_pos are new, made from Python lists (a NumPy call right after an
    evaluation waits on the CPU backend, a cost a step should not pay)."""
    key = (B, n_kv, capacity, length, L, start)
    found = _last_operands.get(key)
    if found is None:
        index, k_pos = buffer_tables(B, n_kv, capacity, start)
        found = (index, mx.array([length] * B, dtype=mx.int32),
                 mx.array([list(range(length - L, length))] * B, dtype=mx.int32), k_pos)
        _last_operands.clear()
        _last_operands[key] = found
    return found


def dense_attention(q: mx.array, k_buffer: mx.array, v_buffer: mx.array, length: int, scale: float) -> mx.array:
    """Causal attention of the last L of `length` positions over a dense cache's first `length` tokens.

    Args:
        q: [B, n_q, L, D] float32 / float16 / bfloat16 queries (RoPE applied), the positions
            length - L .. length - 1.
        k_buffer: [B, n_kv, capacity, D] the cache's key buffer (capacity >= length), v_buffer
            [B, n_kv, capacity, Dv] its values, one dtype; n_q a multiple of n_kv.
        length: tokens held (the cache's offset).
        scale: the softmax scale.

    Returns:
        [B, n_q, L, Dv] in q's dtype, accumulated in float32: as mx.fast.scaled_dot_product_attention over
        the first `length` tokens with mask "causal" (None for L == 1), up to float32 rounding.

    Raises:
        ValueError: shapes that do not agree (see paged_attention), or length outside [L, capacity].
    """
    B, n_kv, capacity, _ = k_buffer.shape
    L = q.shape[2]
    if not L <= length <= capacity:
        raise ValueError(f"dense_attention: {length} tokens for {L} queries in a buffer of {capacity}")
    index, lengths, q_pos, k_pos = buffer_operands(B, n_kv, capacity, length, L)
    # the buffers as they are: the kernel reads them as pools of B * n_kv * capacity rows
    return paged_attention(q, k_buffer, v_buffer, index, lengths, q_pos, k_pos, scale)
