"""What the speculative loop reports once per round, beside the algorithm: its times, its counters, the policy.

The loop (loop.py) reads as the algorithm (draft, verify, commit); this module keeps what it measures and who
learns from it out of the way: `RoundClock` takes a round's times at three points (its start, the end of its
drafting, its read-back), `RoundReport` says what the round did, and `learn` hands both to the request's
`SpecStats` and its `DraftPolicy` (schedule.py), which adjusts gamma from them.
"""

import time
from dataclasses import dataclass, field
from typing import List, Optional

from .schedule import DraftPolicy


@dataclass
class SpecStats:
    """Counters of one speculative request (mutated by the loop while it runs).

    Attributes:
        mode: the drafter used ("lookup", "draft", ...).
        rounds: target forwards (one per round).
        committed: tokens committed by the rounds and delivered (a round's tokens past the point where the
            consumer stopped, e.g. after EOS inside an accepted block, are not counted).
        draft_s: seconds spent proposing (including the draft model's forwards).
        verify_s: seconds spent in the target forward + accept/reject (including the host sync).
        proposed: proposed[i] = rounds that proposed a draft token at position i (0-based).
        accepted: accepted[i] = rounds whose draft token at position i was accepted.
    """

    mode: str = ""
    rounds: int = 0
    committed: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    proposed: List[int] = field(default_factory=list)
    accepted: List[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Committed tokens per target forward."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> List[float]:
        """Per-position acceptance rates: accepted[i] / proposed[i]."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def record(self, n_proposed: int, n_accepted: int, n_committed: int) -> None:
        """Count one round that proposed n_proposed draft tokens, accepted n_accepted, committed n_committed."""
        self.rounds += 1
        self.committed += n_committed
        while len(self.proposed) < n_proposed:
            self.proposed.append(0)
            self.accepted.append(0)
        for i in range(n_proposed):
            self.proposed[i] += 1
            self.accepted[i] += i < n_accepted

    def undeliver(self, n: int) -> None:
        """Take back n committed tokens the consumer never received (it stopped, or max_tokens came first):
        tau counts delivered tokens only."""
        self.committed -= n


class RoundClock:
    """A round's times in seconds (time.perf_counter): `start` at its beginning, `drafted` when its draft is
    ready (a round that drafts nothing skips it: drafting took 0 s), `synced` at its read-back.

    A round's wall time runs from the previous read-back to this one (the consumer's time between tokens,
    the drafting, the verify and a launched-ahead round's wait included): what the policy compares
    speculation and plain decoding by. The first round counts from the clock's creation (the prefill's end).
    """

    def __init__(self) -> None:
        self.last_sync = time.perf_counter()
        self.t0 = self.t1 = self.t2 = self.last_sync
        self.round_s = 0.0

    def start(self) -> None:
        """A round begins (before drafting)."""
        self.t0 = self.t1 = time.perf_counter()

    def drafted(self) -> None:
        """The round's draft is ready; its verify begins."""
        self.t1 = time.perf_counter()

    def synced(self) -> None:
        """The round's result was read back to the host."""
        self.t2 = time.perf_counter()
        self.round_s, self.last_sync = self.t2 - self.last_sync, self.t2

    @property
    def draft_s(self) -> float:
        """Seconds of the round's drafting."""
        return self.t1 - self.t0

    @property
    def verify_s(self) -> float:
        """Seconds from the draft to the read-back: the target forward, accept / reject and the host sync."""
        return self.t2 - self.t1


@dataclass(frozen=True)
class RoundReport:
    """What one round did, as the policy and the stats learn it.

    Attributes:
        verified: draft tokens the target verified (g; 0: a plain round).
        accepted: of them, the accepted ones (n <= g); the round commits n + 1 tokens.
        outside: whether the draft went on with a token outside the target's vocabulary, rejected without a
            forward (counted as proposed in the stats, not in the policy's verify width).
        key: the draft's bucket (Draft.key), None without one.
        ahead: the round was launched before the previous one was read back (it drafted nothing).
        offered: the drafter is free, so the policy counts the bucket this round's context offered.
        offer_key: that bucket (Drafter.offer_key; None: no proposal was on offer).
        forced: tokens the grammar forced that the round committed besides the accepted drafts and its own
            token (constrained decoding; not the drafter's, so neither verified nor accepted above).
    """

    verified: int
    accepted: int
    outside: bool = False
    key: Optional[int] = None
    ahead: bool = False
    offered: bool = False
    offer_key: Optional[int] = None
    forced: int = 0


def learn(stats: SpecStats, policy: DraftPolicy, report: RoundReport, clock: RoundClock) -> None:
    """Hand a read-back round's report and times to the stats and the policy (once per round, in this order:
    the policy's offer counts, the stats, the policy's estimates)."""
    if report.offered:
        policy.offered(report.offer_key)
    stats.record(report.verified + report.outside, report.accepted, report.accepted + report.forced + 1)
    stats.draft_s += clock.draft_s
    stats.verify_s += clock.verify_s
    policy.observe(report.verified, report.accepted, clock.draft_s, clock.verify_s, key=report.key,
                   ahead=report.ahead, round_s=clock.round_s)
