"""Greedy losslessness: every mode and gamma gives exactly plain decoding's token ids (tiny float32 models)."""

import random

import pytest

from mlx_infer.defaults import MAX_VERIFY_WIDTH
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import DraftModelDrafter, LookupDrafter, SpecStats, speculative_tokens
from mlx_infer.speculative.drafters.layerskip import LayerSkipDrafter
from mlx_infer.speculative.drafters.rmm import RmmDrafter
from mlx_infer.speculative.cost import CostCurve
from mlx_infer.speculative.schedule import DraftScheduler

V = 64
MAX_TOKENS = 14


def prompts():
    """52 prompts across kinds: random ("chat"), periodic ("code"-like indentation), arithmetic-like
    progressions ("math"), and copy-heavy (a chunk repeated, so lookup has something to copy)."""
    out = []
    for k in range(52):
        r = random.Random(k)
        kind = k % 4
        if kind == 0:
            p = [r.randrange(V) for _ in range(r.randrange(1, 30))]
        elif kind == 1:
            unit = [r.randrange(V) for _ in range(r.randrange(2, 6))]
            p = (unit * 8)[: r.randrange(6, 30)]
        elif kind == 2:
            a, d = r.randrange(V), r.randrange(1, 5)
            p = [(a + d * i) % V for i in range(r.randrange(3, 25))]
        else:
            chunk = [r.randrange(V) for _ in range(r.randrange(5, 15))]
            p = chunk + [r.randrange(V) for _ in range(3)] + chunk[: r.randrange(2, len(chunk))]
        out.append(p)
    return out


PROMPTS = prompts()


@pytest.fixture(scope="module")
def baselines(target):
    return [list(plain_tokens(target, p, SamplingParams(), MAX_TOKENS)) for p in PROMPTS]


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["lookup", "draft-weak", "draft-perfect", "layerskip", "rmm"])
def test_greedy_identical(target, weak_drafter_model, baselines, mode, gamma):
    for prompt, base in zip(PROMPTS, baselines):
        drafter = {"lookup": lambda: LookupDrafter(), "draft-weak": lambda: DraftModelDrafter(weak_drafter_model),
                   "draft-perfect": lambda: DraftModelDrafter(target),
                   "layerskip": lambda: LayerSkipDrafter(target, skip=[1]),
                   "rmm": lambda: RmmDrafter(target)}[mode]()
        stats = SpecStats()
        out = list(speculative_tokens(target, prompt, SamplingParams(), MAX_TOKENS, drafter, gamma, stats))
        assert out == base, (mode, gamma, prompt)
        if mode == "draft-perfect":  # the target drafting for itself is always right
            assert stats.accepted == stats.proposed


def test_greedy_identical_with_repetition_penalty(target, weak_drafter_model):
    """Penalties see the accepted prefix at every verified position, as in plain decoding."""
    params = SamplingParams(repetition_penalty=1.5, repetition_context_size=6)
    for prompt in PROMPTS[:12]:
        base = list(plain_tokens(target, prompt, params, MAX_TOKENS))
        for drafter in (LookupDrafter(), DraftModelDrafter(target)):
            out = list(speculative_tokens(target, prompt, params, MAX_TOKENS, drafter, 4))
            assert out == base, (drafter.name, prompt)


def test_verify_width_is_capped(target):
    """max_draft 40 with the target drafting for itself (every draft accepted): no round verifies more than
    MAX_VERIFY_WIDTH positions (wider forwards would leave the decode kernels' row-by-row computation), and
    the tokens are plain decoding's."""
    stats = SpecStats()
    prompt = PROMPTS[5]
    out = list(speculative_tokens(target, prompt, SamplingParams(), 40, DraftModelDrafter(target), 40, stats))
    assert out == list(plain_tokens(target, prompt, SamplingParams(), 40))
    assert len(stats.proposed) == MAX_VERIFY_WIDTH - 1 and stats.rounds == -(-40 // MAX_VERIFY_WIDTH)


def test_lookup_proposes_on_copy_heavy(target):
    stats = SpecStats()
    list(speculative_tokens(target, PROMPTS[3] * 3, SamplingParams(), MAX_TOKENS, LookupDrafter(), 4, stats))
    assert stats.proposed and stats.proposed[0] > 0


@pytest.mark.parametrize("slope", [0.0, 0.3, 1.0])
def test_greedy_identical_with_scheduled_gamma(target, weak_drafter_model, baselines, slope):
    """max_draft="auto": the gamma chosen each round by DraftScheduler (from flat to linear verify cost)."""
    curve = CostCurve({w: 1.0 + slope * (w - 1) for w in range(1, 10)})
    for make in (LookupDrafter, lambda: DraftModelDrafter(weak_drafter_model)):
        for prompt, base in zip(PROMPTS[:20], baselines[:20]):
            scheduler = DraftScheduler(curve, max_draft=8)
            out = list(speculative_tokens(target, prompt, SamplingParams(), MAX_TOKENS, make(), scheduler))
            assert out == base, (slope, prompt)
