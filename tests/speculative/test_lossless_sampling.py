"""Sampling losslessness: the first gamma + 1 tokens of speculative sampling (a whole draft of gamma = 2..8
tokens and the token after it) are jointly distributed as plain sampling's, with temperature, top-k, top-p
and a repetition penalty on, for prompt lookup and a draft model (DFlash and DSpark: test_dflash.py,
test_dspark.py); exact speculative sampling accepts more than mlx-lm's match-sampling.

The expectation is the exact joint, enumerated with the target and mlx-lm's own sampling pieces, and the
threshold is the noise floor of samples drawn from that exact joint (distribution.py)."""

import mlx.core as mx
import numpy as np
import pytest
from distribution import (K_MAX, chain_target, check_lossless, cycle_scenario, exact_joint, flat_scenario, sampler_probs,
                          speculative_samples)
from mlx.utils import tree_map
from mlx_lm.generate import generate_step, speculative_generate_step

from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams, build_logits_processors, build_sampler
from mlx_infer.speculative.drafters.draft_model import DraftModelDrafter
from mlx_infer.speculative.drafters.lookup import LookupDrafter
from mlx_infer.speculative.loop import SpecStats, speculative_tokens

#: requests (seeds) per distribution test; the slow versions run SLOW_N
N = 1000
SLOW_N = 4000


@pytest.fixture(scope="module")
def cycle(make_tiny):
    return cycle_scenario(make_tiny)


@pytest.fixture(scope="module")
def flat(make_tiny):
    return flat_scenario(make_tiny)


@pytest.fixture(scope="module")
def cycle_draft(make_tiny, cycle):
    """The cycle target with noisy weights (a draft model that is often, not always, right)."""
    model = chain_target(make_tiny, cycle.table, seed=3, mix=3.0)
    mx.random.seed(11)
    model.update(tree_map(lambda a: a + 0.1 * mx.random.normal(a.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def _drafter(name, cycle_draft):
    return LookupDrafter if name == "lookup" else (lambda: DraftModelDrafter(cycle_draft))


def test_exact_joint_is_what_plain_decoding_samples(cycle, flat):
    """Along plain decoding's own paths (mlx-lm's generate_step with our sampler and logits processors),
    every step's sampling distribution equals the enumerated conditional: the same logits, the penalty with
    the same history; and plain_tokens (its own loop of the same steps) draws the same tokens for the same
    seed."""
    for scenario in (cycle, flat):
        params, joint = scenario.params, scenario.joint
        for seed in range(8):
            mx.random.seed(seed)
            steps = list(generate_step(mx.array(scenario.prompt), scenario.target, max_tokens=K_MAX,
                                       sampler=build_sampler(params),
                                       logits_processors=build_logits_processors(params)))
            tokens = [int(t) for t, _ in steps]
            row = joint.index(np.array([tokens]))[0]
            dists = sampler_probs(mx.stack([lp for _, lp in steps]), params)  # [K, V]
            np.testing.assert_allclose(dists, joint.cond[row], atol=2e-5)
            assert list(plain_tokens(scenario.target, scenario.prompt, params.with_(seed=seed), K_MAX)) == tokens


def test_noise_floor_catches_a_missing_penalty(cycle):
    """The judge has power at the tests' sample size: samples of the first 3 tokens' joint without the repetition
    penalty fail against the penalized joint; samples of the penalized joint itself pass."""
    k = 3
    fit, floor = cycle.fit(k, N)
    rng = np.random.default_rng(1)
    unpenalized = exact_joint(cycle.target, cycle.prompt, cycle.params.with_(repetition_penalty=1.0), k)
    wrong = unpenalized.seqs[rng.choice(len(unpenalized.probs), N, p=unpenalized.probs)]
    z, detail = fit.judge(wrong, floor)
    assert z > floor.limit, (z, floor.limit, detail)
    right = fit.joint.seqs[rng.choice(len(fit.joint.probs), N, p=fit.joint.probs)]
    assert fit.judge(right, floor)[0] < floor.limit


@pytest.mark.parametrize("drafter,gamma", [("lookup", 8), ("draft", 2)])
def test_speculative_sampling_matches_exact(cycle, cycle_draft, drafter, gamma):
    """Prompt lookup (deterministic: q one-hot) with drafts of 8 and a sampling draft model (q its distribution)
    with drafts of 2: the first gamma + 1 tokens of 1000 seeded requests fit the exact joint within the noise
    floor, and acceptance at every draft position 2..gamma lies strictly between 0 and 1 (at least 10 rounds
    each way)."""
    check_lossless(cycle, _drafter(drafter, cycle_draft), gamma, N)


def test_rounds_without_a_draft_sample_as_plain_decoding(cycle):
    """Rounds that verify no draft (sample_plain: a categorical draw on the processed logits, no softmax
    between): with max_draft 0 every round is one, and the first K_MAX tokens of 1000 seeded requests fit
    the exact joint within the noise floor."""
    samples = np.array([list(speculative_tokens(cycle.target, cycle.prompt, cycle.params.with_(seed=s), K_MAX,
                                                LookupDrafter(), 0)) for s in range(N)])
    fit, floor = cycle.fit(K_MAX, N)
    z, detail = fit.judge(samples, floor)
    assert z < floor.limit, (z, floor.limit, detail)


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [2, 4, 8])
@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_speculative_sampling_matches_exact_large(cycle, cycle_draft, drafter, gamma):
    check_lossless(cycle, _drafter(drafter, cycle_draft), gamma, SLOW_N)


@pytest.mark.slow
def test_plain_sampling_matches_exact(cycle):
    """Ties the exact joint to what plain decoding really samples (statistically, all K_MAX tokens)."""
    samples = np.array([list(plain_tokens(cycle.target, cycle.prompt, cycle.params.with_(seed=s), K_MAX))
                        for s in range(SLOW_N)])
    fit, floor = cycle.fit(K_MAX, SLOW_N)
    z, detail = fit.judge(samples, floor)
    assert z < floor.limit, (z, floor.limit, detail)


# -- exact speculative sampling vs mlx-lm's match-sampling -------------------------------------------------

V = 12
PREFIX = [1, 2, 3, 4, 1, 2, 3]
PARAMS = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, max_tokens=2)


@pytest.fixture(scope="module")
def small(make_tiny):
    return make_tiny(seed=5, vocab=V, scale=2.0)


@pytest.fixture(scope="module")
def near_draft(small, make_tiny):
    """The target with noisy weights: a drafter that is often, not always, right."""
    mx.random.seed(11)
    d = make_tiny(seed=5, vocab=V, scale=2.0)
    d.update(tree_map(lambda a: a + 0.15 * mx.random.normal(a.shape), small.parameters()))
    mx.eval(d.parameters())
    return d


def test_accepts_more_than_match_sampling(small, near_draft):
    """First draft position of the first round: exact speculative sampling accepts with probability
    sum_x min(p, q) >= sum_x p q (match-sampling); measured on both, at a flatter temperature."""
    params = PARAMS.with_(temperature=1.5, max_tokens=3)
    ours = 0
    for seed in range(300):
        stats = SpecStats()
        gen = speculative_tokens(small, PREFIX, params.with_(seed=seed), 3, DraftModelDrafter(near_draft), 2, stats)
        next(gen)
        gen.close()
        ours += stats.accepted[0]
    theirs = 0
    for seed in range(300):
        mx.random.seed(seed)
        gen = speculative_generate_step(mx.array(PREFIX), small, near_draft, num_draft_tokens=2, max_tokens=3,
                                        sampler=build_sampler(params))
        _, _, from_draft = next(gen)
        gen.close()
        theirs += bool(from_draft)
    assert ours / 300 > theirs / 300 + 0.05, (ours / 300, theirs / 300)


@pytest.fixture(scope="module")
def wide_draft(make_tiny, cycle):
    """A draft model with 4 more vocabulary rows than the target (12 -> 16), one of which competes with the
    target's tokens after every context: its drafts often hold a token the target cannot emit."""
    vocab = cycle.table.shape[0]
    table = np.full((vocab + 4, vocab + 4), -4.0, dtype=np.float32)
    table[:vocab, :vocab] = cycle.table
    for row in range(vocab):
        table[row, vocab + row % 4] = cycle.table[row].max() - 0.2
    table[vocab:, :vocab] = cycle.table[:4]
    return chain_target(make_tiny, table, seed=5, mix=3.0)


def test_draft_tokens_outside_the_target_vocabulary_keep_sampling_exact(cycle, wide_draft):
    """A draft token outside the target's vocabulary has target probability 0: it is rejected for certain and
    the token after the accepted prefix comes from the residual of that rejection (its q mass drops out),
    not from p (before: the draft was cut there and the token drawn from p, which biases the joint)."""
    samples, stats = speculative_samples(cycle, lambda: DraftModelDrafter(wide_draft), 2, N)
    fit, floor = cycle.fit(3, N)
    z, detail = fit.judge(samples, floor)
    assert z < floor.limit, (z, floor.limit, detail)
    outside = sum(stats.proposed) - sum(stats.accepted)
    assert outside > 0 and stats.accepted[0] > 0  # drafts were proposed, some accepted, some rejected
