"""The loop's per-round feedback (speculative/feedback.py): what the stats and the policy learn of each round."""

import pytest

from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import DraftModelDrafter, LookupDrafter, SpecStats, speculative_tokens
from mlx_infer.speculative import feedback
from mlx_infer.speculative.feedback import RoundClock, RoundReport, learn
from mlx_infer.speculative.schedule import FixedGamma

PROMPT = [3, 9, 27, 17, 51, 25, 11, 33, 35, 41]


class Recorder(FixedGamma):
    """A pinned gamma that records what the loop tells it, in order."""

    def __init__(self, gamma):
        super().__init__(gamma)
        self.calls = []

    def offered(self, key):
        self.calls.append(("offered", key))

    def observe(self, proposed, accepted, draft_s, verify_s, key=None, ahead=False, round_s=None):
        self.calls.append(("observe", proposed, accepted, draft_s, verify_s, key, ahead, round_s))


def test_learn_hands_a_round_to_the_stats_and_the_policy(monkeypatch):
    """A round that verified 3 drafts, accepted 1 and had a 4th outside the vocabulary: the stats count 4
    proposed positions (the first accepted) and 2 committed tokens; the policy hears the offer first, then
    the round with its 3 verified tokens and the clock's three intervals."""
    ticks = iter([10.0, 11.0, 11.5, 14.0])  # clock made, start, drafted, synced
    monkeypatch.setattr(feedback.time, "perf_counter", lambda: next(ticks))
    clock = RoundClock()
    clock.start()
    clock.drafted()
    clock.synced()
    stats, policy = SpecStats(), Recorder(4)
    learn(stats, policy, RoundReport(verified=3, accepted=1, outside=True, key=2, offered=True, offer_key=5), clock)
    assert (stats.rounds, stats.committed, stats.proposed, stats.accepted) == (1, 2, [1, 1, 1, 1], [1, 0, 0, 0])
    assert (stats.draft_s, stats.verify_s) == (0.5, 2.5)
    assert policy.calls == [("offered", 5), ("observe", 3, 1, 0.5, 2.5, 2, False, 4.0)]


def test_a_drafter_that_is_not_free_is_not_asked_for_offers():
    stats, policy = SpecStats(), Recorder(2)
    learn(stats, policy, RoundReport(verified=0, accepted=0), RoundClock())
    assert [c[0] for c in policy.calls] == ["observe"]
    assert (stats.rounds, stats.committed, stats.proposed) == (1, 1, [])


@pytest.mark.parametrize("gamma", [3, 8])
def test_the_loop_reports_every_round_once(target, gamma):
    """Through the loop with a draft model: one observe per round (target forward), whose verified /
    accepted counts add up to the stats' histograms and to the tokens delivered (greedy: plain's tokens)."""
    policy, stats = Recorder(gamma), SpecStats()
    out = list(speculative_tokens(target, PROMPT, SamplingParams(), 20, DraftModelDrafter(target), policy, stats))
    assert out == list(plain_tokens(target, PROMPT, SamplingParams(), 20))
    rounds = [c for c in policy.calls if c[0] == "observe"]
    assert len(rounds) == stats.rounds == len(policy.calls)  # a draft model is not free: no offers
    assert sum(r[2] + 1 for r in rounds) >= stats.committed == 20  # the last round may be cut by max_tokens
    assert [sum(r[1] > i for r in rounds) for i in range(gamma)] == stats.proposed[:gamma]
    assert [sum(r[2] > i for r in rounds) for i in range(gamma)] == stats.accepted[:gamma]
    assert all(not r[6] and r[7] is not None for r in rounds)  # drafting rounds are never launched ahead


def test_rounds_launched_ahead_are_reported_as_such_and_draft_for_no_time(target):
    """gamma 0 with lookup (free): every round is plain and all but the first are launched during the one
    before; each reports ahead=True, 0 s of drafting (it never drafted), and an offer before its observe."""
    policy, stats = Recorder(0), SpecStats()
    out = list(speculative_tokens(target, PROMPT, SamplingParams(), 8, LookupDrafter(), policy, stats))
    assert out == list(plain_tokens(target, PROMPT, SamplingParams(), 8))
    assert [c[0] for c in policy.calls] == ["offered", "observe"] * 8
    rounds = [c for c in policy.calls if c[0] == "observe"]
    assert [r[6] for r in rounds] == [False] + [True] * 7
    assert all(r[1:3] == (0, 0) and r[3] == 0.0 for r in rounds[1:])
