"""The block pool: per-layer K and V storage in fixed-size blocks, a free list, reference counts and a budget.

Layout: block b of layer l holds `block_size` token slots of K and V, each [n_kv_heads, head_dim], as vLLM's
`[num_blocks, block_size, n_kv_heads, head_dim]` (arXiv 2309.06180), but stored head-major,
`[n_kv_heads, num_blocks * block_size, head_dim]` and kept flattened to `[n_kv_heads * rows, head_dim]`: a
token's slot is `block * block_size + offset`, its row for head h is `h * rows + slot`, and reads and writes
are one `mx.take` / one scatter on axis 0 of the flat array (MLX's CPU take on axis 0 is far faster than on
axis 1 of the 3-D array). Why not vLLM's
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

Quantized blocks (`quant`, a KVQuant of the affine scheme): each token row of K and V is stored packed in
MLX's affine layout, quantized when written (`mx.quantize` of the row in float16, after the Hadamard rotation
of kv/rotation.py where quant.rotate_k / rotate_v say so, as QuantKVCache does): per
layer and K / V three arrays with the same rows, codes uint32 [rows, dim * bits / 32] and float16 scales and
biases [rows, dim / group_size] (groups along head_dim; K and V with their own bits). Every operation on rows
(growth, shrinking, moves for repacking) treats a layer's arrays alike, its "planes": [K, V] for float
blocks, [K codes, K scales, K biases, V codes, V scales, V biases] for quantized ones, so packed data and
its scales always move together. `read` / `read_range` dequantize; attention reads the planes in place
(kernels/paged_attention.py). KIVI (keys per channel, groups along tokens) does not fit token rows.
"""

import heapq
import math
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from ..kernels.move_rows import move_rows, write_rows
from .defaults import BLOCK_SIZE, FEW_SLOTS, KV_SCALE_DTYPE, POOL_GROWTH, POOL_INITIAL_BLOCKS, POOL_SHRINK_FACTOR
from .errors import KVBudgetError
from .quant_options import KVQuant, check_head_dims, check_paged_quant
from .rotation import keys_basis, values_basis

#: One layer's quantized K or V: (codes uint32 [rows, dim * bits / 32], scales, biases float16
#: [rows, dim / group_size]).
Packed = Tuple[mx.array, mx.array, mx.array]


def size_text(nbytes: int) -> str:
    """Bytes as people read them: '512 B', '4.0 KiB', '1.4 MiB', '2.00 GiB'."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit, shift, digits in (("KiB", 10, 1), ("MiB", 20, 1), ("GiB", 30, 2)):
        if nbytes < 1 << (shift + 10) or unit == "GiB":
            return f"{nbytes / (1 << shift):.{digits}f} {unit}"


class BlockPool:
    """KV blocks shared by the requests of one model.

    Args:
        num_layers: decoder layers with a KV cache (one K and one V array each).
        block_size: token slots per block (>= 1).
        budget_bytes: most bytes the pool may hold over all layers (K and V), or None.
        budget_blocks: most blocks, or None; with neither the pool is unbounded.
        initial_blocks: capacity allocated at the first write.
        quant: quantized blocks (a KVQuant of the affine scheme from the first token), or None for float.

    The layout (n_kv_heads, head dims, dtype) is fixed by `configure`, called by the first cache write
    (PagedKVCache) or explicitly. Raises MlxInferError for a bad size or budget, or a quant the pool cannot
    hold (KIVI, a float prefix: kv.quant_options.check_paged_quant).
    """

    def __init__(self, num_layers: int, block_size: int = BLOCK_SIZE, budget_bytes: Optional[int] = None,
                 budget_blocks: Optional[int] = None, initial_blocks: int = POOL_INITIAL_BLOCKS,
                 quant: Optional[KVQuant] = None):
        if num_layers < 1 or block_size < 1 or initial_blocks < 1:
            raise MlxInferError(
                f"a block pool needs >= 1 layer, block size and initial block (got {num_layers}, {block_size}, "
                f"{initial_blocks})")
        for name, v in (("budget_bytes", budget_bytes), ("budget_blocks", budget_blocks)):
            if v is not None and v <= 0:
                raise MlxInferError(f"the KV {name} must be positive (got {v}); omit it for no limit")
        if quant is not None:
            check_paged_quant(quant)
        self.num_layers = num_layers
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self._budget_blocks = budget_blocks
        self.initial_blocks = initial_blocks
        self.quant = quant
        self.layout: Optional[Tuple[int, int, int, mx.Dtype]] = None  # n_kv, k_dim, v_dim, dtype
        # per layer its planes, each [n_kv * capacity * block_size, width] (see plane_shapes); None before
        # the first allocation
        self.planes: List[Optional[List[mx.array]]] = [None] * num_layers
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
        layout = (n_kv_heads, k_dim, v_dim, dtype)
        if layout == self.layout:  # every layer's write of every step: the check only
            return
        layout = (int(n_kv_heads), int(k_dim), int(v_dim), dtype)
        if self.layout is None:
            if self.quant is not None:
                check_head_dims(self.quant, layout[1], layout[2])
            self.layout = layout
        elif self.layout != layout:
            raise MlxInferError(
                f"this KV block pool holds (n_kv, k_dim, v_dim, dtype) = {self.layout}, a layer wrote {layout}: "
                "use one pool per model")

    def plane_shapes(self) -> List[Tuple[int, mx.Dtype]]:
        """(width, dtype) of each plane of a layer, one row per (head, slot): float blocks [(k_dim, dtype),
        (v_dim, dtype)]; quantized ones the codes, scales and biases of K, then of V."""
        n_kv, kd, vd, dtype = self.layout
        if self.quant is None:
            return [(kd, dtype), (vd, dtype)]
        g = self.quant.group_size
        return [(kd * self.quant.k_bits // 32, mx.uint32), (kd // g, KV_SCALE_DTYPE), (kd // g, KV_SCALE_DTYPE),
                (vd * self.quant.v_bits // 32, mx.uint32), (vd // g, KV_SCALE_DTYPE), (vd // g, KV_SCALE_DTYPE)]

    @property
    def token_bytes(self) -> int:
        """Bytes one token slot holds in one layer, K and V over its heads (quantized: codes, scales and
        biases); 0 before `configure`."""
        if self.layout is None:
            return 0
        return self.layout[0] * sum(w * dt.size for w, dt in self.plane_shapes())

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (quantized: packed codes, scales and biases; 0
        before `configure`)."""
        return self.num_layers * self.block_size * self.token_bytes

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V."""
        return self.block_bytes // self.num_layers

    def budget_text(self) -> str:
        """The budget for messages: '256.0 MiB' and, when it cannot hold one block, how much one takes
        (after `configure`)."""
        text = size_text(self.budget_bytes) if self.budget_bytes is not None else "no limit"
        if self.budget_bytes is not None and self.layout is not None and self.budget_bytes < self.block_bytes:
            text += (f" (smaller than one block of {self.block_size} tokens, which takes "
                     f"{size_text(self.block_bytes)} with this model)")
        return text

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
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> List[mx.array]:
        """Every array of the pool (all layers' planes), e.g. to evaluate after writes."""
        return [a for planes in self.planes if planes is not None for a in planes]

    def rebind(self, arrays: Sequence[mx.array]) -> None:
        """Take `arrays` (in the order of `arrays()`, the same shapes and dtypes: new versions of the planes,
        such as a compiled step's writes gives them) as the pool's planes.

        Raises:
            MlxInferError: another number of arrays, or one of another shape or dtype.
        """
        current = self.arrays()
        if len(arrays) != len(current) or any(a.shape != c.shape or a.dtype != c.dtype for a, c in zip(arrays, current)):
            raise MlxInferError("BlockPool.rebind takes new versions of the planes arrays() gives, in order")
        it = iter(arrays)
        for layer, planes in enumerate(self.planes):
            if planes is not None:
                self.planes[layer] = [next(it) for _ in planes]

    def layer_kv(self, layer: int) -> Tuple[Union[mx.array, Packed], Union[mx.array, Packed]]:
        """(keys, values) of layer `layer`: float blocks [n_kv * rows, k_dim] and [n_kv * rows, v_dim];
        quantized ones a Packed (codes, scales, biases) each, with the same rows. Row = head * rows + slot.
        Attention calls this once per layer and step: it touches that layer only."""
        p = self.planes[layer]
        return (p[0], p[1]) if self.quant is None else (tuple(p[:3]), tuple(p[3:]))

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
        n_kv = self.layout[0]
        rows, old = new_cap * self.block_size, self.capacity * self.block_size
        shapes = self.plane_shapes()
        for layer in range(self.num_layers):
            planes = self.planes[layer]
            if planes is None:
                self.planes[layer] = [mx.zeros((n_kv * rows, d), dt) for d, dt in shapes]
                continue
            for i, (d, dt) in enumerate(shapes):
                a = planes[i].reshape(n_kv, old, d)
                if rows > old:
                    a = mx.concatenate([a, mx.zeros((n_kv, rows - old, d), dt)], axis=1)
                else:  # a copy, so that the larger buffer is released
                    a = mx.contiguous(a[:, :rows])
                planes[i] = a.reshape(n_kv * rows, d)
        mx.eval(self.arrays())
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

    def rows(self, slots: Sequence[int]) -> mx.array:
        """The flat-array rows of slots int [S] for every head, head-major: int32 [n_kv * S] (valid until the
        capacity changes). A few slots (a decode or verify step's writes) are computed in Python: a NumPy call
        right after an evaluation waits on the CPU backend, a cost a step should not pay."""
        n_kv, stride = self.layout[0], self.capacity * self.block_size
        if len(slots) <= FEW_SLOTS:
            few = [int(s) for s in slots]
            return mx.array([h * stride + s for h in range(n_kv) for s in few], dtype=mx.int32)
        rows = np.arange(n_kv, dtype=np.int64)[:, None] * stride + np.asarray(slots)[None]
        return mx.array(rows.reshape(-1).astype(np.int32))

    def write(self, layer: int, rows: Union[int, mx.array], keys: mx.array, values: mx.array) -> None:
        """Store tokens' K and V: rows = rows(slots) int32 [n_kv * L] (one `write_rows` per plane), or for one token
        (L == 1) its slot, an int (one strided slice update per plane: rows slot, slot + rows_per_head, ...;
        cheaper than a scatter and its reshapes); keys
        [n_kv, L, k_dim], values [n_kv, L, v_dim] (any leading shape with n_kv * L rows). Quantized blocks
        quantize each row first (Hadamard-rotated where quant.rotate_k / rotate_v say so, float16, then MLX's
        affine quantization: QuantKVCache's packing of the same row)."""
        planes = self.planes[layer]
        if self.quant is None and not isinstance(rows, int):  # one operation per plane, no reshapes
            for i, x in enumerate((keys, values)):
                planes[i] = write_rows(planes[i], x, rows)
            return
        k, v = keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1])  # [n_kv * L, D]
        if self.quant is None:
            new = (k, v)
        else:
            q = self.quant
            k, v = keys_basis(k, q), values_basis(v, q)
            new = [*mx.quantize(k.astype(KV_SCALE_DTYPE), group_size=q.group_size, bits=q.k_bits),
                   *mx.quantize(v.astype(KV_SCALE_DTYPE), group_size=q.group_size, bits=q.v_bits)]
        if isinstance(rows, int):
            stride = self.capacity * self.block_size
            for a, x in zip(planes, new):
                a[rows : rows + (self.layout[0] - 1) * stride + 1 : stride] = x
            return
        for i, x in enumerate(new):
            planes[i] = write_rows(planes[i], x, rows)

    def dequantize(self, packed: Sequence[mx.array], bits: int) -> mx.array:
        """Float rows [..., dim] in the pool's dtype of packed rows (codes [..., dim * bits / 32], scales,
        biases [..., dim / group_size]), in their stored basis, as QuantKVCache dequantizes its own."""
        w, s, b = packed
        dtype = self.layout[3]
        return mx.dequantize(w, s.astype(dtype), b.astype(dtype), group_size=self.quant.group_size, bits=bits)

    def gather(self, layer: int, rows: mx.array, shape: Tuple[int, ...]) -> Tuple[mx.array, mx.array]:
        """(keys shape + (k_dim,), values shape + (v_dim,)) of layer `layer` at pool rows int32 [N] (N =
        prod(shape)): one mx.take per plane, quantized blocks dequantized to the pool's dtype."""
        return self._as_kv(self.take(layer, rows), shape)

    def _as_kv(self, planes: List[mx.array], shape) -> Tuple[mx.array, mx.array]:
        """(keys, values) of a layer's planes taken on some rows (each [n_rows, width]), reshaped to `shape`
        + (dim,): the float planes, or the quantized ones dequantized."""
        if self.quant is None:
            k, v = planes
        else:
            k = keys_basis(self.dequantize(planes[:3], self.quant.k_bits), self.quant)  # back to the model's basis
            v = values_basis(self.dequantize(planes[3:], self.quant.v_bits), self.quant)
        return k.reshape(*shape, k.shape[-1]), v.reshape(*shape, v.shape[-1])

    def take(self, layer: int, rows: mx.array) -> List[mx.array]:
        """Layer `layer`'s planes at pool rows int32 [N]: each [N, width] (one mx.take per plane)."""
        return [mx.take(a, rows, axis=0) for a in self.planes[layer]]

    def read(self, layer: int, rows: mx.array) -> Tuple[mx.array, mx.array]:
        """(keys [n_kv, S, k_dim], values [n_kv, S, v_dim]) of `rows(slots)` (int32 [n_kv * S]), in that order
        (quantized blocks: dequantized to the pool's dtype)."""
        return self.gather(layer, rows, (self.layout[0], -1))

    def range_planes(self, layer: int, start: int, stop: int) -> List[mx.array]:
        """Layer `layer`'s planes over the contiguous slots [start, stop) of every head: views
        [n_kv, stop - start, width], no copy."""
        n_kv, rows = self.layout[0], self.capacity * self.block_size
        return [a.reshape(n_kv, rows, a.shape[-1])[:, start:stop] for a in self.planes[layer]]

    def read_range(self, layer: int, start: int, stop: int) -> Tuple[mx.array, mx.array]:
        """(keys [1, n_kv, stop - start, k_dim], values [1, n_kv, stop - start, v_dim]) of the contiguous
        slots [start, stop) with a request's batch axis: views, no copy (quantized blocks: dequantized).
        Every layer of every step reads this way, so float blocks take two view operations per array."""
        n_kv, rows = self.layout[0], self.capacity * self.block_size
        if self.quant is None:
            k, v = self.planes[layer]
            return (k.reshape(1, n_kv, rows, k.shape[1])[:, :, start:stop],
                    v.reshape(1, n_kv, rows, v.shape[1])[:, :, start:stop])
        k, v = self._as_kv(self.range_planes(layer, start, stop), (1, n_kv, -1))
        return k, v

    def move(self, src: np.ndarray, dst: np.ndarray, stream: Optional[mx.Stream] = None) -> List[mx.array]:
        """Copy the K and V of slots src int [M] to slots dst int [M] in every layer (on `stream`; quantized
        blocks: codes, scales and biases alike); the reads see the arrays before the move, so src and dst
        may overlap. One kernels.move_rows per plane: on the CPU kernel only the moved rows are copied
        (the buffer is reused); the reference's gather + scatter copies the whole plane. Returns the new
        arrays (to eval)."""
        src, dst = self.rows(src), self.rows(dst)  # int32 [n_kv * M]
        with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
            for planes in self.planes:
                for i, a in enumerate(planes):
                    planes[i] = move_rows(a, src, dst)  # in place on the CPU kernel (kernels/move_rows.py)
        return self.arrays()
