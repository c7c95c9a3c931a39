"""One request's paged KV state shared by its per-layer caches: the token table, each layer's logical offset,
and the device lookup copy of the live slots (rebuilt only when the table changes)."""

from typing import List, Optional, Tuple, Union

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from .pool import BlockPool
from .table import TokenTable


class PagedSequence:
    """The token table of one request and where each layer's writes stand.

    A forward of L tokens calls every layer's cache once: the first layer to reach the table's end
    appends L tokens (allocating slots); the others find those slots already there and write into them.
    Eviction, repacking and rollback happen between forwards (all layers at the table's length).

    Args:
        pool: the BlockPool shared with the other requests of the model.
        num_layers: layers whose caches share this sequence.
    """

    def __init__(self, pool: BlockPool, num_layers: int):
        self.pool = pool
        self.table = TokenTable(pool)
        self.offsets = [0] * num_layers
        self._index_version = (-1, -1)
        self._index: Optional[mx.array] = None  # int32 [n_kv * S] pool rows of the live slots, logical order
        self._range: Optional[Tuple[int, int]] = None  # (start, stop) when those slots are contiguous
        self._positions: Optional[np.ndarray] = None
        self._kernel_key: Tuple[int, ...] = ()
        self._kernel_operands: Optional[Tuple[mx.array, ...]] = None  # see kernel_operands
        self._write_key: Tuple[int, ...] = ()
        self._write_rows: Union[None, int, mx.array] = None  # the current forward's writes (write_rows)

    # ---- per layer

    def write_rows(self, layer: int, n: int) -> Union[int, mx.array]:
        """Where layer `layer`'s next n tokens go, as BlockPool.write takes it: their pool rows
        (BlockPool.rows) int32 [n_kv * n], or for one token that extends the table's run of consecutive
        slots its slot (an int); appends the tokens to the table first when this layer is the first to reach
        its end; advances that layer's offset. The other layers of the same forward reuse what the first one
        computed."""
        start = self.offsets[layer]
        if start == self.table.length:
            self.table.append(n)
        elif start + n > self.table.length:
            raise MlxInferError(
                f"layer {layer} writes tokens {start}..{start + n - 1} but the table holds {self.table.length}: "
                "every layer must see the same tokens")
        key = (start, n, self.table.version, self.pool.capacity)
        if self._write_key != key:
            run = self.table.run
            if run is not None and n == 1:
                self._write_rows = int(run + start)
            else:
                slots = range(run + start, run + start + n) if run is not None else self.table.slots(np.arange(start, start + n))
                self._write_rows = self.pool.rows(slots)
            self._write_key = key
        self.offsets[layer] = start + n
        return self._write_rows

    def advance(self, layer: int, n: int) -> None:
        """Move layer `layer`'s offset n tokens forward over slots already in the table (a batched forward
        computes its write rows itself, kv/batch.py).

        Raises:
            MlxInferError: the table does not hold those n tokens.
        """
        if self.offsets[layer] + n > self.table.length:
            raise MlxInferError(
                f"layer {layer} advances to {self.offsets[layer] + n} tokens but the table holds {self.table.length}")
        self.offsets[layer] += n

    def adopt(self, blocks: List[int]) -> None:
        """Start this fresh request from cached full blocks (TokenTable.adopt): every layer then stands
        after their tokens."""
        self.table.adopt(blocks)
        self.offsets = [self.table.length] * len(self.offsets)

    def trim(self, layer: int, n: int) -> int:
        """Roll layer `layer` back n tokens; the table drops the tokens no layer holds any more."""
        n = max(0, min(n, self.offsets[layer]))
        self.offsets[layer] -= n
        self.table.truncate(max(self.offsets))
        return n

    # ---- the attention's view

    def _refresh(self) -> None:
        if self._index_version == (self.table.version, self.pool.capacity):
            return
        self._index_version = (self.table.version, self.pool.capacity)
        run = self.table.run
        if run is not None:  # every token live, in consecutive slots: one range, nothing built on the host
            self._range, self._index, self._positions = (run, run + self.table.length), None, None
            return
        tokens = self.table.live_tokens()
        slots = self.table.slots(tokens)
        self._positions = tokens
        contiguous = slots.size == 0 or (slots[-1] - slots[0] + 1 == slots.size and bool(np.all(np.diff(slots) == 1)))
        self._range = (int(slots[0]), int(slots[-1]) + 1) if slots.size else (0, 0)
        self._range = self._range if contiguous else None
        self._index = None if contiguous else self.pool.rows(slots)

    def live(self, layer: int) -> Tuple[mx.array, mx.array]:
        """(keys [1, n_kv, S, k_dim], values [1, n_kv, S, v_dim]) of the live tokens in logical order: a view
        of the pool when their slots are contiguous, else one gather (`mx.take`) per array."""
        self._refresh()
        if self._range is not None:
            return self.pool.read_range(layer, *self._range)  # [1, n_kv, S, D]
        k, v = self.pool.read(layer, self._index)
        return k[None], v[None]  # [1, n_kv, S, D]

    def live_packed(self, layer: int) -> Tuple[List[mx.array], List[mx.array]]:
        """A quantized pool's packed rows of the live tokens in logical order: (keys [codes, scales, biases],
        values [...]), each [n_kv, S, width]; views of the pool when the slots are contiguous, else one
        gather (`mx.take`) per plane."""
        self._refresh()
        if self._range is not None:
            planes = self.pool.range_planes(layer, *self._range)
        else:
            n_kv = self.pool.layout[0]
            planes = [a.reshape(n_kv, -1, a.shape[-1]) for a in self.pool.take(layer, self._index)]
        return planes[:3], planes[3:]

    def kernel_operands(self, L: int) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """paged_attention's operands for the last L live tokens as queries, built once per table version
        for all layers: (pool rows int32 [1, n_kv, S] in logical order, lengths int32 [1] (S), query
        positions int32 [1, L], original positions int32 [1, S])."""
        self._refresh()
        key = (self._index_version, L)
        if self._kernel_key != key:
            positions = self.live_positions()
            rows = self.pool.rows(self.table.slots(positions)).reshape(1, self.pool.layout[0], -1)  # [1, n_kv, S]
            positions = positions.astype(np.int32)
            self._kernel_operands = (rows, mx.array([positions.size], dtype=mx.int32),
                                     mx.array(np.arange(self.table.length - L, self.table.length, dtype=np.int32))[None],
                                     mx.array(positions)[None])
            self._kernel_key = key
        return self._kernel_operands

    def live_positions(self) -> np.ndarray:
        """Original positions of the live tokens, ascending: int64 [S]."""
        self._refresh()
        if self._positions is None:  # a run: every token live
            self._positions = np.arange(self.table.length)
        return self._positions

    def ready(self) -> bool:
        """Whether every layer stands at the table's end (between forwards)."""
        return all(o == self.table.length for o in self.offsets)

    def evict(self, tokens) -> List[int]:
        """Evict logical tokens (TokenTable.evict) between forwards; returns the blocks freed.

        Raises:
            MlxInferError: called in the middle of a forward.
        """
        if not self.ready():
            raise MlxInferError("tokens can only be evicted between forwards (all layers at the same offset)")
        return self.table.evict(tokens)

    def release(self) -> None:
        """The request ended: its blocks go back to the pool."""
        self.table.release()
        self.offsets = [0] * len(self.offsets)
