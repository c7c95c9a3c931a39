"""The block pool: per-layer K and V storage in fixed-size blocks, a free list, reference counts and a budget.

Layout: block b of layer l holds `block_size` token slots of K and V, each [n_kv_heads, head_dim], as vLLM's
`[num_blocks, block_size, n_kv_heads, head_dim]` (arXiv 2309.06180), but stored head-major,
`[n_kv_heads, num_blocks * block_size, head_dim]` and kept flattened to `[n_kv_heads * rows, head_dim]`: a
token's slot is `block * block_size + offset`, its row for head h is `h * rows + slot`, and reads and writes
are one `mx.take` / one scatter on axis 0 of the flat array (MLX's CPU take on axis 0 is ~10x faster than on
axis 1 of the 3-D array: 0.32 ms vs 3.2 ms for 2000 tokens x 3 heads x 64 in float16). Why not vLLM's
order: MLX's attention takes [B, n_kv, S, D]; head-major, a gather lands in that layout directly and a run of
contiguous slots is a view with the same strides as mlx-lm's KVCache buffer (no copy, bit-identical logits),
while the token-major order needs a transpose copy per layer per step (without it the CPU SDPA rounds
differently: logits off by ~2e-5 on the default model).

MLX arrays are values; the pool keeps one persistent array per layer and per K/V and rebinds it after each
write (`arr[slots] = new`). The old version then has no other reference, so MLX donates its buffer to the
scatter: a write costs O(new tokens), not a copy of the pool (measured: bench/kv_core.py --write). The
capacity starts at `initial_blocks`, grows geometrically up to the budget (one copy per growth), and shrinks
when the highest used block falls below capacity / POOL_SHRINK_FACTOR (`shrink()`: one copy of the used
prefix), so blocks freed by eviction and repacking give memory back to MLX (`mx.get_active_memory()`).
Allocation hands out the lowest free ids first, which keeps the used blocks at the front.
"""

import heapq
import math
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from .defaults import BLOCK_SIZE, POOL_GROWTH, POOL_INITIAL_BLOCKS, POOL_SHRINK_FACTOR
from .errors import KVBudgetError


class BlockPool:
    """KV blocks shared by the requests of one model.

    Args:
        num_layers: decoder layers with a KV cache (one K and one V array each).
        block_size: token slots per block (>= 1).
        budget_bytes: most bytes the pool may hold over all layers (K and V), or None.
        budget_blocks: most blocks, or None; with neither the pool is unbounded.
        initial_blocks: capacity allocated at the first write.

    The layout (n_kv_heads, head dims, dtype) is fixed by `configure`, called by the first cache write
    (PagedKVCache) or explicitly. Raises MlxInferError for a bad size or budget.
    """

    def __init__(self, num_layers: int, block_size: int = BLOCK_SIZE, budget_bytes: Optional[int] = None,
                 budget_blocks: Optional[int] = None, initial_blocks: int = POOL_INITIAL_BLOCKS):
        if num_layers < 1 or block_size < 1 or initial_blocks < 1:
            raise MlxInferError(
                f"a block pool needs >= 1 layer, block size and initial block (got {num_layers}, {block_size}, "
                f"{initial_blocks})")
        for name, v in (("budget_bytes", budget_bytes), ("budget_blocks", budget_blocks)):
            if v is not None and v <= 0:
                raise MlxInferError(f"the KV {name} must be positive (got {v}); omit it for no limit")
        self.num_layers = num_layers
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self._budget_blocks = budget_blocks
        self.initial_blocks = initial_blocks
        self.layout: Optional[Tuple[int, int, int, mx.Dtype]] = None  # n_kv, k_dim, v_dim, dtype
        self.keys: List[Optional[mx.array]] = [None] * num_layers  # [n_kv * capacity * block_size, k_dim]
        self.values: List[Optional[mx.array]] = [None] * num_layers  # [n_kv * capacity * block_size, v_dim]
        self.capacity = 0  # blocks allocated in the arrays
        self.refcount: List[int] = []  # per block id; 0 = free
        self._free: List[int] = []  # min-heap of free ids below capacity
        self._used = 0
        self.peak_blocks = 0

    # ---- layout and budget

    def configure(self, n_kv_heads: int, k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        """Fix the per-token layout (first call) or check it (later calls).

        Raises:
            MlxInferError: a layer whose keys / values differ from the pool's layout.
        """
        layout = (int(n_kv_heads), int(k_dim), int(v_dim), dtype)
        if self.layout is None:
            self.layout = layout
        elif self.layout != layout:
            raise MlxInferError(
                f"this KV block pool holds (n_kv, k_dim, v_dim, dtype) = {self.layout}, a layer wrote {layout}: "
                "use one pool per model")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (0 before `configure`)."""
        if self.layout is None:
            return 0
        n_kv, kd, vd, dtype = self.layout
        return self.num_layers * self.block_size * n_kv * (kd + vd) * dtype.size

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V."""
        return self.block_bytes // self.num_layers

    @property
    def max_blocks(self) -> Optional[int]:
        """The budget in blocks (None: unbounded; computed from budget_bytes once the layout is known)."""
        limits = [b for b in (self._budget_blocks,) if b is not None]
        if self.budget_bytes is not None and self.layout is not None:
            limits.append(self.budget_bytes // self.block_bytes)
        return min(limits) if limits else None

    @property
    def blocks_in_use(self) -> int:
        return self._used

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the blocks in use (all layers, K and V)."""
        return self._used * self.block_bytes

    @property
    def free_blocks(self) -> Optional[int]:
        """Blocks still allocatable under the budget (None: unbounded)."""
        m = self.max_blocks
        return None if m is None else m - self._used

    @property
    def nbytes(self) -> int:
        """Bytes the pool's arrays hold (capacity, used or not)."""
        return sum(a.nbytes for a in self.keys + self.values if a is not None)

    # ---- allocation

    def allocate(self, n: int) -> List[int]:
        """n free block ids (lowest first), each with reference count 1.

        Raises:
            KVBudgetError: the budget cannot hold n more blocks.
        """
        if n <= 0:
            return []
        m = self.max_blocks
        if m is not None and self._used + n > m:
            raise KVBudgetError(
                f"the KV budget holds {m} blocks of {self.block_size} tokens, {self._used} are in use and "
                f"{n} more were asked for: raise the KV budget or evict tokens")
        if len(self._free) < n:
            self._grow(self.capacity + n - len(self._free))
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            self.refcount[b] = 1
        self._used += n
        self.peak_blocks = max(self.peak_blocks, self._used)
        return ids

    def claim(self, ids: Sequence[int]) -> None:
        """Allocate these specific free ids (a repack plan's destinations), reference count 1 each.

        Raises:
            MlxInferError: an id that is not free; KVBudgetError: over the budget.
        """
        ids = list(ids)
        m = self.max_blocks
        if m is not None and self._used + len(ids) > m:
            raise KVBudgetError(f"the KV budget holds {m} blocks and {self._used} are in use: cannot claim "
                                f"{len(ids)} more; raise the KV budget")
        for b in ids:
            if not 0 <= b < self.capacity or self.refcount[b] != 0:
                raise MlxInferError(f"KV block {b} is not free")
        taken = set(ids)
        self._free = [b for b in self._free if b not in taken]
        heapq.heapify(self._free)
        for b in ids:
            self.refcount[b] = 1
        self._used += len(ids)
        self.peak_blocks = max(self.peak_blocks, self._used)

    def lowest_free(self, n: int) -> List[int]:
        """The n lowest free ids (without allocating them; fewer if fewer are free)."""
        return heapq.nsmallest(n, self._free)

    def incref(self, block: int) -> None:
        """One more request holds `block` (a shared prefix block)."""
        if self.refcount[block] <= 0:
            raise MlxInferError(f"KV block {block} is free: cannot share it")
        self.refcount[block] += 1

    def release(self, block: int) -> None:
        """One holder lets `block` go; it returns to the free list when none is left."""
        if self.refcount[block] <= 0:
            raise MlxInferError(f"KV block {block} is already free")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            heapq.heappush(self._free, block)
            self._used -= 1

    def shared(self, block: int) -> bool:
        """Whether several requests hold `block` (never moved by repacking)."""
        return self.refcount[block] > 1

    # ---- capacity

    def _grow(self, need: int) -> None:
        m = self.max_blocks
        new_cap = max(need, self.initial_blocks, int(math.ceil(self.capacity * POOL_GROWTH)))
        if m is not None:
            new_cap = max(need, min(new_cap, m))
        self._resize(new_cap)
        self._free.extend(range(len(self.refcount), new_cap))
        heapq.heapify(self._free)
        self.refcount.extend([0] * (new_cap - len(self.refcount)))

    def _resize(self, new_cap: int) -> None:
        if self.layout is None:
            raise MlxInferError("the KV block pool has no layout yet: call configure() or write through a cache")
        n_kv, kd, vd, dtype = self.layout
        rows, old = new_cap * self.block_size, self.capacity * self.block_size
        for arrays, d in ((self.keys, kd), (self.values, vd)):
            for layer in range(self.num_layers):
                a = arrays[layer]
                if a is None:
                    arrays[layer] = mx.zeros((n_kv * rows, d), dtype)
                    continue
                a = a.reshape(n_kv, old, d)
                if rows > old:
                    a = mx.concatenate([a, mx.zeros((n_kv, rows - old, d), dtype)], axis=1)
                else:  # a copy, so that the larger buffer is released
                    a = mx.contiguous(a[:, :rows])
                arrays[layer] = a.reshape(n_kv * rows, d)
        mx.eval(self.keys + self.values)
        self.capacity = new_cap

    def shrink(self) -> bool:
        """Give memory back: when the highest used block is below capacity / POOL_SHRINK_FACTOR, copy the
        used prefix into arrays of twice its size. Returns whether it shrank."""
        top = max((b for b in range(self.capacity) if self.refcount[b] > 0), default=-1) + 1
        new_cap = max(2 * top, self.initial_blocks)
        if self.capacity < POOL_SHRINK_FACTOR * max(top, 1) or new_cap >= self.capacity:
            return False
        self._resize(new_cap)
        del self.refcount[new_cap:]
        self._free = [b for b in self._free if b < new_cap]
        heapq.heapify(self._free)
        return True

    # ---- data

    def rows(self, slots: np.ndarray) -> mx.array:
        """The flat-array rows of slots int [S] for every head, head-major: int32 [n_kv * S] (valid until the
        capacity changes)."""
        n_kv = self.layout[0]
        rows = np.arange(n_kv, dtype=np.int64)[:, None] * (self.capacity * self.block_size) + np.asarray(slots)[None]
        return mx.array(rows.reshape(-1).astype(np.int32))

    def write(self, layer: int, rows: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store tokens' K and V: rows = rows(slots) int32 [n_kv * L]; keys [n_kv, L, k_dim], values
        [n_kv, L, v_dim]."""
        self.keys[layer][rows] = keys.reshape(-1, keys.shape[-1])
        self.values[layer][rows] = values.reshape(-1, values.shape[-1])

    def read(self, layer: int, rows: mx.array) -> Tuple[mx.array, mx.array]:
        """(keys [n_kv, S, k_dim], values [n_kv, S, v_dim]) of `rows(slots)` (int32 [n_kv * S]), in that order."""
        n_kv, kd, vd, _ = self.layout
        k = mx.take(self.keys[layer], rows, axis=0).reshape(n_kv, -1, kd)
        return k, mx.take(self.values[layer], rows, axis=0).reshape(n_kv, -1, vd)

    def read_range(self, layer: int, start: int, stop: int) -> Tuple[mx.array, mx.array]:
        """(keys [n_kv, stop - start, k_dim], values) of the contiguous slots [start, stop): views, no copy."""
        n_kv, kd, vd, _ = self.layout
        rows = self.capacity * self.block_size
        k = self.keys[layer].reshape(n_kv, rows, kd)[:, start:stop]
        return k, self.values[layer].reshape(n_kv, rows, vd)[:, start:stop]

    def move(self, src: np.ndarray, dst: np.ndarray, stream: Optional[mx.Stream] = None) -> List[mx.array]:
        """Copy the K and V of slots src int [M] to slots dst int [M] in every layer (on `stream`); the reads
        see the arrays before the move, so src and dst may overlap. Returns the new arrays (to eval)."""
        src, dst = self.rows(src), self.rows(dst)
        with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
            for arrays in (self.keys, self.values):
                for layer in range(self.num_layers):
                    a = arrays[layer]
                    moved = mx.take(a, src, axis=0)  # [n_kv * M, D]
                    a[dst] = moved
                    arrays[layer] = a
        return self.keys + self.values
