"""One batched forward over several requests' paged caches: BatchStep plans it (n_b new tokens for request
b: one each when decoding, a prompt chunk each when prefilling newcomers together), BatchLayerCache is what
each layer of the model sees (mlx-lm's cache protocol with a batch axis).

    step = BatchStep([req.sequence for req in running], [1] * B)   # appends the slots (may grow the pool)
    logits = model(step.inputs(tokens), cache=step.caches())       # [B, L, V]
    step.done()

Inputs are left-padded to L = max n_b: request b's tokens fill the last n_b columns, so every row's last
column is a real token (its next-token logits). RoPE positions are per row (an int32 [B] `offset`, which
mlx's `fast.rope` takes per batch row): row b starts at its logical length minus its padding, so its real
tokens get their own positions (eviction keeps original positions here too). Each layer writes the real
tokens' K/V into the pool with one scatter. Attention then reads every request's live tokens (the new ones
included) in one of two ways:

- fused (where the paged-attention kernel runs; the attention hook, kv/attention_hook.py, calls
  `BatchLayerCache.fused_attention`): the kernel reads the pool's rows in place through the step's row index
  (kernels/paged_attention.py), with the visibility rule of the mask below computed from the same positions,
  at every width (a prefill chunk in blocks of PAGED_MAX_QUERIES positions, each row as a one-token step
  computes it); the gathered K/V that `update_and_fetch` returns are then never used, so MLX (lazy) never
  computes them. Measured on the default model it is faster than the gather at 1-8 requests and 100-2000
  tokens of context, and a batched prefill more so the longer its prompts
  (docs/kv.md#attention-over-the-pool-the-paged-attention-kernel).
- gathered (no kernel, head dims it does not take, models that do not call the hooked attention): one
  `mx.take` into [B, n_kv, S, D], right-padded, and mlx-lm's attention with a bool mask [B, 1, L, S] that
  hides padding, keys after the query (causal, by original position) and keys outside a sliding window.

The row index and the positions are built once per step and shared by all layers (they hold the same slots).
"""

from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from ..kernels.paged_attention import paged_attention, paged_kernel_runs, paged_quant_attention
from .pool import BlockPool
from .rotation import keys_basis, values_basis
from .sequence import PagedSequence


def fused_attention_applies(pool: BlockPool) -> bool:
    """Whether a fused BatchStep over `pool` (its layout configured) attends on the paged-attention kernel here,
    at any number of positions per request (for a model whose attention the hook reaches,
    kv/attention_hook.py)."""
    _, k_dim, v_dim, _ = pool.layout
    return paged_kernel_runs(k_dim, v_dim)


class BatchStep:
    """The plan of one forward of lengths[b] new tokens for each of B requests sharing a BlockPool.

    Args:
        sequences: the requests' PagedSequences (between forwards, the pool's layout configured).
        lengths: new tokens per request (each >= 1).
        fused: attention reads the pool in place on the paged-attention kernel where it runs (see the
            module docstring); False: always the gather and mlx-lm's masked attention (the reference path).

    Raises:
        KVBudgetError: the pool cannot hold the new tokens (nothing is appended then).
        MlxInferError: sequences of different pools, one in the middle of a forward, or a length < 1.
    """

    def __init__(self, sequences: List[PagedSequence], lengths: Sequence[int], fused: bool = True):
        if not sequences or len(lengths) != len(sequences) or min(lengths) < 1:
            raise MlxInferError("a batched step needs at least one request, each with >= 1 new token")
        self.sequences, self.lengths = sequences, [int(n) for n in lengths]
        self.pool = pool = sequences[0].pool
        if any(s.pool is not pool for s in sequences) or not all(s.ready() for s in sequences):
            raise MlxInferError("a batched step needs requests of one pool, each between forwards")
        starts = [s.table.length for s in sequences]
        new_slots: List[np.ndarray] = []
        try:
            for s, n in zip(sequences, self.lengths):  # allocation (and pool growth) before any row is computed
                new_slots.append(s.table.append(n))
        except Exception:
            for s, n in zip(sequences, self.lengths[:len(new_slots)]):
                s.table.truncate(s.table.length - n)
            raise
        B, L = len(sequences), max(self.lengths)
        n_kv = pool.layout[0]
        heads = np.arange(n_kv, dtype=np.int64) * (pool.capacity * pool.block_size)  # [n_kv]
        pads = np.array([L - n for n in self.lengths], np.int64)  # [B]
        # the real tokens of keys [B, n_kv, L, D] flattened, (b, h, t) order, and their pool rows
        src = [(b * n_kv + np.arange(n_kv)[:, None]) * L + pads[b] + np.arange(n)[None]
               for b, n in enumerate(self.lengths)]
        dst = [heads[:, None] + sl[None] for sl in new_slots]
        self.write_rows = mx.array(np.concatenate([d.reshape(-1) for d in dst]).astype(np.int32))
        self.read_real = None if (pads == 0).all() else mx.array(np.concatenate([x.reshape(-1) for x in src]).astype(np.int32))
        slots = [s.table.live_slots() for s in sequences]
        positions = [s.table.live_tokens() for s in sequences]
        S = max(len(x) for x in slots)
        index = np.zeros((B, n_kv, S), np.int64)
        kpos = np.full((B, S), -1, np.int64)
        for b, (sl, p) in enumerate(zip(slots, positions)):
            index[b, :, :len(sl)] = heads[:, None] + sl[None]
            kpos[b, :len(p)] = p
        self._index = index  # [B, n_kv, S] pool rows, right-padded with 0
        self._flat_index: Optional[mx.array] = None
        self.shape = (B, n_kv, L, S)
        self.fused = fused
        self._live = np.array([len(x) for x in slots], np.int32)  # [B] live tokens per request
        self._kpos = kpos  # [B, S] original positions of the keys, -1 = padding
        self._qpos = np.array(starts, np.int64)[:, None] - pads[:, None] + np.arange(L)[None]  # [B, L]
        self.offset = mx.array((np.array(starts) - pads).astype(np.int32))  # [B] RoPE position of column 0
        self._masks: Dict[Optional[int], mx.array] = {}
        self._kernel_operands: Optional[Tuple[mx.array, mx.array, mx.array, mx.array]] = None

    @property
    def index(self) -> mx.array:
        """int32 [B * n_kv * S]: the pool row of each request's live tokens, per head, right-padded with row 0."""
        if self._flat_index is None:
            self._flat_index = mx.array(self._index.reshape(-1).astype(np.int32))
        return self._flat_index

    def inputs(self, tokens: Sequence[Sequence[int]]) -> mx.array:
        """The forward's input ids [B, L] uint32: request b's n_b tokens, left-padded with its first token."""
        B, _, L, _ = self.shape
        if [len(t) for t in tokens] != self.lengths:
            raise MlxInferError(f"the step plans {self.lengths} new tokens, got {[len(t) for t in tokens]}")
        return mx.array([[t[0]] * (L - len(t)) + list(t) for t in tokens], mx.uint32)

    def mask(self, window_size: Optional[int]) -> mx.array:
        """bool [B, 1, L, S]: the live keys each query sees: its request's, at or before its position, and
        with a sliding window less than window_size positions back. A padding query sees its request's
        first key (a finite softmax; its output is never used)."""
        if window_size not in self._masks:
            q, k = self._qpos[:, :, None], self._kpos[:, None, :]  # [B, L, 1], [B, 1, S]
            visible = (k >= 0) & (k <= q)
            if window_size is not None:
                visible &= q < k + window_size
            visible[:, :, 0] |= ~visible.any(axis=2)
            self._masks[window_size] = mx.array(visible)[:, None]
        return self._masks[window_size]

    def window_of(self, mask) -> Tuple[bool, Optional[int]]:
        """(True, window_size) when `mask` is one this step built (`mask(window_size)`), else (False, None):
        how the fused path knows a layer's sliding window from the mask mlx-lm hands its attention."""
        for window, made in self._masks.items():
            if made is mask:
                return True, window
        return False, None

    def kernel_operands(self, width: Optional[int] = None) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """The paged-attention kernel's view of the step, built once for all layers: (index int32
        [B, n_kv, S] pool rows, right-padded; lengths int32 [B] live tokens; q_pos int32 [B, L] and k_pos
        int32 [B, S] original positions). With `width` (>= S) the index and k_pos are padded to that many
        keys (row 0, position -1; the kernel reads only the first lengths[b]), so that steps of different
        lengths can share one compiled graph."""
        B, n_kv, _, S = self.shape
        if width is not None and width != S:
            if width < S:
                raise MlxInferError(f"kernel operands of {width} keys for a step of {S}")
            index = np.zeros((B, n_kv, width), np.int32)
            index[:, :, :S] = self._index
            k_pos = np.full((B, width), -1, np.int32)
            k_pos[:, :S] = self._kpos
            return (mx.array(index), mx.array(self._live), mx.array(self._qpos.astype(np.int32)), mx.array(k_pos))
        if self._kernel_operands is None:
            self._kernel_operands = (self.index.reshape(B, n_kv, S), mx.array(self._live),
                                     mx.array(self._qpos.astype(np.int32)), mx.array(self._kpos.astype(np.int32)))
        return self._kernel_operands

    def caches(self) -> List["BatchLayerCache"]:
        """One cache per layer of the model, for `model(inputs, cache=...)`."""
        return [BatchLayerCache(self, layer) for layer in range(self.pool.num_layers)]

    def done(self) -> None:
        """After the forward: every request's layers stand at its table's end.

        Raises:
            MlxInferError: a layer of the model did not write its tokens.
        """
        for s in self.sequences:
            if not s.ready():
                raise MlxInferError("a batched forward ended with a layer that did not write its tokens")


class BatchLayerCache:
    """Layer `layer`'s cache for a BatchStep's forward (mlx-lm's protocol: `offset`, `update_and_fetch`,
    `make_mask`; and `fused_attention` for the attention hook)."""

    def __init__(self, step: BatchStep, layer: int):
        self.step, self.layer = step, layer

    @property
    def offset(self) -> mx.array:
        """int32 [B]: each row's RoPE position of its input's column 0."""
        return self.step.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Write the real tokens of keys [B, n_kv, L, k_dim] / values [B, n_kv, L, v_dim] and return every
        request's live keys [B, n_kv, S, k_dim] and values [B, n_kv, S, v_dim], right-padded (see mask); over
        quantized blocks the new tokens are quantized when written and the live ones returned dequantized.

        Raises:
            MlxInferError: inputs of another shape than the step planned.
        """
        step, pool = self.step, self.step.pool
        B, n_kv, L, S = step.shape
        if keys.shape[:3] != (B, n_kv, L):
            raise MlxInferError(f"the batched step planned keys [{B}, {n_kv}, {L}, D], got {keys.shape}")
        k_new, v_new = keys, values  # [B, n_kv, L, D]: the pool's write takes them as B * n_kv * L rows
        if step.read_real is not None:  # the real tokens' rows of the padded ones
            k_new, v_new = (mx.take(x.reshape(-1, x.shape[-1]), step.read_real, axis=0) for x in (keys, values))
        pool.write(self.layer, step.write_rows, k_new, v_new)
        for s, n in zip(step.sequences, step.lengths):
            s.advance(self.layer, n)
        return pool.gather(self.layer, step.index, (B, n_kv, S))  # quantized blocks: dequantized

    def fused_attention(self, queries: mx.array, scale: float, mask) -> Optional[mx.array]:
        """Attention of queries [B, n_q, L, D] over every request's live tokens, read in place from the pool
        on the paged-attention kernel (quantized blocks: the packed rows dequantized in its tile scratch):
        [B, n_q, L, Dv] in the queries' dtype. None when it does not apply
        (the step is not fused, head dims the kernel does not take, no kernel here, or a mask
        this step did not build): the caller then attends over update_and_fetch's gathered K/V. A padding
        query (a left-padded column) that sees no key gets zeros, where the mask gives it its request's first
        key: neither is ever used."""
        step, pool = self.step, self.step.pool
        ours, window = step.window_of(mask)
        if not (step.fused and ours and fused_attention_applies(pool)):
            return None
        keys, values = pool.layer_kv(self.layer)
        if pool.quant is not None:  # the packed rows, dequantized tile by tile in the kernel, in their basis
            out = paged_quant_attention(keys_basis(queries, pool.quant), keys, values, *step.kernel_operands(),
                                        scale, pool.quant.group_size, window or 0)  # [B, n_q, L, Dv]
            return values_basis(out, pool.quant)
        return paged_attention(queries, keys, values, *step.kernel_operands(), scale, window or 0)  # [B, n_q, L, Dv]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        """bool [B, 1, L, S] (BatchStep.mask).

        Raises:
            MlxInferError: N other than the step's L.
        """
        if N != self.step.shape[2]:
            raise MlxInferError(f"the batched step planned {self.step.shape[2]} query columns, got {N}")
        return self.step.mask(window_size)
