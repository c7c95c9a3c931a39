"""Attention statistics for the eviction policies without a second full attention pass.

The model's own attention runs in MLX's fused SDPA, which returns no probabilities. Instead, a QueryTap
keeps the rotated queries each attention layer computes anyway (it wraps the layer's RoPE module: mlx-lm's
attention rotates the queries, then the keys, with it), and every `period` forwards the observer scores the
queries of the last `window` positions against the cached live keys in one batched pass per layer:
softmax(q k^T * scale) over the keys each query may see (original positions: key <= query). With window ==
period every query is counted once (H2O's accumulated attention, batched and one period late); a window
smaller than the period samples them. Its cost is the QK^T part of `window` decode attentions every
`period` steps (measured in bench/kv_core.py --observe). Sliding windows are ignored when scoring.
"""

import time
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UnsupportedModelError
from ..kernels.prefill_attention import causal_softmax
from .cache import PagedKVCache
from .defaults import OBSERVE_PERIOD, OBSERVE_WINDOW
from .policies.base import AttentionStats


class _RopeTap(nn.Module):
    """A RoPE module that records what it rotates first in each attention call (the queries)."""

    def __init__(self, rope: nn.Module, n_heads: int):
        super().__init__()
        self.rope = rope
        self.n_heads = n_heads
        self.queries = None  # [1, H, L, D], the latest
        self._calls = 0

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        out = self.rope(x, offset=offset)
        if self._calls % 2 == 0:
            if x.shape[1] != self.n_heads:
                raise RuntimeError(f"the query tap expected {self.n_heads} query heads, got {x.shape[1]}")
            self.queries = out
        self._calls += 1
        return out


class QueryTap:
    """Records the rotated queries of every attention layer of an mlx-lm model (a context manager).

    Raises:
        UnsupportedModelError: a model whose layers have no `self_attn` with `rope`, `n_heads` and `scale`.
    """

    def __init__(self, model: nn.Module):
        try:
            self.attns = [layer.self_attn for layer in model.layers]
            self.scales = [float(a.scale) for a in self.attns]
            self.heads = [int(a.n_heads) for a in self.attns]
            self.ropes = [a.rope for a in self.attns]
        except AttributeError as e:
            raise UnsupportedModelError(f"attention statistics need mlx-lm attention layers ({e})") from e
        self.taps: List[_RopeTap] = []

    def __enter__(self) -> "QueryTap":
        self.taps = [_RopeTap(r, h) for r, h in zip(self.ropes, self.heads)]
        for attn, tap in zip(self.attns, self.taps):
            attn.rope = tap
        return self

    def __exit__(self, *exc) -> None:
        for attn, rope in zip(self.attns, self.ropes):
            attn.rope = rope
        self.taps = []

    def queries(self) -> List[mx.array]:
        """The last forward's rotated queries per layer: [B, H, L, D] each (B = 1 for one request's cache,
        the batch's rows for a batched forward, kv/batch.py)."""
        return [t.queries for t in self.taps]

    def rows(self, b: int = 0, n: Optional[int] = None) -> "QueryRows":
        """Row b's last n query positions of the last forward (all L when n is None): a batched forward's
        request b, whose n real tokens are the last n columns of its left-padded row. No MLX work: the
        columns are sliced when the observer scores them."""
        return QueryRows(self.queries(), b, n)


@dataclass(frozen=True)
class QueryRows:
    """One request's rotated queries of one forward: layers[l][row, :, L - count:] of each attention layer
    l's [B, H, L, D] queries (count None: all L)."""

    layers: List[mx.array]
    row: int = 0
    count: Optional[int] = None

    @property
    def n(self) -> int:
        """Query positions of the request in the forward."""
        return self.layers[0].shape[2] if self.count is None else self.count

    def last(self, layer: int, m: int) -> mx.array:
        """Layer `layer`'s last m (<= n) query positions of the request: [H, m, D]."""
        q = self.layers[layer]
        return q[self.row, :, q.shape[2] - m:]


class AttentionObserver:
    """Keeps the queries of the last `window` positions and scores them against the cache.

    Args:
        scales: each attention layer's softmax scale (QueryTap.scales).
        caches: the request's PagedKVCache per layer (same order as the model's layers).
        period: forwards between observations; window: most recent queries scored.
    """

    def __init__(self, scales: Sequence[float], caches: Sequence[PagedKVCache], period: int = OBSERVE_PERIOD,
                 window: int = OBSERVE_WINDOW):
        self.scales, self.caches = list(scales), list(caches)
        self.period, self.window = period, window
        self.rows: Deque[Tuple[int, int, QueryRows]] = deque()  # (first position, positions, queries), oldest first
        self.kept = 0  # positions in self.rows
        self.since = 0
        self.seconds = 0.0  # spent in `stats` (host wall time incl. the evaluation)

    def record(self, queries: QueryRows) -> None:
        """After a forward: keep its queries (the last `window` positions), the request's last positions
        (ending at its table's end). A forward longer than the window (a prefill chunk) has its last
        queries copied, so that its whole queries are not kept; others are kept as they are, sliced only
        when scored (no MLX work per decode step)."""
        m = min(queries.n, self.window)
        if queries.layers[0].shape[2] > self.window:
            queries = QueryRows([mx.contiguous(queries.last(layer, m)[None]) for layer in range(len(queries.layers))])
        self.rows.append((self.caches[0].sequence.table.length - m, m, queries))
        self.kept += m
        while self.kept - self.rows[0][1] >= self.window:
            self.kept -= self.rows.popleft()[1]
        self.since += 1

    def due(self) -> bool:
        return self.since >= self.period and bool(self.rows)

    def stats(self) -> AttentionStats:
        """Score the kept queries against the live keys of every layer: AttentionStats over [layers * H, S]."""
        start = time.perf_counter()
        seq = self.caches[0].sequence
        tokens = seq.live_positions()
        skip = max(0, self.kept - self.window)  # the oldest entry's first positions are past the window
        parts, positions = [], []
        for first, m, queries in self.rows:
            use = m - min(skip, m)
            skip -= m - use
            parts.append((queries, use))
            positions += range(first + m - use, first + m)
        # Keys are in position order, so query w sees a prefix of them: the first seen[w]. When the window's
        # queries are consecutive positions whose tokens are live, seen[w] = seen[0] + w: the causal
        # softmax kernel's rule (row r sees columns <= q0 + r % period), masking fused.
        seen = np.searchsorted(tokens, positions, side="right")  # [W]
        causal = seen[0] >= 1 and bool(np.array_equal(seen, seen[0] + np.arange(len(seen))))
        visible = None if causal else mx.arange(tokens.size)[None] < mx.array(seen.astype(np.int32))[:, None]  # [W, S]
        out = []
        for layer, cache in enumerate(self.caches):
            q = mx.concatenate([r.last(layer, m) for r, m in parts], axis=1).astype(mx.float32)  # [H, W, D]
            k, _ = seq.live(cache.layer)  # [1, n_kv, S, D] (views, or one gather: dropped after this call)
            n_kv = k.shape[1]
            H, W, D = q.shape
            s = q.reshape(n_kv, H // n_kv * W, D) @ k[0].astype(mx.float32).swapaxes(-1, -2)  # [n_kv, r * W, S]
            if causal:
                p = causal_softmax(s, self.scales[layer], W, int(seen[0]) - 1)
            else:
                s = mx.where(visible, s.reshape(n_kv, H // n_kv, W, -1) * self.scales[layer], -mx.inf)
                p = mx.softmax(s, axis=-1)  # [n_kv, r, W, S]
            out.append(p.reshape(n_kv, H // n_kv, W, -1).sum(axis=2).reshape(H, -1))  # [H, S]
        attention = np.array(mx.concatenate(out, axis=0))
        self.since = 0
        self.seconds += time.perf_counter() - start
        return AttentionStats(tokens, attention, len(positions))
