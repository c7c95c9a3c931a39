"""Exact joint distributions of the first K sampled tokens and a goodness-of-fit test against them, for the
sampling-losslessness tests of speculative decoding.

The exact joint is built by enumerating every prefix the sampler can produce, with the target model itself and
mlx-lm's own sampling pieces (its repetition-penalty processor with the whole history, then log-softmax, top-p,
min-p and top-k in the order `mlx_lm.sample_utils.make_sampler` applies them, then temperature): nothing of
mlx_infer's verify / process_logits is used, so the expectation is independent of the code under test.

The test statistics of a sample of N sequences (Fit.statistics):
    tv_k        total variation between the empirical and the exact joint of the first k tokens, k = 1..K;
    chi2_j      Pearson's statistic of the tokens emitted at position j against their expected counts given
                each sample's own prefix, sum_v (O_jv - E_jv)^2 / E_jv with E_jv = sum_n p(v | x_n,<j) (the
                per-position test of the accept/reject chain: a bias at draft position j shows here first).
The noise floor is the same statistics of samples of the same size drawn from the exact joint itself (numpy,
seeded): each statistic is standardized by the floor's mean and standard deviation, and the sample fails when its
largest standardized statistic exceeds the floor's 0.999 quantile of that maximum. A sample outside the exact
support fails at once.
"""

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative.drafters.base import Drafter
from mlx_infer.speculative.loop import SpecStats, speculative_tokens


def processed_probs(logits: mx.array, histories: np.ndarray, params: SamplingParams) -> np.ndarray:
    """What plain sampling draws the next token from, given raw logits, from mlx-lm's own pieces.

    Args:
        logits: [B, V] float32 raw next-token logits of the target after each history.
        histories: [B, T] int, each row a whole history (prompt + tokens sampled so far).
        params: sampling parameters with temperature > 0.

    Returns:
        [B, V] float64 probabilities (masked tokens exactly 0; rows sum to 1).
    """
    processors = make_logits_processors(repetition_penalty=params.repetition_penalty,
                                        repetition_context_size=params.repetition_context_size)
    if processors:
        # mlx-lm's penalty looks back repetition_context_size tokens: rows that share that tail share one call
        # of the processors, given the whole history of one of them (as generate_step gives it)
        _, group = np.unique(histories[:, -params.repetition_context_size :], axis=0, return_inverse=True)
        group = group.reshape(-1)
        order = np.argsort(group, kind="stable")
        parts = []
        for g in range(int(group.max()) + 1):
            members = np.nonzero(group == g)[0]
            part = logits[mx.array(members)]
            for proc in processors:
                part = proc(mx.array(histories[members[0]], dtype=mx.int32), part)
            parts.append(part)
        logits = mx.concatenate(parts, axis=0)[mx.array(np.argsort(order))]  # back to row order
    return sampler_probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params)  # as generate_step


def sampler_probs(logprobs: mx.array, params: SamplingParams) -> np.ndarray:
    """[B, V] log-probabilities (what mlx-lm's generate_step hands its sampler) -> [B, V] float64 probabilities
    the sampler draws from: top-p, min-p, top-k in make_sampler's order, then softmax at the temperature
    (categorical_sampling)."""
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return np.array(mx.softmax(logprobs * (1.0 / params.temperature), axis=-1), dtype=np.float64)


@dataclass
class Joint:
    """The exact joint distribution of the first K sampled tokens.

    Attributes:
        seqs: [M, K] int, every sequence with probability > 0, in lexicographic order (so the sequences
            sharing a prefix are contiguous).
        probs: [M] float64, their probabilities (sum 1).
        cond: [M, K, V] float64, cond[m, j] = p(. | prompt + seqs[m, :j]).
    """

    seqs: np.ndarray
    probs: np.ndarray
    cond: np.ndarray

    @property
    def k(self) -> int:
        return self.seqs.shape[1]

    @property
    def vocab(self) -> int:
        return self.cond.shape[2]

    def starts(self, k: int) -> np.ndarray:
        """[P] first row of each distinct prefix of length k (ascending)."""
        prefix = self.seqs[:, :k]
        return np.concatenate([[0], np.nonzero((prefix[1:] != prefix[:-1]).any(axis=1))[0] + 1])

    def head(self, k: int) -> "Joint":
        """The joint of the first k <= K tokens (the marginal)."""
        first = self.starts(k)
        return Joint(self.seqs[first, :k], np.add.reduceat(self.probs, first), self.cond[first, :k])

    def index(self, samples: np.ndarray) -> np.ndarray:
        """[N, K] int samples -> [N] row indices; AssertionError naming a sample outside the support."""
        codes, mine = _codes(samples, self.vocab), _codes(self.seqs, self.vocab)
        idx = np.minimum(np.searchsorted(mine, codes), len(mine) - 1)
        bad = np.nonzero(mine[idx] != codes)[0]
        assert bad.size == 0, (f"{bad.size} of {len(codes)} samples outside the exact support, "
                               f"e.g. {samples[bad[0]].tolist()}")
        return idx


def _codes(seqs: np.ndarray, vocab: int) -> np.ndarray:
    """[N, K] int -> [N] int64 base-vocab numbers (lexicographic order = numeric order)."""
    return (seqs.astype(np.int64) * vocab ** np.arange(seqs.shape[1] - 1, -1, -1, dtype=np.int64)).sum(axis=1)


def exact_joint(model: nn.Module, prompt: Sequence[int], params: SamplingParams, k: int) -> Joint:
    """Enumerate every sequence of k tokens plain sampling can produce after `prompt`, with its probability.

    One batched target step per depth over every prefix with probability > 0 (at most top_k^depth rows), on a
    KV cache whose rows are gathered from each child's parent prefix through mlx-lm's cache `state` property.

    Returns:
        Joint of the k tokens (float64 probabilities; conditionals as processed_probs computes them).
    """
    head = np.asarray(prompt, dtype=np.int64)
    cache = make_prompt_cache(model)
    logits = model(mx.array(head)[None], cache=cache)[:, -1, :].astype(mx.float32)  # [1, V]
    seqs = np.zeros((1, 0), dtype=np.int64)  # [B, d] prefixes, lexicographic
    probs = np.ones(1)  # [B]
    cond = np.zeros((1, 0, logits.shape[-1]))  # [B, d, V]
    for depth in range(k):
        p = processed_probs(logits, np.concatenate([np.tile(head, (seqs.shape[0], 1)), seqs], axis=1), params)
        b, v = np.nonzero(p > 0)  # row-major: the children stay in lexicographic order
        cond = np.concatenate([cond[b], p[b][:, None]], axis=1)
        seqs = np.concatenate([seqs[b], v[:, None]], axis=1)
        probs = probs[b] * p[b, v]
        if depth + 1 < k:
            rows = mx.array(b)
            for c in cache:  # [B, n_kv, T, D] rows of each child's parent
                state = c.state
                c.state = (state[0][rows], state[1][rows], *state[2:])
            logits = model(mx.array(v)[:, None], cache=cache)[:, -1, :].astype(mx.float32)  # [B', V]
    return Joint(seqs, probs / probs.sum(), cond)


@dataclass
class Floor:
    """The noise floor of Fit.statistics for samples of size n (see the module docstring)."""

    n: int
    mean: np.ndarray  # [S] mean of each statistic over samples of the exact joint
    std: np.ndarray  # [S]
    limit: float  # the `quantile` of max_s (stat_s - mean_s) / std_s over those samples


class Fit:
    """The statistics tv_1..K, chi2_1..K of samples against one Joint, and their noise floor."""

    def __init__(self, joint: Joint):
        self.joint = joint
        self.starts = [joint.starts(j + 1) for j in range(joint.k)]
        self.prefix_probs = [np.add.reduceat(joint.probs, s) for s in self.starts]
        m, k, v = joint.cond.shape
        self.onehot = np.eye(v)[joint.seqs].reshape(m, k * v)  # [M, K*V]
        self.cond = joint.cond.reshape(m, k * v)
        self.names = [f"tv_{j + 1}" for j in range(k)] + [f"chi2_{j + 1}" for j in range(k)]

    def statistics(self, counts: np.ndarray) -> np.ndarray:
        """[R, M] counts of each support sequence -> [R, S] statistics (tv_1..K, then chi2_1..K)."""
        m = self.joint.seqs.shape[0]
        n = counts.sum(axis=1, keepdims=True).astype(np.float64)  # [R, 1]
        tvs = []
        for starts, exact in zip(self.starts, self.prefix_probs):
            prefix = counts if starts.size == m else np.add.reduceat(counts, starts, axis=1)  # [R, P]
            tvs.append(0.5 * np.abs(prefix / n - exact).sum(axis=1))
        c = counts.astype(np.float64)
        shape = (c.shape[0], self.joint.k, self.joint.vocab)
        observed = (c @ self.onehot).reshape(shape)  # [R, K, V]
        expected = (c @ self.cond).reshape(shape)
        chi2 = ((observed - expected) ** 2 / np.where(expected > 0, expected, 1.0)).sum(axis=2)  # [R, K]
        return np.concatenate([np.stack(tvs, axis=1), chi2], axis=1)

    def floor(self, n: int, reps: int = 500, quantile: float = 0.999, seed: int = 0) -> Floor:
        """The statistics of `reps` samples of size n drawn from the exact joint itself (numpy, seeded)."""
        rng = np.random.default_rng(seed)
        m = self.joint.seqs.shape[0]
        cdf = np.cumsum(self.joint.probs)
        stats = []
        for s in range(0, reps, 100):
            r = min(100, reps - s)
            if n < m:  # cheaper to draw the n samples than m binomials
                idx = np.minimum(np.searchsorted(cdf, rng.random((r, n)) * cdf[-1], side="right"), m - 1)
                counts = np.bincount((idx + m * np.arange(r)[:, None]).ravel(), minlength=r * m).reshape(r, m)
            else:
                counts = rng.multinomial(n, self.joint.probs, size=r)
            stats.append(self.statistics(counts))
        stats = np.concatenate(stats)  # [reps, S]
        mean, std = stats.mean(axis=0), stats.std(axis=0) + 1e-12
        return Floor(n, mean, std, float(np.quantile(((stats - mean) / std).max(axis=1), quantile)))

    def judge(self, samples: np.ndarray, floor: Floor) -> Tuple[float, Dict[str, float]]:
        """[N, K] samples -> (their largest standardized statistic, {name: standardized value}).

        Raises AssertionError when a sample lies outside the exact support or N is not the floor's n.
        """
        assert samples.shape == (floor.n, self.joint.k), (samples.shape, floor.n, self.joint.k)
        counts = np.bincount(self.joint.index(samples), minlength=self.joint.seqs.shape[0])[None]  # [1, M]
        z = (self.statistics(counts)[0] - floor.mean) / floor.std
        return float(z.max()), dict(zip(self.names, np.round(z, 1).tolist()))


# -- designed tiny targets --------------------------------------------------------------------------------
#
# A random tiny llama rarely continues what a drafter proposes, so drafts of 2-8 tokens would be rejected at
# once and the accept/reject chain past position 1 would never run. These targets are make_tiny models whose
# embedding and head are set so that the next-token logits are a chosen bigram table, table[last token], and
# whose random attention / MLP layers stay in place (output projections scaled by `mix`), so that the whole
# context still moves the distribution and the KV cache the speculative loop rolls back matters.


def chain_target(make_tiny: Callable, table: np.ndarray, seed: int, mix: float) -> nn.Module:
    """A make_tiny llama (hidden 32, float32) whose logits are about table[last token] ([V, V] float).

    Embedding row v = sqrt(H) e_v (unit RMS, which RMSNorm keeps); lm_head = table^T / sqrt(H) on the first V
    dims; every layer's o_proj and down_proj multiplied by `mix`.
    """
    vocab = table.shape[0]
    model = make_tiny(seed=seed, vocab=vocab)
    hidden = model.args.hidden_size
    embed = np.zeros((vocab, hidden), np.float32)
    embed[np.arange(vocab), np.arange(vocab)] = np.sqrt(hidden)
    head = np.zeros((vocab, hidden), np.float32)
    head[:, :vocab] = table.T / np.sqrt(hidden)
    params = dict(tree_flatten(model.parameters()))
    params["model.embed_tokens.weight"] = mx.array(embed)
    params["lm_head.weight"] = mx.array(head)
    for name in params:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = params[name] * mix
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def cycle_table(vocab: int = 12, period: int = 10, seed: int = 0) -> np.ndarray:
    """[V, V] bigram logits: token v < period is followed by v + 1 (mod period) at logit 3, steps back to v - 1
    and v - 2 at 1.5 and 1.0, the rest at -2 (+ N(0, 0.3) noise); tokens >= period go back into the cycle.
    The two alternatives are what the last tokens hold, so the repetition penalty, and its history, decide how
    often the cycle is left at every position."""
    rng = np.random.default_rng(seed)
    table = rng.normal(0.0, 0.3, (vocab, vocab)) - 2.0
    for v in range(vocab):
        if v < period:
            table[v, [(v + 1) % period, (v - 1) % period, (v - 2) % period]] += [5.0, 3.5, 3.0]
        else:
            table[v, rng.choice(period, 3, replace=False)] += [5.0, 3.5, 3.0]
    return table.astype(np.float32)


def flat_table(vocab: int = 12, seed: int = 0) -> np.ndarray:
    """[V, V] bigram logits that barely depend on the last token: tokens 3, 7, 9 at 2.0, 1.5, 1.0 and the rest
    at -2, every entry + N(0, 1) noise (a drafter that ignores the context is often right, not always)."""
    unigram = np.full(vocab, -2.0)
    unigram[[3, 7, 9]] = [2.0, 1.5, 1.0]
    return (unigram[None] + np.random.default_rng(seed).normal(0.0, 1.0, (vocab, vocab))).astype(np.float32)


@dataclass
class Scenario:
    """A target, a prompt and sampling parameters, with the exact joint of the first `joint.k` tokens.

    Attributes:
        name: for messages.
        target: the mlx-lm target model.
        table: the bigram table the target was built from ([V, V]).
        prompt: token ids.
        params: SamplingParams (temperature, top-k, top-p, repetition penalty on).
        joint: the exact joint of the first K_MAX tokens.
    """

    name: str
    target: nn.Module
    table: np.ndarray
    prompt: List[int]
    params: SamplingParams
    joint: Joint
    _fits: Dict[Tuple[int, int], Tuple[Fit, Floor]] = field(default_factory=dict)

    def fit(self, k: int, n: int) -> Tuple[Fit, Floor]:
        """The Fit of the first k tokens and its noise floor for n samples (computed once)."""
        if (k, n) not in self._fits:
            fit = Fit(self.joint.head(k))
            self._fits[(k, n)] = (fit, fit.floor(n))
        return self._fits[(k, n)]


#: the longest joint the scenarios enumerate: a draft of 8 and the token after it
K_MAX = 9


@lru_cache(maxsize=None)
def cycle_scenario(make_tiny: Callable) -> Scenario:
    """A target that walks the cycle 0..9 (cycle_table) and a prompt holding one turn of it and its start, so that
    prompt lookup proposes 8 tokens; temperature 0.8, top-k 3, top-p 0.9 (which cuts the support below 3 at some
    positions), repetition penalty 1.5 over the last 3 tokens (which holds the cycle's two alternatives)."""
    table = cycle_table()
    target = chain_target(make_tiny, table, seed=3, mix=3.0)
    prompt = list(range(10)) + [0, 1, 2]
    params = SamplingParams(temperature=0.8, top_k=3, top_p=0.9, repetition_penalty=1.5, repetition_context_size=3)
    return Scenario("cycle", target, table, prompt, params, exact_joint(target, prompt, params, K_MAX))


@lru_cache(maxsize=None)
def flat_scenario(make_tiny: Callable) -> Scenario:
    """A target whose distribution barely depends on the last token (flat_table) but on the penalized history:
    a block drafter that mostly ignores its context is accepted often, not always, up to 8 tokens deep;
    temperature 1, top-k 3, top-p 0.9, min-p 0.1, repetition penalty 1.5 over the last 3 tokens."""
    table = flat_table()
    target = chain_target(make_tiny, table, seed=4, mix=3.0)
    prompt = [3, 7, 9, 3, 7, 1, 2]
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.5,
                            repetition_context_size=3)
    return Scenario("flat", target, table, prompt, params, exact_joint(target, prompt, params, K_MAX))


def speculative_samples(scenario: Scenario, make_drafter: Callable[[], Drafter], gamma: int,
                        n: int) -> Tuple[np.ndarray, SpecStats]:
    """[n, gamma + 1] first tokens of speculative sampling with a fixed draft length gamma, seeds 0..n-1 (a
    fresh drafter per request), and the SpecStats of all n requests together."""
    stats = SpecStats()
    out = np.zeros((n, gamma + 1), dtype=np.int64)
    for seed in range(n):
        out[seed] = list(speculative_tokens(scenario.target, scenario.prompt, scenario.params.with_(seed=seed),
                                            gamma + 1, make_drafter(), gamma, stats))
    return out, stats


def assert_chain_exercised(stats: SpecStats, gamma: int, depth: Optional[int] = None, least: int = 10) -> None:
    """Drafts of `depth` (default gamma) tokens were proposed, and at every draft position 2..depth at least
    `least` rounds accepted up to it and at least `least` rejected by then (SpecStats.accepted[i] counts the
    rounds whose first i + 1 draft tokens were all accepted)."""
    depth = gamma if depth is None else depth
    assert len(stats.proposed) >= depth, (depth, stats.proposed)
    for i in range(1, depth):
        accepted, rejected = stats.accepted[i], stats.proposed[i] - stats.accepted[i]
        assert accepted >= least and rejected >= least, (i + 1, stats.proposed, stats.accepted)


def check_lossless(scenario: Scenario, make_drafter: Callable[[], Drafter], gamma: int, n: int,
                   depth: Optional[int] = None) -> None:
    """Sample n requests of gamma + 1 tokens with a fixed draft length gamma; assert that the accept/reject
    chain ran (assert_chain_exercised) and that the samples fit the exact joint within its noise floor."""
    samples, stats = speculative_samples(scenario, make_drafter, gamma, n)
    fit, floor = scenario.fit(gamma + 1, n)
    z, detail = fit.judge(samples, floor)
    assert z < floor.limit, (f"{scenario.name}, gamma {gamma}: largest standardized statistic {z:.2f} > floor "
                             f"{floor.limit:.2f}", detail, stats.acceptance)
    assert_chain_exercised(stats, gamma, depth)
