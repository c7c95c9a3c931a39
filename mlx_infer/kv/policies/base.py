"""The eviction-policy interface: a policy observes attention statistics and chooses live tokens to evict."""

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..table import TokenTable


@dataclass(frozen=True)
class AttentionStats:
    """Attention the live keys received from a window of observed queries.

    tokens: int64 [S], the logical ids (== original positions) of the keys scored, ascending.
    attention: float32 [H, S], per (layer, query head) row: the softmax probabilities each key received,
        summed over the observed queries (each query's row sums to 1 over the keys it may see).
    n_queries: queries observed (>= 1).
    """

    tokens: np.ndarray
    attention: np.ndarray
    n_queries: int

    def received(self) -> np.ndarray:
        """Mean attention each key received per query and head: float64 [S] (sums to 1 when all are visible)."""
        return self.attention.sum(0, dtype=np.float64) / (self.attention.shape[0] * self.n_queries)


class EvictionPolicy(Protocol):
    """What the eviction controller asks of a policy.

    `name`: the policy's CLI name. `once`: True for one-shot policies (SnapKV: evict only after prefill).
    `observe(stats)`: attention statistics of the latest observation window (policies that ignore them
    return at once). `choose(table, n)`: n distinct live logical tokens of `table` to evict, int64 [n].
    """

    name: str
    once: bool

    def observe(self, stats: AttentionStats) -> None: ...

    def choose(self, table: TokenTable, n: int) -> np.ndarray: ...


def lowest(tokens: np.ndarray, score: np.ndarray, n: int) -> np.ndarray:
    """The n tokens of lowest score (ties: the oldest first), ascending ids: int64 [n]."""
    order = np.lexsort((tokens, score))
    return np.sort(tokens[order[:n]])


def grow(scores: np.ndarray, size: int) -> np.ndarray:
    """`scores` zero-extended to at least `size` entries (per-token accumulators indexed by logical id)."""
    if scores.size >= size:
        return scores
    return np.concatenate([scores, np.zeros(max(size, 2 * scores.size) - scores.size, scores.dtype)])
