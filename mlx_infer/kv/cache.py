"""PagedKVCache: one layer's view of a request's paged KV, satisfying mlx-lm's duck-typed cache protocol
(`offset`, `update_and_fetch`, `make_mask`, `state`, `is_trimmable`, `trim`, `nbytes`, as
mlx_lm.models.cache.KVCache), so unmodified mlx-lm models run on it.

Attention sees the live tokens in logical order (gathered from the pool through the token table) followed by
nothing else: `offset` stays the logical position count, so RoPE keeps the original positions after
eviction, while the keys the model attends to number only the live ones. Masks are built from the original
positions (so sliding-window layers keep their window in positions, not in cached entries).

Over a pool of quantized blocks `update_and_fetch` returns the dequantized K/V (lazily), and the attention
hook calls `fused_attention`, which runs the kernel layer's quant_attention on the request's packed rows
(a view when they are contiguous, else one gather of the packed planes): the path a dense QuantKVCache
takes over the same packed rows, so the two give the same logits. Over float blocks, decode and verify
steps (up to 16 queries, no sliding window) attend on the paged-attention kernel through the token table's
rows, in place: the path a dense KVCache takes over its buffer (kernels/dense_attention.py), so the two give
the same logits too.
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from ..errors import MlxInferError, UnsupportedModelError
from ..kernels.attention import quant_attention
from ..kernels.dense_attention import buffer_operands, dense_fits
from ..kernels.paged_attention import paged_attention
from .pool import BlockPool
from .quant_options import KVQuant
from .rotation import keys_basis, values_basis
from .sequence import PagedSequence


class PagedKVCache:
    """Layer `layer` of the request `sequence` (see make_paged_cache).

    Args:
        sequence: the request's PagedSequence (shared by its layers).
        layer: this layer's index in the pool.
    """

    def __init__(self, sequence: PagedSequence, layer: int):
        self.sequence = sequence
        self.layer = layer

    @property
    def offset(self) -> int:
        """Logical tokens this layer has seen (== the next token's RoPE position)."""
        return self.sequence.offsets[self.layer]

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append keys [1, n_kv, L, k_dim] and values [1, n_kv, L, v_dim] (RoPE already applied at positions
        offset .. offset + L - 1) and return the live keys [1, n_kv, S, k_dim] and values [1, n_kv, S, v_dim],
        the new tokens last.

        Raises:
            MlxInferError: a batch other than 1, or a layout other than the pool's.
        """
        B, n_kv, L, kd = keys.shape
        if B != 1:
            raise MlxInferError(f"a PagedKVCache holds one request (batch 1), got a batch of {B}")
        pool = self.sequence.pool
        pool.configure(n_kv, kd, values.shape[3], keys.dtype)
        rows = self.sequence.write_rows(self.layer, L)  # [n_kv * L]
        pool.write(self.layer, rows, keys, values)  # [1, n_kv, L, D]: rows h * L + t
        return self.sequence.live(self.layer)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask of the next forward of N tokens, for mlx-lm's attention: None (N == 1, no
        window: every live token is visible), "causal" (N > 1: the N new tokens follow the S live ones, MLX's
        causal mask is aligned to the last key), or a bool array [N, S + N] built from original positions
        (return_array, or a sliding window: key at position p visible from query q iff p <= q and
        q < p + window_size)."""
        if window_size is None and not return_array:
            return None if N == 1 else "causal"
        pos = self.sequence.live_positions() if self.offset == self.sequence.table.length else None
        if pos is None:
            raise MlxInferError("make_mask was called in the middle of a forward")
        q = mx.arange(self.offset, self.offset + N)[:, None]  # [N, 1]
        k = mx.concatenate([mx.array(pos.astype("int32")), mx.arange(self.offset, self.offset + N)])[None]
        mask = q >= k  # [N, S + N]
        if window_size is not None:
            mask = mask & (q < k + window_size)
        return mask

    def fused_attention(self, queries: mx.array, scale: float, mask) -> Optional[mx.array]:
        """Attention of queries [1, n_q, L, D] over the live tokens' packed K/V of a quantized pool, without
        dequantizing them: [1, n_q, L, Dv] in the queries' dtype (quant_attention, causal over the last L
        tokens: the new ones, written last). None when it does not apply: float blocks, or a mask other
        than None for L == 1 / "causal" (a sliding window: the model then attends over update_and_fetch's
        dequantized K/V)."""
        pool, quant = self.sequence.pool, self.sequence.pool.quant
        B, n_q, L, D = queries.shape
        if not ((isinstance(mask, str) and mask == "causal") or (mask is None and L == 1)):
            return None
        if quant is None:
            return self._float_attention(queries, scale) if dense_fits(L, D, pool.layout[2]) else None
        keys, values = self.sequence.live_packed(self.layer)  # Packed [n_kv, S, width] each
        n_kv, S = keys[0].shape[:2]
        q = queries.reshape(n_kv, (n_q // n_kv) * L, D)  # [n_kv, n_rep * L, D]: row r is position r % L
        out = quant_attention(keys_basis(q, quant), keys, values, S, scale, L, quant.group_size)  # [n_kv, n_rep * L, Dv]
        out = values_basis(out, quant)  # the values' stored basis back to the model's
        return out.astype(queries.dtype).reshape(1, n_q, L, out.shape[-1])

    def _float_attention(self, queries: mx.array, scale: float) -> mx.array:
        """queries [1, n_q, L, D] (the last L live tokens' positions) -> [1, n_q, L, Dv] on the paged kernel,
        reading the live rows in place through the token table (as dense_attention over a dense cache's
        buffer: the same rows in the same order give the same result)."""
        pool, table = self.sequence.pool, self.sequence.table
        keys, values = pool.layer_kv(self.layer)  # [n_kv * rows, D] each
        L = queries.shape[2]
        if table.run is not None:  # consecutive slots: a dense buffer's operands from slot `run`, nothing built
            operands = buffer_operands(1, pool.layout[0], pool.capacity * pool.block_size, table.length, L, table.run)
        else:
            operands = self.sequence.kernel_operands(L)
        return paged_attention(queries, keys, values, *operands, scale)

    @property
    def state(self) -> Tuple[mx.array, mx.array]:
        """(keys [1, n_kv, S, k_dim], values [1, n_kv, S, v_dim]): the live tokens in logical order (a dense
        copy for reading or evaluating; a paged cache is rebuilt by prefilling, not from a state)."""
        if self.sequence.table.length == 0:
            return ()
        return self.sequence.live(self.layer)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Roll back the last n logical tokens (speculative rollback); their slots are freed. Returns how
        many were trimmed (at most offset)."""
        return self.sequence.trim(self.layer, n)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's share of the request's blocks (holes included: what the request retains)."""
        return len(self.sequence.table.blocks) * self.sequence.pool.layer_block_bytes


def make_paged_cache(model: nn.Module, pool: BlockPool) -> List[PagedKVCache]:
    """One PagedKVCache per layer of `model` over `pool`, sharing one new PagedSequence (a request), in the
    place of mlx-lm's make_prompt_cache. Sliding-window layers (mlx-lm's RotatingKVCache without kept
    tokens) become paged caches too: the model passes its window to make_mask, and they keep every token
    (so they can roll back any number of tokens).

    Raises:
        UnsupportedModelError: a layer cache other than KVCache / RotatingKVCache(keep=0).
        MlxInferError: a pool made for another number of layers.
    """
    dense = make_prompt_cache(model)
    other = _unpageable(dense)
    if other is not None:
        raise UnsupportedModelError(f"the paged KV cache replaces KVCache layers, this model uses {other}: "
                                    "use the dense KV cache for it")
    if len(dense) != pool.num_layers:
        raise MlxInferError(f"the block pool was made for {pool.num_layers} layers, the model has {len(dense)}")
    sequence = PagedSequence(pool, len(dense))
    return [PagedKVCache(sequence, i) for i in range(len(dense))]


def _unpageable(caches: list) -> Optional[str]:
    """The class name of the first of mlx-lm's layer caches a PagedKVCache cannot replace, None if none."""
    for c in caches:
        if not (type(c) is KVCache or (type(c) is RotatingKVCache and c.keep == 0)):
            return type(c).__name__
    return None


def supports_paged(model: nn.Module) -> bool:
    """Whether every layer cache of `model` can be paged (make_paged_cache would not raise)."""
    return _unpageable(make_prompt_cache(model)) is None


def make_pool(model: nn.Module, quant: Optional[KVQuant] = None, **kwargs) -> BlockPool:
    """A BlockPool with one K and V array per layer of `model` (quant: quantized blocks, see BlockPool);
    kwargs as BlockPool (block_size, budget_bytes, budget_blocks, initial_blocks).

    Raises:
        MlxInferError: as BlockPool (a quant the paged cache cannot hold: KIVI, a float prefix)."""
    return BlockPool(len(make_prompt_cache(model)), quant=quant, **kwargs)
