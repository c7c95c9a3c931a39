"""The token-virtualized paged KV cache (vToken, arXiv 2608.13263): a block pool per model, a token table per
request, per-layer caches that satisfy mlx-lm's cache protocol, eviction policies and a repacker.

    pool = make_pool(model, budget_bytes=512 << 20)
    cache = make_paged_cache(model, pool)          # use as mlx-lm's prompt_cache
    logits = model(tokens[None], cache=cache)
    ...
    cache[0].sequence.release()                    # the request ended: its blocks go back to the pool

Eviction (policies/, evict.EvictionController) needs attention statistics: observe.QueryTap and
observe.AttentionObserver collect them from the queries the model computes anyway. repack.Repacker packs a
request's live tokens into fewer blocks (Repacker(enabled=False): the Naive-Evict baseline).
"""

from .cache import PagedKVCache, make_paged_cache, make_pool
from .errors import KVBudgetError
from .evict import EvictionController
from .observe import AttentionObserver, QueryTap
from .pool import BlockPool
from .repack import Repacker, plan_repack
from .sequence import PagedSequence
from .table import TokenTable

__all__ = ["AttentionObserver", "BlockPool", "EvictionController", "KVBudgetError", "PagedKVCache",
           "PagedSequence", "QueryTap", "Repacker", "TokenTable", "make_paged_cache", "make_pool", "plan_repack"]
