"""Draft length (gamma) per round: the policies the speculative loop asks.

`DraftPolicy` is what the loop (loop.py) needs from a policy; `FixedGamma` pins gamma (max_draft=N) and
`DraftScheduler` picks it each round (max_draft="auto"), from the target's cost curve (cost.py) and running
estimates of the conditional acceptance rate of each draft position and of the drafting cost:

    E[committed](g) = 1 + sum_{j=1..g} prod_{i<=j} a_i,     time(g) = verify(g + 1) + drafting(g)

drafting(g) is g * (seconds per draft token) for a draft model, one drafter pass for a block drafter
(DFlash drafts its whole block in one forward, whatever g), and 0 for prompt lookup. gamma = 0 is a plain
decoding step. When even a fully accepted draft cannot beat plain decoding on the curve,
`speculation_pays` is false and the request decodes plainly.

A round that drafts nothing can be launched before the previous one is read back (loop.py), but then it
cannot use a proposal the new token brings. For a free drafter `plain_next` launches it unless the buckets
the next round could draft from are expected to save more than launching ahead does (curve(1) less the
pipelined step): each bucket's `saving` at its best gamma, weighted by how often it offers a proposal at all
(`offered`, counted every round).

The estimates start from a `Prior`: a weak 0.5 by default, or a calibration for model drafters
(calibrate.py). Only decisions live here: no timing, no disk, no MLX.

Over all of that, DraftScheduler checks what speculation really delivers: the tokens committed per wall
second of its last ARM_WINDOW rounds (each round's time from one read-back to the next, as the loop measures
it: drafting, verifying, the host work and the plain rounds it could not launch ahead included), against plain
decoding's (measured the same way while it decodes plainly; before that, the cost curve's pipelined step).
When speculation is the slower (below ARM_MARGIN of it), the request decodes plainly for ARM_BACKOFF rounds
(doubled each time in a row, up to ARM_BACKOFF_MAX), launched ahead as generate_step does, then speculates
again; during those rounds only a free drafter's bucket that has proved itself (`_strong`: a long lookup
match in a copy) still drafts.
"""

from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional, Protocol, Sequence, Tuple

from ..defaults import DEFAULT_MAX_DRAFT
from .cost import CostCurve

#: Prior of each position's conditional acceptance: ACCEPT_PRIOR_HITS accepted out of ACCEPT_PRIOR_TRIALS
#: pseudo-observations (mean 0.5, weak, so that a few real rounds outweigh it).
ACCEPT_PRIOR_HITS = 1.0
ACCEPT_PRIOR_TRIALS = 2.0
#: Forgetting factor of the acceptance counts per observation (recent rounds weigh more).
ACCEPT_DECAY = 0.95
#: Weight of the past in the running drafting-cost estimate (exponential moving average).
COST_DECAY = 0.9
#: Rounds after which a source judged not worth drafting is tried again to refresh the estimates.
PROBE_EVERY = 16
#: Forgetting factor of the count of rounds each bucket of a free drafter offered a proposal in.
OFFER_DECAY = 0.9
#: Speculation must promise this much over plain decoding to be used at all.
MIN_GAIN = 1.05
#: Rounds of speculation (and of plain decoding) whose measured tokens per second are compared.
ARM_WINDOW = 8
#: Speculation counts as the slower below this fraction of plain decoding's measured rate.
ARM_MARGIN = 0.95
#: Plain rounds after speculation measured slower than plain decoding; doubled each time in a row.
ARM_BACKOFF = 8
ARM_BACKOFF_MAX = 256
#: Meanwhile a free drafter's bucket still drafts when its measured acceptance promises this much over a
#: plain step on the curve (a long lookup match in a copy), with at least ARM_STRONG_TRIALS (discounted)
#: verified first tokens behind the estimate.
ARM_STRONG_GAIN = 1.5
ARM_STRONG_TRIALS = 4.0


def expected_committed(rates: List[float], gamma: int) -> float:
    """1 + sum_{j=1..gamma} prod_{i<=j} rates[i-1]: expected tokens committed by a round drafting gamma."""
    total, survive = 1.0, 1.0
    for a in rates[:gamma]:
        survive *= a
        total += survive
    return total


def speculation_pays(curve: CostCurve, max_draft: int) -> bool:
    """Whether any gamma in 1..max_draft, fully accepted, beats plain decoding by MIN_GAIN."""
    plain = 1.0 / curve.plain()
    return any((g + 1) / curve(g + 1) > MIN_GAIN * plain for g in range(1, max_draft + 1))


@dataclass
class Prior:
    """What is known of a drafter before a request: its acceptance and its drafting cost, measured once
    (a teacher-forced calibration, calibrate.py).

    Attributes:
        acceptance: prior conditional acceptance of every draft position, in [0, 1].
        weight: how many observed rounds the prior counts as.
        draft_cost: seconds per draft token (per drafting pass for a block drafter), or None when unknown.
    """

    acceptance: float = ACCEPT_PRIOR_HITS / ACCEPT_PRIOR_TRIALS
    weight: float = ACCEPT_PRIOR_TRIALS
    draft_cost: Optional[float] = None


class DraftPolicy(Protocol):
    """What the speculative loop asks of a draft-length policy, once per round.

    Attributes:
        limit: the largest gamma it will ever ask for (the loop bounds its rollback check with it).
    """

    limit: int

    def gamma(self) -> int:
        """The number of draft tokens to ask the drafter for this round (0: a plain round)."""

    def cut(self, draft) -> int:
        """Of a proposal (`Draft`: .tokens, .key), how many leading tokens to verify."""

    def worth(self, key: Optional[int]) -> bool:
        """Whether a drafter with several sources should propose from bucket `key` this round."""

    def plain_next(self, keys: Optional[Sequence[int]]) -> bool:
        """Whether the next round is to draft nothing, whatever this round commits (keys: the buckets a free
        drafter could propose from next round, None when unknown); the loop then launches it ahead."""

    def observe(self, proposed: int, accepted: int, draft_s: float, verify_s: float, key: Optional[int] = None,
                ahead: bool = False, round_s: Optional[float] = None) -> None:
        """Learn from a finished round (see DraftScheduler.observe)."""

    def offered(self, key: Optional[int]) -> None:
        """A free drafter's proposal this round came from bucket `key` (None: it had none; see
        DraftScheduler.offered)."""


class FixedGamma:
    """A pinned draft length (max_draft=N): ask for N tokens every round and verify all that are proposed.

    Args:
        gamma: draft tokens per round, >= 0 (0: plain decoding through the speculative loop).
    """

    def __init__(self, gamma: int):
        self.limit = int(gamma)

    def gamma(self) -> int:
        return self.limit

    def cut(self, draft) -> int:
        return len(draft.tokens)

    def worth(self, key: Optional[int]) -> bool:
        return True

    def plain_next(self, keys: Optional[Sequence[int]]) -> bool:
        return self.limit == 0

    def observe(self, proposed: int, accepted: int, draft_s: float, verify_s: float, key: Optional[int] = None,
                ahead: bool = False, round_s: Optional[float] = None) -> None:
        """Nothing to learn."""

    def offered(self, key: Optional[int]) -> None:
        """Nothing to learn."""


class DraftScheduler:
    """Chooses gamma each round (`gamma`) and learns from each round (`observe`).

    A drafter that costs something to run (a draft model) gets its gamma before proposing. A free one
    (prompt lookup) is asked for max_draft tokens and `cut` keeps the prefix worth verifying, with
    acceptance estimated separately per confidence bucket the drafter reports (`Draft.key`: lookup's
    matched n-gram length), the idea of DSpark's confidence-scheduled verification. A free drafter with
    a costly source (lookup, then a block drafter: drafters/hybrid.py) asks `worth(key)` before using it;
    the cost of each bucket's proposals is measured per round.

    Decisions are pure functions of what was observed; `observe` (once per round, plain rounds included)
    advances the round count. A source judged not worth drafting is probed again every PROBE_EVERY rounds
    (estimates only move when drafts are verified), and a free drafter's first proposal from a bucket is
    verified at once. `plain_next` says before a round is verified whether the next one will draft
    nothing, which lets the loop launch that plain step early (loop.py). One scheduler serves one request.

    Args:
        curve: the target's CostCurve.
        max_draft: the largest gamma to consider.
        free: the drafter proposes at no cost (see above).
        per_round: drafting costs one pass per round whatever gamma (block drafters), not one per token.
        prior: what is known before the first round (default: acceptance 0.5 of weight 2, cost unknown).
    """

    def __init__(self, curve: CostCurve, max_draft: int = DEFAULT_MAX_DRAFT, free: bool = False,
                 per_round: bool = False, prior: Optional[Prior] = None):
        self.curve = curve
        self.max_draft = self.limit = max_draft
        self.free = free
        self.per_round = per_round
        prior = prior or Prior()
        self.prior_hits, self.prior_trials = prior.acceptance * prior.weight, prior.weight
        # Per bucket, discounted counts per position i: rounds that judged draft token i (its predecessors
        # accepted), and how many of those accepted it.
        self.hits: Dict[Optional[int], List[float]] = {}
        self.trials: Dict[Optional[int], List[float]] = {}
        # seconds per draft token, or per drafting pass when per_round (EMA); None = unknown yet
        self.draft_cost = 0.0 if free else prior.draft_cost
        self.key_costs: Dict[Optional[int], float] = {}  # free mode: seconds per proposal, per bucket (EMA)
        self.round = 0  # rounds observed
        self.last_try: Dict[Optional[int], int] = {}  # round of each bucket's last verified proposal
        # speculation against plain decoding, as measured (see the module docstring)
        self.plain_left = 0  # rounds left to decode plainly (speculation measured the slower)
        self.backoff = ARM_BACKOFF
        self._spec_rounds: Deque[Tuple[int, float]] = deque(maxlen=ARM_WINDOW)  # (committed, seconds)
        self._plain_rounds: Deque[Tuple[int, float]] = deque(maxlen=ARM_WINDOW)
        # free mode: discounted rounds, and of those the rounds whose proposal came from each bucket
        self.offer_rounds = 0.0
        self.offers: Dict[Optional[int], float] = {}

    def rates(self, key: Optional[int] = None) -> List[float]:
        """Estimated conditional acceptance of each draft position (given its predecessors were accepted)
        for proposals in bucket `key`."""
        hits = self.hits.get(key, [0.0] * self.max_draft)
        trials = self.trials.get(key, [0.0] * self.max_draft)
        return [(h + self.prior_hits) / (t + self.prior_trials) for h, t in zip(hits, trials)]

    def verify_cost(self, width: int) -> float:
        """Seconds of a round verifying `width` tokens (width 1: a plain step, pipelined as the loop runs
        plain rounds it can launch ahead)."""
        return self.curve(width) if width > 1 else self.curve.plain()

    def _drafting(self, g: int, key: Optional[int]) -> float:
        """Seconds of drafting a round of gamma g costs (free mode: the bucket's cost per proposal)."""
        if g == 0:
            return 0.0
        if self.free:
            return self.key_costs.get(key, 0.0)
        return self.draft_cost if self.per_round else g * self.draft_cost

    def best_gamma(self, key: Optional[int] = None, limit: Optional[int] = None, sunk: bool = False) -> int:
        """argmax_g E[committed](g) / (verify(g+1) + drafting(g)), over 0..min(limit, max_draft).
        sunk: the proposal is already made (its drafting cost is not counted)."""
        rates = self.rates(key)
        top = self.max_draft if limit is None else min(limit, self.max_draft)

        def rate(g):
            return expected_committed(rates, g) / (self.verify_cost(g + 1) + (0.0 if sunk else self._drafting(g, key)))

        return max(range(top + 1), key=rate)

    def _due(self, key: Optional[int], at: int) -> bool:
        """Whether bucket `key`, not worth drafting, is to be probed at round `at`: every PROBE_EVERY rounds,
        and at once when a free drafter never had a proposal from it verified (that costs little and is how
        the bucket's estimate starts from data rather than the prior)."""
        if self.free and key not in self.last_try:
            return True
        return at - self.last_try.get(key, 0) >= PROBE_EVERY

    def _gamma(self, at: int) -> int:
        """The gamma of round `at` for a drafter that is not free."""
        if self.draft_cost is None:  # drafting cost unknown: try a draft first
            return self.max_draft if self.per_round else min(2, self.max_draft)
        best = self.best_gamma()
        if best > 0:
            return best
        return min(2, self.max_draft) if self._due(None, at) else 0

    def gamma(self) -> int:
        """The gamma to ask the drafter for this round."""
        if self.plain_left and not self.free:
            return 0
        return self.max_draft if self.free else self._gamma(self.round)

    def _strong(self, key: Optional[int]) -> bool:
        """Whether a free drafter's bucket `key` drafts even while the request decodes plainly (see the module
        docstring): its estimate rests on ARM_STRONG_TRIALS verified first tokens and promises
        ARM_STRONG_GAIN over a plain step."""
        trials = self.trials.get(key)
        if not self.free or trials is None or trials[0] < ARM_STRONG_TRIALS:
            return False
        g = self.best_gamma(key, sunk=True)
        gain = expected_committed(self.rates(key), g) / self.verify_cost(g + 1) * self.curve.plain()
        return g > 0 and gain >= ARM_STRONG_GAIN

    def cut(self, draft) -> int:
        """How many of a free drafter's proposed tokens to verify (a draft with .tokens and .key)."""
        if self.plain_left:
            return self.best_gamma(draft.key, len(draft.tokens), sunk=True) if self._strong(draft.key) else 0
        if not self.free:
            return len(draft.tokens)
        best = self.best_gamma(draft.key, len(draft.tokens), sunk=True)
        if best > 0 or not draft.tokens:
            return best
        return min(2, len(draft.tokens)) if self._due(draft.key, self.round) else 0

    def worth(self, key: Optional[int]) -> bool:
        """Free mode: whether proposing from bucket `key` pays for its drafting cost this round, or is due
        for a probe (estimates only move when drafts are verified)."""
        if self.plain_left:
            return self._strong(key)
        return self.best_gamma(key) > 0 or self._due(key, self.round)

    def plain_next(self, keys: Optional[Sequence[int]] = None) -> bool:
        """Whether the round after this one is to draft nothing, whatever token this one commits: certainly
        (a plain stint, or a drafter that is not worth it), or for a free drafter because no bucket it could
        draft from is expected to save more than launching that round ahead does (see the module docstring).

        Args:
            keys: free mode: the buckets the drafter could propose from next round (None: unknown, so
                no certainty); ignored otherwise.
        """
        at = self.round + 1
        if self.plain_left > 1:  # the next round decodes plainly too, unless a proved bucket can draft
            return not self.free or (keys is not None and not any(self._strong(k) for k in keys))
        if self.plain_left:
            return False
        if not self.free:
            return self._gamma(at) == 0
        if keys is None:
            return False
        if any(self._due(k, at) for k in keys):
            return False
        lost = self.curve(1) - self.curve.plain()  # what a plain step not launched ahead costs more
        return sum(self.offer_rate(k) * max(self.saving(k), 0.0) for k in keys) <= lost

    def offered(self, key: Optional[int]) -> None:
        """Count a round's proposal as coming from bucket `key` (None: the drafter had none), in every round of
        a free drafter (one launched ahead too): how often each bucket offers a draft (offer_rate)."""
        self.offer_rounds = OFFER_DECAY * self.offer_rounds + 1.0
        for k in self.offers:
            self.offers[k] *= OFFER_DECAY
        if key is not None:
            self.offers[key] = self.offers.get(key, 0.0) + 1.0

    def offer_rate(self, key: Optional[int]) -> float:
        """The fraction of recent rounds whose proposal came from bucket `key` (1 before any round: unknown)."""
        return self.offers.get(key, 0.0) / self.offer_rounds if self.offer_rounds else 1.0

    def saving(self, key: Optional[int]) -> float:
        """Seconds a round drafting from bucket `key` (at its best gamma, its drafting cost included) is
        expected to save against plain decoding of the tokens it commits; <= 0 when no draft length pays."""
        rates, plain = self.rates(key), self.curve.plain()
        return max(expected_committed(rates, g) * plain - self.verify_cost(g + 1) - self._drafting(g, key)
                   for g in range(self.max_draft + 1))

    def observe(self, proposed: int, accepted: int, draft_s: float, verify_s: float, key: Optional[int] = None,
                ahead: bool = False, round_s: Optional[float] = None) -> None:
        """Update the estimates after a round that verified `proposed` draft tokens of bucket `key` and kept
        `accepted` (proposed 0: a plain round).

        Args:
            draft_s, verify_s: seconds of its drafting and of its verify (forward to read-back).
            ahead, round_s: whether the round was launched before the previous one was read back, and the
                wall seconds since that read-back: what speculation and plain decoding are compared by
                (`_compare`; None: the round is not counted).
        """
        self._compare(proposed, accepted + 1, round_s)
        self.round += 1
        if not proposed:
            return
        hits = self.hits.setdefault(key, [0.0] * self.max_draft)
        trials = self.trials.setdefault(key, [0.0] * self.max_draft)
        for i in range(min(proposed, accepted + 1, self.max_draft)):
            trials[i] = ACCEPT_DECAY * trials[i] + 1.0
            hits[i] = ACCEPT_DECAY * hits[i] + (1.0 if i < accepted else 0.0)
        if self.free:
            old = self.key_costs.get(key)
            self.key_costs[key] = draft_s if old is None else COST_DECAY * old + (1 - COST_DECAY) * draft_s
        else:
            sample = draft_s if self.per_round else draft_s / proposed
            self.draft_cost = (
                sample if self.draft_cost is None else COST_DECAY * self.draft_cost + (1 - COST_DECAY) * sample
            )
        self.last_try[key] = self.round

    def _compare(self, proposed: int, committed: int, round_s: Optional[float]) -> None:
        """Count a round in the measured rate of speculation or of plain decoding, and switch between them
        (see the module docstring). The first round is not counted (its time includes the prefill's end),
        nor a round of a plain stint that drafted (a proved bucket)."""
        if self.plain_left:
            if round_s is not None and self.round and not proposed:
                self._plain_rounds.append((committed, round_s))
            self.plain_left -= 1
            if not self.plain_left:
                self._spec_rounds.clear()  # speculation is measured afresh
            return
        if round_s is None or not self.round:
            return
        self._spec_rounds.append((committed, round_s))
        if len(self._spec_rounds) < ARM_WINDOW:
            return
        if _rate(self._spec_rounds) < ARM_MARGIN * self._plain_rate():
            self.plain_left, self.backoff = self.backoff, min(2 * self.backoff, ARM_BACKOFF_MAX)
        else:
            self.backoff = ARM_BACKOFF

    def _plain_rate(self) -> float:
        """Tokens per second of plain decoding: measured on this request's plain rounds, else the curve's."""
        if len(self._plain_rounds) >= ARM_WINDOW // 2:
            return _rate(self._plain_rounds)
        return 1.0 / self.curve.plain()


def _rate(rounds: Sequence[Tuple[int, float]]) -> float:
    """Committed tokens per second over (committed, seconds) rounds."""
    return sum(c for c, _ in rounds) / max(sum(t for _, t in rounds), 1e-9)


def drafter_pays(curve: CostCurve, prior: Prior, max_draft: int, per_round: bool) -> bool:
    """Whether a drafter known only by its prior (acceptance, drafting cost) is worth drafting with at all:
    some draft length up to max_draft beats a plain step on the curve. `auto` leaves out a registered block
    drafter for which this is false."""
    return DraftScheduler(curve, max_draft, per_round=per_round, prior=prior).best_gamma() > 0
