"""StreamingLLM (arXiv 2309.17453): keep the first `sinks` tokens (attention sinks) and a recent window:
evict the oldest live tokens after the sinks. Needs no attention statistics."""

import numpy as np

from ..defaults import STREAMING_SINKS
from ..table import TokenTable
from .base import AttentionStats


class StreamingLLM:
    """Args: sinks: the first tokens never evicted (4 in the paper)."""

    name, once = "streaming", False

    def __init__(self, sinks: int = STREAMING_SINKS):
        self.sinks = sinks

    def observe(self, stats: AttentionStats) -> None:
        return None

    def choose(self, table: TokenTable, n: int) -> np.ndarray:
        live = table.live_tokens()
        return live[self.sinks : self.sinks + n].copy()
