"""Scissorhands (arXiv 2305.17118): persistence of importance. Over a history window of observations, count
how often each token received low attention (below `low` times the uniform share); evict the tokens with the
most low counts (ties: the least attention received over the window, then the oldest), the `recent` newest
always protected."""

from collections import deque

import numpy as np

from ..defaults import SCISSORHANDS_HISTORY, SCISSORHANDS_LOW, SCISSORHANDS_RECENT
from ..table import TokenTable
from .base import AttentionStats


class Scissorhands:
    """Args: history: observations remembered; recent: newest live tokens never evicted; low: the threshold
    as a multiple of 1 / (keys scored)."""

    name, once = "scissorhands", False

    def __init__(self, history: int = SCISSORHANDS_HISTORY, recent: int = SCISSORHANDS_RECENT,
                 low: float = SCISSORHANDS_LOW):
        self.recent, self.low = recent, low
        self.window = deque(maxlen=history)  # (tokens [S], attention received [S]) per observation

    def observe(self, stats: AttentionStats) -> None:
        self.window.append((stats.tokens, stats.received()))

    def choose(self, table: TokenTable, n: int) -> np.ndarray:
        live = table.live_tokens()
        candidates = live[: max(0, live.size - self.recent)]
        counts = np.zeros(table.length, np.int64)  # low-attention counts in the history window
        mass = np.zeros(table.length)  # attention received in the history window
        for tokens, received in self.window:  # tokens: unique ids, so += adds once per token (np.add.at: 10x slower)
            seen = tokens < table.length
            counts[tokens[seen]] += received[seen] < self.low / tokens.size
            mass[tokens[seen]] += received[seen]
        order = np.lexsort((candidates, mass[candidates], -counts[candidates]))
        return np.sort(candidates[order[:n]])
