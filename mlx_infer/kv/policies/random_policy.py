"""Random eviction (vToken's control policy, arXiv 2608.13263): n live tokens uniformly at random."""

import numpy as np

from ..table import TokenTable
from .base import AttentionStats


class RandomPolicy:
    """Args: seed: of the generator (decisions repeat across runs, e.g. Naive-Evict vs repacking)."""

    name, once = "random", False

    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)

    def observe(self, stats: AttentionStats) -> None:
        return None

    def choose(self, table: TokenTable, n: int) -> np.ndarray:
        return np.sort(self.rng.choice(table.live_tokens(), size=n, replace=False))
