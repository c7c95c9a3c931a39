"""SnapKV (arXiv 2404.14469): once, after prefill, the last `window` prompt queries vote: per head, their
attention summed over the window and smoothed by a 1-D average pool (kernel 5) ranks the prefix; each head
keeps its top (kept - window) tokens, the window itself is kept (so a prompt no longer than the window
loses nothing, and a ratio that asks for more than the prefix evicts the whole prefix). With one token table
for all heads, a token survives by the number of heads that keep it (ties: its pooled score summed over
heads)."""

import numpy as np

from ..defaults import SNAPKV_KERNEL, SNAPKV_WINDOW
from ..table import TokenTable
from .base import AttentionStats


class SnapKV:
    """Args: window: observation window (last prompt tokens, always kept); kernel: pooling kernel (odd)."""

    name, once = "snapkv", True

    def __init__(self, window: int = SNAPKV_WINDOW, kernel: int = SNAPKV_KERNEL):
        self.window, self.kernel = window, kernel
        self.stats = None

    def observe(self, stats: AttentionStats) -> None:
        self.stats = stats

    def choose(self, table: TokenTable, n: int) -> np.ndarray:
        live = table.live_tokens()
        prefix = live[: max(0, live.size - self.window)]
        if prefix.size == 0 or n <= 0:  # a prompt no longer than the window: nothing outside it to evict
            return prefix[:0]
        keep = max(0, prefix.size - n)
        seen = self.stats is not None
        a = self.stats.attention[:, np.isin(self.stats.tokens, prefix)] if seen else np.zeros((1, prefix.size))
        pad = self.kernel // 2
        padded = np.pad(a, ((0, 0), (pad, pad)), mode="edge")
        pooled = np.stack([padded[:, i : i + a.shape[1]] for i in range(self.kernel)]).mean(0)  # [H, P]
        votes = np.zeros(prefix.size)
        if keep:
            top = np.argsort(-pooled, axis=1, kind="stable")[:, :keep]  # per head
            np.add.at(votes, top.reshape(-1), 1.0)
        order = np.lexsort((pooled.sum(0), votes))  # fewest votes first, then the lowest pooled score
        return np.sort(prefix[order[:n]])
