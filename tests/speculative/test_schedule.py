"""Draft-length scheduling: cost curves, acceptance estimates, the choice of gamma, the plain fallback."""

import json
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative.drafters.layerskip import candidate_skips, skip_view
from mlx_infer.speculative.drafters.lookup import LookupDrafter
from mlx_infer.speculative import SpecOptions, SpecState, SpecStats, speculative_tokens
from mlx_infer.speculative import cost
from mlx_infer.speculative.cost import COST_ATTEMPTS, CostCurve, consistent, cost_curve, measure_cost_curve
from mlx_infer.speculative.schedule import (
    ARM_BACKOFF, ARM_WINDOW, PROBE_EVERY, DraftScheduler, expected_committed, speculation_pays,
)


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve({1: 1.0, 3: 2.0, 5: 4.0})
    assert curve(1) == 1.0
    assert curve(2) == pytest.approx(1.5)
    assert curve(4) == pytest.approx(3.0)
    assert curve(7) == pytest.approx(6.0)  # the last slope (1 s per token) continued


@pytest.mark.parametrize("rates", [[0.5] * 4, [0.9, 0.5, 0.2, 0.1], [1.0, 1.0, 0.0, 1.0]])
def test_expected_committed_matches_enumeration(rates):
    """E[committed] = sum over outcomes: accept a prefix of length k (prob prod a_1..a_k * (1 - a_{k+1})), commit k+1."""
    for gamma in range(len(rates) + 1):
        total = 0.0
        for k in range(gamma + 1):
            p = 1.0
            for a in rates[:k]:
                p *= a
            if k < gamma:
                p *= 1 - rates[k]
            total += p * (k + 1)
        assert expected_committed(rates, gamma) == pytest.approx(total)


def test_speculation_pays_only_when_width_is_cheap():
    flat = CostCurve({w: 1.0 + 0.05 * (w - 1) for w in range(1, 10)})
    linear = CostCurve({w: float(w) for w in range(1, 10)})
    assert speculation_pays(flat, 8)
    assert not speculation_pays(linear, 8)


def test_scheduler_picks_long_drafts_when_they_are_accepted_and_cheap():
    s = DraftScheduler(CostCurve({w: 1.0 + 0.01 * w for w in range(1, 10)}), max_draft=8)
    for _ in range(60):
        s.observe(8, 8, 0.0, s.curve(9))
    assert s.gamma() == 8


def test_scheduler_falls_back_to_plain_steps_and_probes():
    s = DraftScheduler(CostCurve({w: 1.0 + 0.5 * (w - 1) for w in range(1, 10)}), max_draft=8)
    for _ in range(60):
        s.observe(2, 0, 0.01, s.curve(3))  # every draft rejected at once
    choices = []
    for _ in range(PROBE_EVERY + 1):
        choices.append(s.gamma())
        s.observe(0, 0, 0.0, s.curve(1))  # a plain round
    assert choices == [0] * PROBE_EVERY + [2]  # after PROBE_EVERY plain rounds a probe refreshes the estimates


def test_probes_come_every_probe_every_rounds_while_the_verdict_stands():
    """A drafter not worth it is probed every PROBE_EVERY rounds (no back-off: it showed no benefit); one that
    finds it worth it again restores drafting at once."""
    s = DraftScheduler(CostCurve({w: 1.0 + 0.5 * (w - 1) for w in range(1, 10)}), max_draft=8)
    for _ in range(30):
        s.observe(2, 0, 0.01, s.curve(3))
    probes = []
    for r in range(PROBE_EVERY * 3 + 3):
        g = s.gamma()
        if g:
            probes.append(r)
        s.observe(g, 0, 0.01 * g, s.curve(g + 1))
    assert probes == [PROBE_EVERY, 2 * PROBE_EVERY + 1, 3 * PROBE_EVERY + 2]
    assert s.plain_next() is True  # the next round is plain whatever token this one commits
    for _ in range(40):
        s.observe(2, 2, 0.0, s.curve(3))
    assert s.gamma() > 0


def test_scheduler_counts_only_observed_positions():
    s = DraftScheduler(CostCurve({1: 1.0, 9: 1.0}), max_draft=4)
    s.observe(4, 1, 0.0, s.curve(5))  # position 0 accepted, 1 rejected, 2..3 never judged
    rates = s.rates()
    assert rates[0] > 0.5 and rates[1] < 0.5 and rates[2] == rates[3] == 0.5


def test_scheduler_learns_fast_from_rejections():
    """A drafter that is always wrong is dropped after a few rounds, not after dozens."""
    s = DraftScheduler(CostCurve({w: 1.0 + 0.02 * (w - 1) for w in range(1, 10)}), max_draft=8)
    assert s.gamma() == 2  # drafting cost unknown: a short first draft
    for _ in range(4):
        s.observe(2, 0, 0.6, s.curve(3))  # rejected at once; each draft token costs 0.3 of a target forward
    assert s.best_gamma() == 0


def test_scheduler_weighs_drafting_cost():
    """The same acceptance pays with a free drafter and not with one as slow as the target."""
    curve = CostCurve({w: 1.0 for w in range(1, 10)})
    cheap, slow = DraftScheduler(curve, 4), DraftScheduler(curve, 4)
    for _ in range(20):
        cheap.observe(4, 1, 0.0, cheap.curve(5))
        slow.observe(4, 1, 4.0, slow.curve(5))
    assert cheap.best_gamma() >= 1 and slow.best_gamma() == 0


def test_measure_cost_curve_times_every_width(make_tiny):
    model = make_tiny(seed=3)
    curve = measure_cost_curve(model, 4, vocab_size=64)
    assert sorted(curve.seconds) == [1, 2, 3, 4]
    assert 0 < curve.plain() == curve.plain_step
    assert all(t > 0 for t in curve.seconds.values())


#: A curve measured on this machine while it was busy (seconds): its plain step came out 1.16x its width-1
#: forward, where an idle run gives 0.97x (14.3 against 14.7 ms).
BUSY_CURVE = {"seconds": {"1": 0.02167, "2": 0.02637, "3": 0.02774, "4": 0.02850}, "plain_step": 0.02514}


def test_a_curve_whose_plain_step_exceeds_its_width_1_forward_is_not_consistent():
    assert not consistent(BUSY_CURVE, 4)
    assert consistent({**BUSY_CURVE, "plain_step": 0.97 * 0.02167}, 4)
    assert consistent({**BUSY_CURVE, "plain_step": 1.09 * 0.02167}, 4)  # within PLAIN_SLACK
    assert not consistent({**BUSY_CURVE, "plain_step": 0.02}, 5)  # too short
    assert not consistent({**BUSY_CURVE, "plain_step": 0.0}, 4)


def test_an_inconsistent_cached_curve_is_measured_again(make_tiny, make_target, tmp_path, monkeypatch):
    """A cached curve timed while the machine was busy is replaced by a new measurement, which is kept."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    target = make_target(make_tiny(seed=6, layers=2))
    said = []
    cost_curve(target, 4, say=said.append)
    (path,) = (tmp_path / "cost").glob("*.json")
    path.write_text(json.dumps(BUSY_CURVE))
    curve = cost_curve(target, 4, say=said.append)
    assert len(said) == 2 and curve.plain_step != BUSY_CURVE["plain_step"]
    assert consistent(json.loads(path.read_text()), 4)
    assert cost_curve(target, 4, say=said.append).to_json() == curve.to_json() and len(said) == 2  # kept


def test_a_curve_inconsistent_every_time_is_kept_with_its_plain_step_capped(make_tiny, make_target, tmp_path,
                                                                            monkeypatch):
    """After COST_ATTEMPTS inconsistent measurements the last is kept with plain step = width-1 forward, so
    that a machine where pipelining never pays does not measure before every request."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    calls = []

    def busy(model, max_width, vocab_size, pipelined=True, compiled=None):
        calls.append(max_width)
        return CostCurve({int(k): v for k, v in BUSY_CURVE["seconds"].items()}, BUSY_CURVE["plain_step"])

    monkeypatch.setattr(cost, "measure_cost_curve", busy)
    curve = cost_curve(make_target(make_tiny(seed=6, layers=2)), 4)
    assert len(calls) == COST_ATTEMPTS
    assert curve.plain_step == BUSY_CURVE["seconds"]["1"] and curve.seconds[4] == BUSY_CURVE["seconds"]["4"]


def test_skip_view_runs_the_kept_layers_only(make_tiny):
    model = make_tiny(seed=4, layers=3)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    view = skip_view(model, [0, 2])
    # the same computation by hand: embed, layers 0 and 2 with a causal mask, norm, head
    from mlx_lm.models.base import create_attention_mask

    h = model.model.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    for i in (0, 2):
        h = model.model.layers[i](h, mask, None)
    expected = model.lm_head(model.model.norm(h))
    assert mx.allclose(view(tokens), expected, atol=1e-5).item()
    assert len(model.model.layers) == 3  # the target is untouched


def test_candidate_skips_keep_first_and_last_layers():
    for n in (4, 12, 30):
        for skip in candidate_skips(n):
            assert skip and 0 not in skip and n - 1 not in skip and len(set(skip)) == len(skip)


def test_free_drafter_asks_for_the_most_and_cuts_per_bucket():
    """Lookup-like drafters: asked for max_draft; the proposal is cut by the acceptance of its bucket."""
    from mlx_infer.speculative.drafters.base import Draft

    s = DraftScheduler(CostCurve({w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}), max_draft=8, free=True)
    assert s.gamma() == 8
    for _ in range(30):
        s.observe(8, 8, 0.0, s.curve(9), key=3)  # long matches: always accepted
        s.observe(2, 0, 0.0, s.curve(3), key=1)  # one-token matches: always rejected
    assert s.cut(Draft(list(range(8)), key=3)) == 8
    assert s.cut(Draft(list(range(5)), key=3)) == 5
    assert s.cut(Draft(list(range(8)), key=1)) == 0


def test_block_drafter_cost_is_per_round():
    """A block drafter's pass costs the same whatever gamma: good acceptance pays for the whole block, and
    a drafter that is always wrong is dropped for plain steps."""
    curve = CostCurve({w: 1.0 + 0.02 * (w - 1) for w in range(1, 17)})
    good, bad = DraftScheduler(curve, 15, per_round=True), DraftScheduler(curve, 15, per_round=True)
    assert good.gamma() == 15  # cost unknown: the first round drafts a block
    for _ in range(40):
        good.observe(15, 15, 0.3, good.curve(16))
        bad.observe(15, 0, 0.3, bad.curve(16))
    assert good.draft_cost == pytest.approx(0.3)  # seconds per pass, not per token
    assert good.gamma() == 15
    assert bad.best_gamma() == 0


def test_prepare_measures_once_and_says_so(make_tiny, make_target, tmp_path, monkeypatch):
    """prepare() measures the cost curve (and layerskip's calibration) before the first request, with a
    line each; the second time (a new process: a new SpecState) everything comes from the disk cache,
    silently."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    target = make_target(make_tiny(seed=6, layers=4))
    said = []
    SpecState(target).prepare(SpecOptions("off"), say=said.append)
    assert said == []
    SpecState(target).prepare(SpecOptions("lookup", max_draft=4), say=said.append)  # pinned: nothing to measure
    assert said == []
    SpecState(target).prepare(SpecOptions("lookup"), say=said.append)
    assert len(said) == 1 and "verify cost" in said[0]
    said.clear()
    SpecState(target).prepare(SpecOptions("lookup"), say=said.append)
    assert said == []
    SpecState(target).prepare(SpecOptions("layerskip"), say=said.append)  # its calibration, then its prior
    assert len(said) == 2 and "layerskip" in said[0] and "agrees" in said[1]
    said.clear()
    SpecState(target).prepare(SpecOptions("layerskip"), say=said.append)
    assert said == []


def test_drafting_is_weighed_against_the_pipelined_plain_step():
    """A plain round costs what the curve's pipelined step says. Acceptance 0.3 at a width-2 verify of 1.1:
    1.3 tokens / 1.1 s = 1.18 tokens/s, which beats a plain step read back each time (1 / 1.0) but not the
    pipelined one (1 / 0.8 = 1.25)."""
    curve = CostCurve({w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}, plain_step=0.8)
    s = DraftScheduler(curve, max_draft=1, free=True)
    for i in range(200):
        s.observe(1, int(i % 10 < 3), 0.0, curve(2))
    assert s.verify_cost(1) == pytest.approx(0.8) and s.best_gamma() == 0
    unmeasured = DraftScheduler(CostCurve(dict(curve.seconds)), max_draft=1, free=True)  # plain step: seconds[1]
    for i in range(200):
        unmeasured.observe(1, int(i % 10 < 3), 0.0, curve(2))
    assert unmeasured.verify_cost(1) == 1.0 and unmeasured.best_gamma() == 1


def test_a_free_drafters_new_bucket_is_tried_at_once():
    """Even where the prior alone does not pay (a steep curve), the first proposal from a bucket is verified
    (a short probe); after that the bucket waits its turn like any other."""
    from mlx_infer.speculative.drafters.base import Draft

    s = DraftScheduler(CostCurve({w: 1.0 + 0.6 * (w - 1) for w in range(1, 10)}), max_draft=8, free=True)
    assert s.best_gamma(3, sunk=True) == 0
    assert s.cut(Draft(list(range(8)), key=3)) == 2
    s.observe(2, 0, 0.0, s.curve(3), key=3)
    assert s.cut(Draft(list(range(8)), key=3)) == 0


def measured_rounds(s, n, committed, seconds, proposed=2):
    """n rounds of the loop as DraftScheduler.observe sees them: `committed` tokens in `seconds` each."""
    for _ in range(n):
        s.observe(proposed if not s.plain_left else 0, committed - 1, 0.0, seconds, ahead=bool(s.plain_left),
                  round_s=seconds)


def test_speculation_measured_slower_than_plain_decodes_plainly_then_tries_again():
    """A curve that promises much (a 9-token verify at 1.1x a step), but rounds that commit 1 token in 1.5
    steps' time: after ARM_WINDOW rounds it decodes plainly for ARM_BACKOFF rounds (launchable ahead), where
    only a proved bucket (5: every draft accepted so far) still drafts; then it speculates again, and slower
    again it waits twice as long."""
    s = DraftScheduler(CostCurve({w: 1.0 + 0.0125 * (w - 1) for w in range(1, 10)}), max_draft=8, free=True)
    for _ in range(20):
        s.observe(8, 8, 0.0, s.curve(9), key=5)  # bucket 5 learned: always accepted (no round times: not compared)
    assert s.plain_left == 0 and s.cut(SimpleNamespace(tokens=[1] * 8, key=5)) == 8
    measured_rounds(s, ARM_WINDOW, 1, 1.5)  # speculation: 0.67 tokens/s against the curve's plain 1.0
    assert s.plain_left == ARM_BACKOFF
    unproven = SimpleNamespace(tokens=[1] * 8, key=3)
    assert not s.worth(3) and s.cut(unproven) == 0  # an unproven bucket waits
    assert s.worth(5) and s.cut(SimpleNamespace(tokens=[1] * 8, key=5)) == 8  # the proved one still drafts
    assert s.plain_next([1, 2, 3]) and not s.plain_next([3, 5])  # launched ahead unless bucket 5 can draft
    measured_rounds(s, ARM_BACKOFF - 1, 1, 1.0)
    assert s.plain_left == 1 and not s.plain_next([1])  # the last plain round: the next one speculates
    measured_rounds(s, 1, 1, 1.0)
    assert s.plain_left == 0 and s.worth(3)
    measured_rounds(s, ARM_WINDOW, 1, 1.5)
    assert s.plain_left == 2 * ARM_BACKOFF


def test_speculation_measured_faster_keeps_speculating():
    """Rounds committing 3 tokens in 1.2 steps beat plain decoding's measured 1 token per step: no plain
    stint, and the back-off returns to its start."""
    s = DraftScheduler(CostCurve({w: 1.0 + 0.0125 * (w - 1) for w in range(1, 10)}), max_draft=8, free=True)
    s.backoff = 4 * ARM_BACKOFF
    s.plain_left = 4
    measured_rounds(s, 4, 1, 1.0)  # plain decoding measured: 1 token per second
    measured_rounds(s, 3 * ARM_WINDOW, 3, 1.2)
    assert s.plain_left == 0 and s.backoff == ARM_BACKOFF and s.gamma() == 8


def test_a_plain_round_is_launched_ahead_unless_a_likely_draft_saves_more():
    """plain_next weighs what each possible bucket's draft would save by how often that bucket offers one,
    against what a plain step not launched ahead costs more (curve(1) - plain step = 0.2 s here)."""
    curve = CostCurve({w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}, plain_step=0.8)
    s = DraftScheduler(curve, max_draft=4, free=True)
    for _ in range(40):
        s.observe(2, 1, 0.0, curve(3), key=1)  # bucket 1: the first draft token passes, the second not
    saving = s.saving(1)  # ~2 tokens for a width-2 verify: ~2 * 0.8 - 1.1 s
    assert saving == pytest.approx(expected_committed(s.rates(1), 1) * 0.8 - 1.1)
    assert saving > 0.2
    assert not s.plain_next([1])  # no offers counted yet: assume bucket 1 offers every round
    for _ in range(40):
        s.offered(None)  # rounds without a proposal
    s.offered(1)
    assert s.offer_rate(1) * saving < 0.2 and s.plain_next([1])
    for _ in range(10):
        s.offered(1)  # bucket 1 now offers most rounds
    assert s.offer_rate(1) > 0.6 and not s.plain_next([1])


class OfferRecorder(DraftScheduler):
    """A DraftScheduler that records what offered() gets."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offers_seen = []

    def offered(self, key):
        self.offers_seen.append(key)
        super().offered(key)


def test_the_loop_counts_every_rounds_offer(make_tiny):
    """Under a curve where no draft pays (a verify of w tokens costs w steps) every round is plain, most of
    them launched ahead; each round still tells the policy which bucket lookup would draft from (its longest
    n-gram match, None without one), and the output equals plain decoding."""
    target = make_tiny(seed=3, vocab=16, scale=3.0)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    base = list(plain_tokens(target, prompt, SamplingParams(), 24))
    s = OfferRecorder(CostCurve({w: float(w) for w in range(1, 10)}), max_draft=4, free=True)
    s.last_try = {k: 0 for k in (1, 2, 3)}  # no first-proposal probes: no round verifies a draft
    stats = SpecStats()
    out = list(speculative_tokens(target, prompt, SamplingParams(), 24, LookupDrafter(), s, stats))
    assert out == base and stats.rounds == 24
    history = prompt + out
    expected = [LookupDrafter().propose(history[:len(prompt) + i], 4).key for i in range(24)]
    assert s.offers_seen == expected
    assert set(expected) - {None}  # the repeated prompt gives matches to count


def test_a_buckets_saving_counts_its_drafting_cost():
    """saving() is the best gamma's expected tokens at the plain step's price, less its verify and its
    drafting (a costly source's measured seconds per proposal), and 0 where no gamma pays (gamma 0)."""
    curve = CostCurve({w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}, plain_step=0.8)
    s = DraftScheduler(curve, max_draft=4, free=True)
    for _ in range(30):
        s.observe(4, 4, 0.0, curve(5), key=7)  # every draft token passed
    rates = s.rates(7)

    def best(cost):
        return max([0.0] + [expected_committed(rates, g) * 0.8 - curve(g + 1) - cost for g in range(1, 5)])

    assert s.saving(7) == pytest.approx(best(0.0)) and s.saving(7) > 1.0
    s.key_costs[7] = 0.5  # seconds per proposal of this bucket
    assert s.saving(7) == pytest.approx(best(0.5))
    s.key_costs[7] = 10.0
    assert s.saving(7) == 0.0
