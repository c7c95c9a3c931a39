"""A rank's KV cache kept from one request to the next (a sharded chat's turns): the next prompt that starts
with the same token ids prefills only the rest.

    kept = KeptCache()                                   # one per rank, for the whole chat
    reuse = kept.reusable(ids)                           # rank 0 decides; every rank gets it broadcast
    cache = kept.take(model, reuse)                      # every rank: its own cache, trimmed to `reuse`
    kept.keep(cache, held)                               # held: the ids the cache holds (extended as it runs)

Every rank keeps the same ids (the ranks run the same forwards), so rank 0's decision holds on each; a cache
that cannot be trimmed (mlx-lm's rotating window) is reused only when the prompt extends it whole.
"""

from typing import List, Optional, Sequence

import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

__all__ = ["KeptCache"]


class KeptCache:
    """A rank's mlx-lm KV cache of its shard and the token ids it holds (none at first)."""

    def __init__(self):
        self.cache: Optional[list] = None
        self.ids: List[int] = []

    def reusable(self, ids: Sequence[int]) -> int:
        """Rank 0: how many leading tokens of `ids` (a prompt) the kept cache gives: their common prefix, at
        most len(ids) - 1 (the last prompt token's forward gives the first logits); 0 when that would need a
        cache trimmed that cannot be."""
        if self.cache is None:
            return 0
        n = 0
        for a, b in zip(self.ids, ids):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)
        if n < len(self.ids) and not can_trim_prompt_cache(self.cache):
            return 0
        return n

    def take(self, model: nn.Module, reuse: int) -> list:
        """The cache of a request that reuses `reuse` tokens (rank 0's `reusable`, broadcast): the kept one
        trimmed to them, or a fresh one (reuse 0). Forgets it until `keep`."""
        cache, held = self.cache, len(self.ids)
        self.clear()
        if not reuse or cache is None:
            return make_prompt_cache(model)
        if held > reuse:
            trim_prompt_cache(cache, held - reuse)
        return cache

    def keep(self, cache: list, ids: List[int]) -> None:
        """Keep `cache`, which holds `ids` (the list itself: the caller extends it after each forward)."""
        self.cache, self.ids = cache, ids

    def clear(self) -> None:
        """Forget the kept cache (a /reset, or a request that failed midway)."""
        self.cache, self.ids = None, []
