"""vToken's repacker (arXiv 2608.13263): move a request's live tokens out of sparse blocks into fewer dense
ones, so the blocks eviction emptied only partly go back to the pool.

Trigger: the request's waste (1 - mean live fraction of its blocks) above `waste_threshold` and the pool's
free blocks at or below the low watermark (an unbounded pool: the waste alone). Plan: the sparse blocks
(not full of live tokens, held by this request only: blocks shared by several requests are never moved) and
their live tokens in logical order, packed into ceil(live / block_size) destination blocks; a plan is
committed only when it strictly reduces the blocks. Destinations are the lowest ids among the free blocks
and the sources (so the used blocks stay at the front of the pool and it can shrink). Copy: one row move per
layer and K/V plane (kernels.move_rows: in place on the CPU kernel) on a separate MLX stream; the reads see
the pool before the move, so destinations may be sources. The table is updated at once after the copy is built; the next forward
gathers from the arrays the copy produced, so MLX computes the copy first (the move is visible before the
next attention; across streams MLX waits on the copy's event). The copy is not evaluated on its own: an
`mx.async_eval` of it waited, on the CPU backend, for the forward still in flight (host time a decode step
then pays). A repack moves at most REPACK_MAX_MOVES
tokens, the sparsest blocks first; the rest waits for the next step: once triggered, repacking goes on step
after step until no plan saves a block (the whole plan, spread over steps), and only then waits for the
trigger again. (Stopping as soon as the waste fell under the threshold left a long H2O request holding
clearly more blocks than one packing gives.)
"""

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .defaults import REPACK_LOW_WATERMARK, REPACK_MAX_MOVES, REPACK_WASTE
from .pool import BlockPool
from .sequence import PagedSequence
from .table import TokenTable


@dataclass(frozen=True)
class RepackPlan:
    """Moves of live tokens: tokens int64 [M] (logical ids, ascending) from src slots [M] to dst slots [M];
    sources: the sparse blocks emptied (or refilled), destinations: the blocks packed, in logical order."""

    tokens: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    sources: Tuple[int, ...]
    destinations: Tuple[int, ...]

    @property
    def saved(self) -> int:
        """Blocks the plan returns to the pool (> 0 for a committed plan)."""
        return len(self.sources) - len(self.destinations)


def plan_repack(table: TokenTable, pool: BlockPool, max_moves: Optional[int] = None) -> Optional[RepackPlan]:
    """The plan packing `table`'s sparse, unshared blocks into ceil(live / block_size) blocks in logical
    order, or None when that would not strictly reduce the blocks (or free ids are missing for it).
    max_moves: move at most about this many tokens, from the sparsest blocks first (the most blocks freed
    per token copied; the rest waits for the next plan); None: every sparse block."""
    bs = table.block_size
    sources = [b for b in table.blocks if table.live_count[b] < bs and not pool.shared(b)]
    if max_moves is not None:
        chosen, moved = [], 0
        for b in sorted(sources, key=lambda b: table.live_count[b]):
            if moved + table.live_count[b] > max_moves and len(chosen) > math.ceil(moved / bs):
                break
            chosen.append(b)
            moved += table.live_count[b]
        sources = chosen
    live = table.live_tokens()
    blocks_of = table.slots(live) // bs
    tokens = live[np.isin(blocks_of, sources)]
    need = math.ceil(tokens.size / bs)
    if need >= len(sources):
        return None
    dest = sorted(set(pool.lowest_free(need)) | set(sources))[:need]
    dst = np.repeat(np.asarray(dest, np.int64), bs)[: tokens.size] * bs + np.tile(np.arange(bs), need)[: tokens.size]
    return RepackPlan(tokens, table.slots(tokens), dst, tuple(sources), tuple(dest))


def commit(sequence: PagedSequence, plan: RepackPlan, stream: Optional[mx.Stream] = None) -> List[mx.array]:
    """Apply `plan` to the request: claim its free destinations, enqueue the copy (on `stream`), update the
    token table atomically, release the emptied sources. Returns the pool arrays the copy produces (the
    caller may mx.async_eval them to start the copy now; the next forward waits on them in any case)."""
    pool, table = sequence.pool, sequence.table
    fresh = [b for b in plan.destinations if b not in set(plan.sources)]
    pool.claim(fresh)
    arrays = pool.move(plan.src, plan.dst, stream)
    table.apply_moves(plan.tokens, plan.dst, plan.sources, plan.destinations)
    return arrays


@dataclass
class Repacker:
    """When to repack, and the record of what it did (vToken's policy; `enabled=False` is Naive-Evict:
    the same eviction decisions, blocks freed only when empty).

    Args:
        waste_threshold: repack a request whose waste exceeds this (0.25).
        low_watermark: ... when the pool's free blocks are at or below this fraction of its budget (0.10);
            None: whatever the free blocks.
        enabled: False: never repack (the Naive-Evict baseline).
        max_moves: tokens one repack may copy (REPACK_MAX_MOVES), so that the copy of a long request's first
            repack (half its tokens after the prefill's eviction) is spread over several decode steps; None:
            no limit.
    """

    waste_threshold: float = REPACK_WASTE
    low_watermark: Optional[float] = REPACK_LOW_WATERMARK
    enabled: bool = True
    max_moves: Optional[int] = REPACK_MAX_MOVES
    repacks: int = 0
    blocks_saved: int = 0
    repack_s: float = 0.0  # host time planning and enqueueing (seconds)
    packing: bool = False  # a triggered repack goes on over the next steps until no plan saves a block
    stream: mx.Stream = field(default_factory=lambda: mx.new_stream(mx.default_device()))

    def due(self, sequence: PagedSequence) -> bool:
        """Whether `sequence` should be repacked now (waste and free-block trigger)."""
        if not self.enabled or not sequence.ready() or sequence.table.waste() <= self.waste_threshold:
            return False
        pool = sequence.pool
        if self.low_watermark is None or pool.max_blocks is None:
            return True
        return pool.free_blocks <= self.low_watermark * pool.max_blocks

    def maybe_repack(self, sequence: PagedSequence, force: bool = False) -> Optional[RepackPlan]:
        """Repack `sequence` when due or while a triggered repack goes on, at most `max_moves` tokens (or
        `force`d and enabled: every sparse block, at once); returns the committed plan or None (which ends
        the repack until the next trigger)."""
        if not self.enabled or not sequence.ready() or not (force or self.packing or self.due(sequence)):
            return None
        t0 = time.perf_counter()
        plan = plan_repack(sequence.table, sequence.pool, None if force else self.max_moves)
        self.packing = plan is not None and not force
        if plan is not None:
            commit(sequence, plan, self.stream)  # evaluated with the next forward, which reads the moved rows
            self.repacks += 1
            self.blocks_saved += plan.saved
        self.repack_s += time.perf_counter() - t0
        return plan
