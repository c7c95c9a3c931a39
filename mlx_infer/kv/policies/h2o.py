"""H2O (arXiv 2306.14048): keep the heavy hitters (highest accumulated attention) and a recent window;
evict the lowest accumulated scores among the rest, greedily."""

import numpy as np

from ..defaults import H2O_RECENT_FRACTION
from ..table import TokenTable
from .base import AttentionStats, grow, lowest


class H2O:
    """Args: recent_fraction: share of the tokens kept (live - n) that is the recent window (never evicted)."""

    name, once = "h2o", False

    def __init__(self, recent_fraction: float = H2O_RECENT_FRACTION):
        self.recent_fraction = recent_fraction
        self.score = np.zeros(0, np.float64)  # accumulated attention, by logical id

    def observe(self, stats: AttentionStats) -> None:
        if stats.tokens.size == 0:
            return
        self.score = grow(self.score, int(stats.tokens[-1]) + 1)
        self.score[stats.tokens] += stats.attention.sum(0, dtype=np.float64) / stats.attention.shape[0]

    def choose(self, table: TokenTable, n: int) -> np.ndarray:
        live = table.live_tokens()
        recent = int(self.recent_fraction * (live.size - n))
        candidates = live[: live.size - recent]
        self.score = grow(self.score, table.length)
        return lowest(candidates, self.score[candidates], n)
