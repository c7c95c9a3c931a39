"""Sampling losslessness: the first emitted tokens of speculative sampling are distributed as plain
sampling's (temperature, top-k, top-p on), and exact speculative sampling accepts more than mlx-lm's
match-sampling (accept only when an independent target sample equals the draft)."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import speculative_generate_step
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams, build_sampler
from mlx_infer.speculative import DraftModelDrafter, LookupDrafter, SpecStats, speculative_tokens

V = 12
PREFIX = [1, 2, 3, 4, 1, 2, 3]
PARAMS = SamplingParams(temperature=0.8, top_k=8, top_p=0.95, max_tokens=2)
N = 1000


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


def processed_probs(logits):
    """[N, V] logits -> [N, V] probabilities plain sampling draws from, built from mlx-lm's own pieces."""
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    lp = apply_top_k(apply_top_p(lp, PARAMS.top_p), PARAMS.top_k)
    return mx.softmax(lp * (1 / PARAMS.temperature), axis=-1)


@pytest.fixture(scope="module")
def exact(small):
    """Exact joint distribution [V, V] of the first two tokens."""
    p1 = np.array(processed_probs(small(mx.array([PREFIX]))[:, -1]))[0]
    batch = mx.array([PREFIX + [t] for t in range(V)])
    p2 = np.array(processed_probs(small(batch)[:, -1]))  # [V, V]
    return p1[:, None] * p2


def tv(counts, p):
    return 0.5 * np.abs(counts / counts.sum() - p.ravel()).sum()


def noise_floor(p, n, reps=300, q=0.999):
    rng = np.random.default_rng(0)
    return np.quantile([tv(rng.multinomial(n, p.ravel()), p) for _ in range(reps)], q)


def joint_counts(sample):
    counts = np.zeros(V * V)
    for seed in range(N):
        a, b = sample(seed)
        counts[a * V + b] += 1
    return counts


def test_plain_sampling_matches_exact(small, exact):
    """Ties the reference distribution to what plain decoding really samples."""
    def sample(seed):
        return list(plain_tokens(small, PREFIX, PARAMS.with_(seed=seed), 2))
    assert tv(joint_counts(sample), exact) < noise_floor(exact, N)


@pytest.mark.parametrize("drafter", ["draft", "lookup"])
def test_speculative_sampling_matches_exact(small, near_draft, exact, drafter):
    def sample(seed):
        d = DraftModelDrafter(near_draft) if drafter == "draft" else LookupDrafter()
        return list(speculative_tokens(small, PREFIX, PARAMS.with_(seed=seed), 2, d, 2))
    assert tv(joint_counts(sample), exact) < noise_floor(exact, N)


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
