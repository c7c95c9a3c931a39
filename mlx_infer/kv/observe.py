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
from typing import Deque, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UnsupportedModelError
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

    def rows(self, b: int, n: int) -> List[mx.array]:
        """Row b's last n query positions of the last forward, per layer: [1, H, n, D] each (a batched
        forward's request b, whose n real tokens are the last n columns of its left-padded row)."""
        return [t.queries[b:b + 1, :, t.queries.shape[2] - n:] for t in self.taps]


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
        self.rows: Deque[Tuple[int, List[mx.array]]] = deque()  # (position, per-layer q [H, 1, D])
        self.since = 0
        self.seconds = 0.0  # spent in `stats` (host wall time incl. the evaluation)

    def record(self, queries: List[mx.array]) -> None:
        """After a forward: keep its queries (the last `window` positions). queries: the request's rotated
        queries of that forward per layer, [1, H, L, D] each, for its last L tokens (QueryTap.queries, or
        QueryTap.rows of a batched forward)."""
        qs = queries
        L = qs[0].shape[2]
        end = self.caches[0].sequence.table.length
        lo = max(0, L - self.window)
        tail = [mx.contiguous(q[0, :, lo:]) for q in qs]  # [H, w, D]: a copy, so a prefill's q is not kept
        for i in range(L - lo):
            self.rows.append((end - L + lo + i, [t[:, i : i + 1] for t in tail]))
        while len(self.rows) > self.window:
            self.rows.popleft()
        self.since += 1

    def due(self) -> bool:
        return self.since >= self.period and bool(self.rows)

    def stats(self) -> AttentionStats:
        """Score the kept queries against the live keys of every layer: AttentionStats over [layers * H, S]."""
        start = time.perf_counter()
        seq = self.caches[0].sequence
        tokens = seq.live_positions()
        qpos = mx.array([p for p, _ in self.rows], mx.int32)[:, None]  # [W, 1]
        visible = qpos >= mx.array(tokens.astype(np.int32))[None]  # [W, S]
        out = []
        for layer, cache in enumerate(self.caches):
            q = mx.concatenate([r[1][layer] for r in self.rows], axis=1).astype(mx.float32)  # [H, W, D]
            k, _ = seq.live(cache.layer)  # [1, n_kv, S, D] (views, or one gather: dropped after this call)
            n_kv = k.shape[1]
            H, W, D = q.shape
            q = q.reshape(n_kv, H // n_kv, W, D)
            s = (q @ k[0].astype(mx.float32)[:, None].swapaxes(-1, -2)) * self.scales[layer]  # [n_kv, r, W, S]
            s = mx.where(visible, s, -mx.inf)
            out.append(mx.softmax(s, axis=-1).sum(axis=2).reshape(H, -1))  # [H, S]
        attention = np.array(mx.concatenate(out, axis=0))
        self.since = 0
        self.seconds += time.perf_counter() - start
        return AttentionStats(tokens, attention, len(self.rows))
