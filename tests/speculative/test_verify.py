"""Property tests of the accept/reject functions against straightforward references (hypothesis), and the
frequencies of what exact speculative sampling commits over many keys against the exact target distribution."""

import itertools

import mlx.core as mx
import numpy as np
import pytest
from distribution import Fit, Joint
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_infer.speculative.verify import probabilities, verify_greedy, verify_sampling

V = 6


@st.composite
def greedy_case(draw):
    g = draw(st.integers(0, 6))
    logits = draw(st.lists(st.lists(st.integers(-5, 5), min_size=V, max_size=V), min_size=g + 1, max_size=g + 1))
    logits = np.array(logits, dtype=np.float32) + np.arange(V, dtype=np.float32) * 1e-3  # no ties
    targets = logits.argmax(-1)
    # drafts that often agree with the target for a while
    agree = draw(st.integers(0, g))
    draft = [int(targets[i]) if i < agree else draw(st.integers(0, V - 1)) for i in range(g)]
    return draft, logits


def ref_greedy(draft, logits):
    t = logits.argmax(-1)
    n = 0
    while n < len(draft) and draft[n] == t[n]:
        n += 1
    return n, int(t[n])


@settings(max_examples=200, deadline=None)
@given(greedy_case())
def test_greedy_matches_reference(case):
    draft, logits = case
    n, tok = verify_greedy(mx.array(draft, dtype=mx.int32), mx.array(logits))
    assert (int(n.item()), int(tok.item())) == ref_greedy(draft, logits)


def _dist(draw, rows, zero_ok=True):
    out = []
    for _ in range(rows):
        w = np.array(draw(st.lists(st.integers(0 if zero_ok else 1, 9), min_size=V, max_size=V)), dtype=np.float64)
        if w.sum() == 0:
            w[draw(st.integers(0, V - 1))] = 1
        out.append(w / w.sum())
    return np.array(out, dtype=np.float32).reshape(rows, V)


@st.composite
def sampling_case(draw):
    g = draw(st.integers(0, 5))
    p = _dist(draw, g + 1)
    deterministic = draw(st.booleans())
    q = None if deterministic else _dist(draw, g)
    if q is None:
        draft = [draw(st.integers(0, V - 1)) for _ in range(g)]
    else:  # the drafter really sampled from q: only tokens with q > 0
        draft = [draw(st.sampled_from([int(x) for x in np.nonzero(q[i] > 0)[0]])) for i in range(g)]
    u = [draw(st.floats(0, 0.9999)) for _ in range(g)]  # float32 uniforms in [0, 1)
    return draft, p, q, np.array(u, dtype=np.float32)


def ref_sampling(draft, p, q, u):
    """(n, distribution of the next token) by the textbook rule (arXiv 2211.17192, Algorithm 1)."""
    for i, x in enumerate(draft):
        qi = np.eye(V)[x] if q is None else q[i].astype(np.float64)
        pi = p[i].astype(np.float64)
        if not u[i] < min(1.0, pi[x] / qi[x]):
            r = np.maximum(pi - qi, 0)
            return i, (r / r.sum() if r.sum() > 0 else pi)
    return len(draft), p[len(draft)].astype(np.float64)


@settings(max_examples=200, deadline=None)
@given(sampling_case(), st.integers(0, 2**31 - 1))
def test_sampling_matches_reference(case, seed):
    draft, p, q, u = case
    n, tok = verify_sampling(
        mx.array(draft, dtype=mx.int32), mx.array(p), None if q is None else mx.array(q), mx.array(u),
        key=mx.random.key(seed),
    )
    n_ref, dist = ref_sampling(draft, p, q, u)
    # float32 vs float64 only matters when u sits on the boundary p/q
    boundary = any(abs(u[i] * (1 if q is None else q[i][x]) - p[i][x]) < 1e-6 for i, x in enumerate(draft))
    if not boundary:
        assert int(n.item()) == n_ref
        assert dist[int(tok.item())] > 0, "the recovered / bonus token must come from the reference distribution"


def test_recovered_token_distribution():
    """With fixed p, q the first committed token is distributed as p (the whole point of the residual)."""
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]], np.float32)
    q = np.array([[0.1, 0.6, 0.1, 0.2]], np.float32)
    N = 20000
    rng = np.random.default_rng(0)
    draft = rng.choice(4, size=N, p=q[0])
    firsts = []
    keys = mx.random.split(mx.random.key(1), N)
    for i in range(N):
        n, tok = verify_sampling(mx.array([int(draft[i])], mx.int32), mx.array(p), mx.array(q), key=keys[i])
        firsts.append(int(draft[i]) if int(n.item()) == 1 else int(tok.item()))
    freq = np.bincount(firsts, minlength=4) / N
    assert np.abs(freq - p[0]).sum() / 2 < 0.02, freq


def _target_and_draft(g, seed):
    """Fixed p [g+1, V] (a zero per row: masked tokens), q [g, V] (a zero per row, and mass where p is 0)
    and r [g, V], the distribution a deterministic drafter's tokens come from (q None: verify treats it as
    one-hot)."""
    rng = np.random.default_rng(seed)

    def rows(n):
        d = rng.dirichlet(np.ones(V), n)
        d[np.arange(n), rng.integers(0, V, n)] = 0
        return (d / d.sum(axis=1, keepdims=True)).astype(np.float32)

    return rows(g + 1), rows(g), rows(g)


def _committed(p, q, r, trials, seed):
    """[trials, g+1] tokens from rounds of verify_sampling until g + 1 tokens are committed per trial. Position
    i's target distribution is p[i] whatever came before, and the drafter draws the token at position i from
    q[i] (or from r[i] for a deterministic drafter, q None), independently per trial: a round starting at
    position s verifies a fresh draft of positions s..g-1 against p[s:], commits its n accepted tokens and the
    next token, and the next round starts at s + n + 1 (the last round drafts nothing: a bonus token)."""
    g = p.shape[0] - 1
    rng = np.random.default_rng(seed)
    out = np.full((trials, g + 1), -1)
    start = np.zeros(trials, dtype=np.int64)
    for _ in range(g + 1):
        for s in np.unique(start[start <= g]):
            rows = np.nonzero(start == s)[0]
            source = np.cumsum(r[s:] if q is None else q[s:], axis=1)  # [g - s, V] CDFs
            u = rng.random((rows.size, g - s, 1))
            draft = np.minimum((u > source[None]).sum(axis=2), V - 1)  # [n, g - s] inverse-CDF draws
            ps, qs = mx.array(p[s:]), None if q is None else mx.array(q[s:])
            one = mx.vmap(lambda d, k: verify_sampling(d, ps, qs, key=k), in_axes=(0, 0))
            keys = mx.random.split(mx.random.key(int(rng.integers(2**31))), rows.size)
            n, tok = one(mx.array(draft, dtype=mx.int32), keys)
            n, tok = np.array(n), np.array(tok)
            i, j = np.nonzero(np.arange(g - s)[None] < n[:, None])  # the accepted prefix...
            out[rows[i], s + j] = draft[i, j]
            out[rows, s + n] = tok  # ...then the recovered / bonus token
            start[rows] += n + 1
    assert (start == g + 1).all() and (out >= 0).all()
    return out


@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sampling_frequencies(g, deterministic):
    """Rounds of verify_sampling commit g + 1 tokens jointly distributed as independent draws from p_1..p_{g+1}
    (the target's distributions, here history-independent), with drafts drawn from q (or any r for a
    deterministic drafter): the joint of all g + 1 tokens, every prefix of it and every position fit the exact
    product distribution within its noise floor (distribution.Fit: samples of the exact distribution itself)."""
    p, q, r = _target_and_draft(g, seed=g)
    trials = 20000
    out = _committed(p, None if deterministic else q, r, trials, seed=100 + g)
    seqs = np.array(list(itertools.product(range(V), repeat=g + 1)))  # lexicographic
    probs = np.prod(p[np.arange(g + 1), seqs].astype(np.float64), axis=1)  # [V^(g+1)]
    keep = probs > 0
    cond = np.broadcast_to(p.astype(np.float64), (int(keep.sum()), g + 1, V))
    fit = Fit(Joint(seqs[keep], probs[keep] / probs.sum(), cond))
    floor = fit.floor(trials)
    z, detail = fit.judge(out, floor)
    assert z < floor.limit, (z, floor.limit, detail)


def test_probabilities_are_softmax_with_masked_entries_zero():
    """probabilities (the CPU kernel's softmax where it runs): rows of a 49,152-token vocabulary with large
    logits and top-k style -inf masks equal NumPy's float64 softmax within 1e-4 of each probability
    (relative), masked entries exactly 0, each row summing to 1 within 1e-4."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 49152)) * 4 + 30).astype(np.float32)
    x[1, 100:40000] = -np.inf
    x[2, :-3] = -np.inf  # three tokens left
    got = np.array(probabilities(mx.array(x)))
    shifted = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    want = shifted / shifted.sum(-1, keepdims=True)
    assert np.all(got[np.isinf(x)] == 0) and not np.isnan(got).any()
    live = want > 1e-30
    assert np.max(np.abs(got[live] - want[live]) / want[live]) < 1e-4
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-4)
