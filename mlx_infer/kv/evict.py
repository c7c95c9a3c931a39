"""The eviction loop of one request: observe attention, evict down to the ratio, repack when due, and record
the retained blocks (vToken's metric, arXiv 2608.13263).

After each forward, `step()`: the observer keeps the forward's queries; every `period` forwards the policy
gets the attention statistics; the policy evicts live tokens until at most ceil((1 - ratio) * length) are
live (one-shot policies only after the prefill); the repacker packs the request when due. Eviction ratio
= fraction of the tokens evicted. With `Repacker(enabled=False)` this is Naive-Evict (the same decisions,
blocks freed only when empty).
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import MlxInferError
from .observe import AttentionObserver, QueryRows
from .policies.base import EvictionPolicy
from .repack import Repacker
from .sequence import PagedSequence


@dataclass
class EvictionRecord:
    """Per forward after eviction: the request's blocks, live tokens and waste."""

    blocks: List[int] = field(default_factory=list)
    live: List[int] = field(default_factory=list)
    waste: List[float] = field(default_factory=list)
    evicted: int = 0

    def mean_blocks(self) -> float:
        """Retained blocks, time average over the recorded forwards."""
        return sum(self.blocks) / len(self.blocks) if self.blocks else 0.0


class EvictionController:
    """Drives `policy` over one request.

    Args:
        sequence: the request (PagedSequence shared by its caches).
        policy: an EvictionPolicy.
        ratio: fraction of tokens evicted, 0 <= ratio < 1.
        observer: an AttentionObserver of the same request (None: the policy gets no statistics).
        repacker: a Repacker (None: Naive-Evict).
        keep_min: never evict below this many live tokens.

    Raises:
        MlxInferError: a ratio outside [0, 1).
    """

    def __init__(self, sequence: PagedSequence, policy: EvictionPolicy, ratio: float,
                 observer: Optional[AttentionObserver] = None, repacker: Optional[Repacker] = None,
                 keep_min: int = 1):
        if not 0.0 <= ratio < 1.0:
            raise MlxInferError(f"the eviction ratio is the fraction of tokens evicted, in [0, 1) (got {ratio})")
        self.sequence, self.policy, self.ratio = sequence, policy, ratio
        self.observer, self.repacker = observer, repacker
        self.keep_min = keep_min
        self.record = EvictionRecord()
        self.prefilled = False

    def target(self) -> int:
        """Most live tokens allowed now."""
        return max(self.keep_min, math.ceil((1.0 - self.ratio) * self.sequence.table.length))

    def step(self, queries: Optional[QueryRows] = None) -> None:
        """After a forward (the first call: after the prefill). queries: that forward's rotated queries of
        this request (QueryTap.rows; AttentionObserver.record); needed with an observer.

        Raises:
            MlxInferError: an observer but no queries.
        """
        first, self.prefilled = not self.prefilled, True
        if self.observer is not None:
            if queries is None:
                raise MlxInferError("the eviction controller's observer needs the forward's queries")
            self.observer.record(queries)
            if first or self.observer.due():
                self.policy.observe(self.observer.stats())
        table = self.sequence.table
        excess = table.n_live - self.target()
        if excess > 0 and (first or not self.policy.once):
            before = table.n_live
            self.sequence.evict(self.policy.choose(table, excess))
            self.record.evicted += before - table.n_live
        if self.repacker is not None:
            self.repacker.maybe_repack(self.sequence)
        self.record.blocks.append(len(table.blocks))
        self.record.live.append(table.n_live)
        self.record.waste.append(table.waste())
