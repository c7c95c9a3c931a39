"""One layer's KV storage inside a compiled decode step (generation/compiled.py), positions as arrays.

    cache = StepCache(keys, values, offset, operands)        # an mlx-lm KVCache's buffers, offset int32 [1]
    cache = StepCache(k_plane, v_plane, offset, operands, rows)  # a block pool's planes, offset int32 [B]
    k, v = cache.update_and_fetch(k_new, v_new)              # the new rows written, in place
    out = cache.fused_attention(q, scale, None)              # through the attention hook (kv/attention_hook.py)

A traced graph is replayed with new inputs but the same shapes and Python values, so nothing here depends on
how many tokens the storage holds: a KVCache buffer's row goes in at an array offset (`mx.slice_update` with
array indices), a pool's rows at array row indices (`write_rows`), and attention reads the storage through
the paged-attention kernel, which stops at `lengths` (the index may be padded beyond).
"""

from typing import Optional

import mlx.core as mx

from ..kernels.move_rows import write_rows
from ..kernels.paged_attention import paged_attention

__all__ = ["StepCache"]


class StepCache:
    """mlx-lm's cache protocol (`offset`, `make_mask`, `update_and_fetch`) and `fused_attention` for the
    attention hook, for one-token steps of B requests (over a KVCache buffer, B = 1: L tokens, a verify
    forward).

    Args:
        keys: the layer's key storage: an mlx-lm KVCache's buffer [1, n_kv, capacity, D] (B = 1, rows None),
            or a block pool's plane [n_kv * pool_rows, D] (rows given); values the same with Dv, one dtype.
        offset: int32 [B], each request's tokens before this one (its RoPE position; in a KVCache buffer
            also where the new row goes).
        operands: (index int32 [B, n_kv, S], lengths int32 [B], q_pos int32 [B, L], k_pos int32 [B, S]):
            the paged-attention kernel's view of the storage, the new tokens included
            (kernels.dense_attention.buffer_tables for a buffer, BatchStep.kernel_operands for a pool).
        rows: int32 [B * n_kv], the pool rows of the new tokens' K/V, (b, head) order (BatchStep.write_rows).
    """

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, operands: tuple,
                 rows: Optional[mx.array] = None):
        self.keys, self.values, self.offset, self.operands, self.rows = keys, values, offset, operands, rows

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None) -> None:
        """None: each query sees the tokens written up to its own position (the kernel stops at `lengths` and
        at the query's q_pos)."""
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        """Write the step's K [B, n_kv, L, D] and V [B, n_kv, L, Dv] (in place: the old storage is donated);
        returns the whole new storage (attention reads it through fused_attention, only the live slots)."""
        if self.rows is None:  # [1, n_kv, capacity, D]
            self.keys = mx.slice_update(self.keys, keys, self.offset, axes=(2,))
            self.values = mx.slice_update(self.values, values, self.offset, axes=(2,))
        else:  # [n_kv * pool_rows, D]
            self.keys = write_rows(self.keys, keys, self.rows)
            self.values = write_rows(self.values, values, self.rows)
        return self.keys, self.values

    def fused_attention(self, queries: mx.array, scale: float, mask) -> mx.array:
        """queries [B, n_q, L, D] -> [B, n_q, L, Dv] over each request's live slots (the paged kernel)."""
        return paged_attention(queries, self.keys, self.values, *self.operands, scale)
