"""The paged KV cache as the Engine uses it: one PagedKV per engine (its block pool, budget and repack stream)
and one KVRequest per request (eviction when asked for, the retained-block record, the `kv` stats).

    kv = PagedKV(model, budget_bytes=512 << 20, block_size=16)
    cache, cached = kv.start(prompt_ids)        # per-layer PagedKVCache from the longest cached prefix
    kv.reserve(cache, prompt_tokens=..., new_tokens=..., evict=None)   # KVBudgetError before prefill
    with KVRequest(kv, cache, EvictSpec("h2o", 0.5), repack=True) as req:
        for token in tokens:                    # after each forward of the decode loop
            req.step()                          # batched: req.step(tap.rows(b, n)), see batch/scheduler.py
    req.stats()                                 # GenerationStats.kv
    kv.keep(cache, prompt_ids + generated)      # full blocks to the prefix cache, the rest to the pool
"""

import math
import threading
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..errors import MlxInferError
from .cache import PagedKVCache, make_paged_cache, make_pool
from .defaults import PREFIX_CACHE_BYTES
from .errors import KVBudgetError
from .evict import EvictionController
from .observe import AttentionObserver, QueryRows, QueryTap
from .options import EvictSpec
from .policies import make_policy
from .prefix import PrefixCache
from .quant_options import KVQuant
from .repack import Repacker


def release(cache: Optional[list]) -> None:
    """Give a request's KV blocks back to their pool (a paged cache); a dense cache or None: nothing."""
    if cache and isinstance(cache[0], PagedKVCache):
        cache[0].sequence.release()


class _ThreadStream(threading.local):
    """A stream per thread (PagedKV.repack_stream)."""

    stream: Optional[mx.Stream] = None


def probe_kv_layout(model: nn.Module) -> Tuple[int, int, int, mx.Dtype]:
    """(n_kv_heads, k_dim, v_dim, dtype) of the model's K/V: one token through its first layer's dense
    mlx-lm cache (a forward of one token)."""
    dense = make_prompt_cache(model)
    model(mx.array([[0]]), cache=dense)
    keys, values = dense[0].keys, dense[0].values  # [1, n_kv, L, k_dim], [1, n_kv, L, v_dim]
    return keys.shape[1], keys.shape[3], values.shape[3], keys.dtype


class PagedKV:
    """The paged KV cache of one engine: one BlockPool shared by its requests (one at a time here, or a batch:
    batch/scheduler.py); a KVStore (kv/store.py), as DenseStore is.

    Args:
        model: the engine's mlx-lm model.
        budget_bytes: most bytes the pool may hold over all layers, K and V (None: no limit).
        block_size: tokens per block.
        quant: quantized blocks (the affine scheme; kv.quant_options.check_paged_quant), None for float.
        layout: the model's (n_kv_heads, k_dim, v_dim, dtype) when the caller has probed it already
            (probe_kv_layout); None: probed before the first request (ensure_layout).

    Raises:
        MlxInferError: a quant the paged cache cannot hold (KIVI, a float prefix), or head dims it cannot
            pack.
    """

    def __init__(self, model: nn.Module, budget_bytes: Optional[int], block_size: int,
                 quant: Optional[KVQuant] = None, layout: Optional[Tuple[int, int, int, mx.Dtype]] = None):
        self.model = model
        self.pool = make_pool(model, quant, block_size=block_size, budget_bytes=budget_bytes)
        if layout is not None:
            self.pool.configure(*layout)
        self.prefix = PrefixCache(self.pool)  # shared full blocks (batched requests: BatchScheduler)
        self._streams = _ThreadStream()  # the repacker's copy stream, one per thread using the engine

    kind = "paged"
    evicts = True

    def repack_stream(self) -> mx.Stream:
        """The stream repacking copies run on, for the calling thread (MLX streams belong to the thread that
        made them: a batch runner's thread gets its own)."""
        if self._streams.stream is None:
            self._streams.stream = mx.new_stream(mx.default_device())
        return self._streams.stream

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def quant(self) -> Optional[KVQuant]:
        """The pool's KV quantization (None: float blocks)."""
        return self.pool.quant

    def new_cache(self) -> List[PagedKVCache]:
        """A fresh request's per-layer caches over the pool (mlx-lm's prompt_cache protocol)."""
        return make_paged_cache(self.model, self.pool)

    def start(self, prompt_ids: Sequence[int], share: bool = True) -> Tuple[List[PagedKVCache], int]:
        """(caches, cached): a request's per-layer caches, holding the longest cached prefix of its prompt when
        `share` (PrefixCache.lookup: whole blocks, never the prompt's last token; the request holds its own
        reference to them, so make_room cannot free them), and how many prompt tokens they hold."""
        self.ensure_layout()
        cache = self.new_cache()
        if share:
            cache[0].sequence.adopt(self.prefix.lookup(prompt_ids))
        return cache, cache[0].sequence.table.length

    def keep(self, cache: List[PagedKVCache], tokens: Sequence[int]) -> None:
        """A request ends: its full blocks go to the prefix cache (keyed by `tokens`, the prompt and every token
        it generated; only when its table has no hole and the caches hold a prefix of `tokens`), then it
        releases every block (those the cache holds stay, idle, for the next request that shares them)."""
        table = cache[0].sequence.table
        if table.n_live == table.length <= len(tokens) and all(c.offset == table.length for c in cache):
            self.prefix.insert(list(tokens)[:table.length], table.blocks)
        release(cache)

    def release(self, cache: Optional[list]) -> None:
        """A request ends without keeping its KV: every block it holds goes back to the pool."""
        release(cache)

    def track(self, cache: List[PagedKVCache], evict: Optional[EvictSpec], repack: bool = True) -> "KVRequest":
        """The KVRequest of a lone request (its eviction, its block record, GenerationStats.kv)."""
        return KVRequest(self, cache, evict, repack)

    def reset(self) -> int:
        """Forget the prefix cache and shrink the pool when no request holds a block (release_idle); returns
        the bytes released."""
        self.prefix.clear()
        return self.release_idle()

    def batch_kv(self) -> "PagedKV":
        """Batched requests share this pool."""
        return self

    def ensure_layout(self) -> None:
        """Fix the pool's layout before the first request (its budget in blocks needs it): the K/V shape and
        dtype of one token through a dense mlx-lm cache. Also bounds the prefix cache of a pool without a
        budget (PREFIX_CACHE_BYTES)."""
        if self.pool.layout is None:
            self._probe_layout()
        if self.pool.budget_bytes is None and self.prefix.max_blocks is None:
            self.prefix.max_blocks = PREFIX_CACHE_BYTES // self.pool.block_bytes

    def release_idle(self) -> int:
        """When no request holds a block: forget the prefix cache (its blocks go back to the pool) and shrink
        the pool to its initial capacity, so its memory can return to the system (backend.return_free_memory).
        The next request grows it again and prefills its prompt in full. Returns the pool bytes released
        (0 while a request holds blocks)."""
        if self.pool.blocks_in_use > self.prefix.idle_blocks:  # a request holds blocks
            return 0
        before = self.pool.nbytes
        self.prefix.clear()
        self.pool.shrink()
        return before - self.pool.nbytes

    def check_budget(self) -> None:
        """Raise KVBudgetError when the budget cannot hold a single block (the layout probed first), so that
        a budget too small for any request fails where it is given, not on every request."""
        self.ensure_layout()
        if self.pool.max_blocks == 0:
            raise KVBudgetError(f"the KV budget of {self.pool.budget_text()} holds no KV block: raise kv_budget")

    def _probe_layout(self) -> None:
        self.pool.configure(*probe_kv_layout(self.model))

    def reserve(self, cache: List[PagedKVCache], prompt_tokens: int, new_tokens: int,
                evict: Optional[EvictSpec] = None, repack: bool = True) -> None:
        """Make room for a lone request (before prefill): free idle cached prefix blocks, least recently used
        first, until the pool has the blocks of its prompt and `new_tokens` more, or with vToken eviction the
        most it keeps (reserved_blocks; the request is repacked when the pool needs the room,
        KVRequest.step), less the blocks it already holds (its cached prefix).

        Raises:
            KVBudgetError: the request can never fit the budget (what other requests hold counted).
        """
        if self.pool.budget_bytes is None:
            return
        self.ensure_layout()
        need, most = reserved_blocks(evict, repack, prompt_tokens, new_tokens, self.block_size)[0], self.pool.max_blocks
        own = len(cache[0].sequence.table.blocks)
        other = self.pool.blocks_in_use - own - self.prefix.idle_blocks
        if need > most - other:  # refused before anything is freed: the prefix cache stays as it was
            raise KVBudgetError(
                over_budget(self.pool, need, prompt_tokens, new_tokens, evict, repack, most - other),
                "raise kv_budget or lower max_tokens" + ("" if evict is not None else
                                                         ", or evict tokens (evict=POLICY:RATIO)"))
        self.prefix.make_room(need - own)


def over_budget(pool, need: int, prompt_tokens: int, new_tokens: int, evict: Optional[EvictSpec], repack: bool,
                holds: int) -> str:
    """What does not fit, for a KVBudgetError: 'the request needs N KV blocks of 16 tokens (P prompt + T new,
    evicting h2o:0.5) but the KV budget of 256.0 MiB holds M' (pool: the BlockPool)."""
    kept = "" if evict is None else f", evicting {evict}" + ("" if repack else " without repacking")
    return (f"the request needs {need} KV blocks of {pool.block_size} tokens ({prompt_tokens} prompt + "
            f"{new_tokens} new{kept}) but the KV budget of {pool.budget_text()} holds {holds}")


def reserved_blocks(evict: Optional[EvictSpec], repack: bool, prompt_tokens: int, new_tokens: int,
                    block_size: int) -> Tuple[int, int]:
    """(before, after): the most KV blocks a request of prompt_tokens + new_tokens may need at once until its
    first eviction, and after it; what batched admission reserves (batch/scheduler.py).

    Without eviction, and with Naive-Evict (repack False: blocks are freed only when every token in them
    is evicted, which nothing bounds), both are every token's blocks. With vToken eviction
    (EvictionController: after each forward at most max(1, ceil((1 - ratio) * length)) tokens stay live;
    one-shot policies such as SnapKV evict once, then every new token stays), `after` is the blocks of the
    most tokens ever live, packed densely, plus one: forced repacking (KVRequest.compact) packs a request's
    live tokens into ceil(live / block_size) blocks whenever the pool needs the room. `before` adds the
    prompt and the first new token, all held until the first eviction (after the first decode forward).
    """
    every = math.ceil((prompt_tokens + new_tokens) / block_size)
    if evict is None or not repack:
        return every, every
    keep = 1.0 - evict.ratio
    if make_policy(evict.policy).once:
        live = max(1, math.ceil(keep * prompt_tokens)) + new_tokens
    else:
        live = max(1, math.ceil(keep * (prompt_tokens + new_tokens))) + 1
    after = min(every, math.ceil(live / block_size) + 1)
    return max(after, min(every, math.ceil((prompt_tokens + 1) / block_size))), after


class KVRequest:
    """One request on the paged cache: eviction (when `evict` is given: its policy, an attention observer on
    the model's queries, a Repacker, or Naive-Evict with repack=False), and per decode step the request's
    retained blocks.

    On its own (Engine.stream_steps) it is a context manager: its query tap is installed on the model while
    it is open, and `step()` reads that tap. In a batched forward the scheduler's tap holds every request's
    queries and hands each request its row (`step(queries)`).

    Args:
        kv: the engine's PagedKV.
        cache: the request's caches (from kv.new_cache, possibly a kept prefix).
        evict: EvictSpec or None (no eviction).
        repack: vToken repacking (False: Naive-Evict, the same decisions, blocks freed only when empty).

    Raises:
        UnsupportedModelError: eviction on a model whose attention layers the query tap cannot reach.
    """

    def __init__(self, kv: PagedKV, cache: List[PagedKVCache], evict: Optional[EvictSpec], repack: bool = True):
        self.kv, self.cache, self.evict = kv, cache, evict
        self.sequence = cache[0].sequence
        self.repacker = Repacker(enabled=repack, stream=kv.repack_stream()) if evict is not None else None
        self.controller: Optional[EvictionController] = None
        self._tap: Optional[QueryTap] = None
        if evict is not None:
            self._tap = QueryTap(kv.model)
            self.controller = EvictionController(self.sequence, make_policy(evict.policy), evict.ratio,
                                                 AttentionObserver(self._tap.scales, cache), self.repacker)
        self.blocks: List[int] = []  # the request's blocks after each decode step
        self.peak_blocks = 0

    def __enter__(self) -> "KVRequest":
        if self._tap is not None:
            self._tap.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._tap is not None:
            self._tap.__exit__(*exc)

    def step(self, queries: Optional[QueryRows] = None) -> None:
        """After a forward (each token the decode loop delivers): evict and repack when due, record the blocks.
        queries: this request's rotated queries of that forward (QueryTap.rows of a batched forward); None:
        those of its own tap, installed while the KVRequest is open.

        Raises:
            MlxInferError: evicting with neither queries nor an open KVRequest.
        """
        table = self.sequence.table
        self.peak_blocks = max(self.peak_blocks, len(table.blocks))
        if self.controller is not None:
            if queries is None:
                if not self._tap.taps:
                    raise MlxInferError("KVRequest.step needs the forward's queries, or the KVRequest open (with ...)")
                queries = self._tap.rows()
            self.controller.step(queries)
            if self.kv.pool.free_blocks == 0:  # the next token may need a block: pack now (its reservation fits)
                self.compact()
        self.blocks.append(len(table.blocks))

    @property
    def reclaimable(self) -> int:
        """Blocks a repack could free now (vToken only; 0 for Naive-Evict): the request's blocks beyond
        ceil(live / block_size)."""
        if self.repacker is None or not self.repacker.enabled:
            return 0
        table = self.sequence.table
        return max(0, len(table.blocks) - math.ceil(table.n_live / table.block_size))

    def compact(self) -> int:
        """Repack now, whatever the trigger (vToken only; the pool needs the room): the live tokens of the
        request's unshared blocks end in ceil(live / block_size) blocks. Returns the blocks freed."""
        if self.repacker is None or not self.repacker.enabled:
            return 0
        plan = self.repacker.maybe_repack(self.sequence, force=True)
        return plan.saved if plan is not None else 0

    @property
    def evicted(self) -> int:
        """Tokens evicted so far (then the cache no longer equals a fresh prefill of its tokens)."""
        return self.controller.record.evicted if self.controller is not None else 0

    def stats(self) -> dict:
        """GenerationStats.kv: retained_blocks (time average over the decode steps), retained_blocks_end,
        retained_blocks_max (the most over the decode steps, after each step's eviction), live_tokens, waste (1 - mean live fraction of the blocks, at the end), repacks, repack_s (host seconds
        planning and enqueueing), peak_kv_bytes (the request's most blocks x bytes per block, all layers, K and
        V, prefill included), block_size, evict ("POLICY:RATIO" or None), repack, evicted_tokens."""
        table = self.sequence.table
        bb = self.kv.pool.block_bytes
        peak = max(self.peak_blocks, len(table.blocks))
        return {
            "retained_blocks": round(sum(self.blocks) / len(self.blocks), 3) if self.blocks else float(len(table.blocks)),
            "retained_blocks_end": len(table.blocks),
            "retained_blocks_max": max(self.blocks, default=len(table.blocks)),
            "live_tokens": table.n_live,
            "waste": round(table.waste(), 4),
            "repacks": self.repacker.repacks if self.repacker is not None else 0,
            "repack_s": round(self.repacker.repack_s, 6) if self.repacker is not None else 0.0,
            "peak_kv_bytes": peak * bb,
            "block_size": self.kv.block_size,
            "evict": str(self.evict) if self.evict is not None else None,
            "repack": self.repacker.enabled if self.repacker is not None else None,
            "evicted_tokens": self.evicted,
        }
