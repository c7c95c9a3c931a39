"""sampling.top_p_filter keeps exactly the tokens mlx-lm's apply_top_p keeps, by partial selection where that
is exact and by apply_top_p's own sort where it is not."""

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_top_p

from mlx_infer.defaults import TOP_P_CANDIDATES
from mlx_infer.generation import sampling
from mlx_infer.generation.sampling import top_p_filter


def _logprobs(seed: int, scale: float, vocab: int) -> mx.array:
    x = mx.array(np.random.default_rng(seed).standard_normal((1, vocab)).astype(np.float32) * scale)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(0.5, 12.0), top_p=st.floats(0.01, 0.99),
       vocab=st.sampled_from([1000, 49152]))
def test_top_p_filter_keeps_apply_top_ps_tokens(seed, scale, top_p, vocab):
    lp = _logprobs(seed, scale, vocab)
    expected, got = np.array(apply_top_p(lp, top_p)), np.array(top_p_filter(lp, top_p))
    assert np.array_equal(expected, got)


def test_peaked_logits_take_the_partial_selection(monkeypatch):
    """A peaked distribution (a model's usual) is decided among the candidates: the full sort never runs."""
    lp = _logprobs(7, 10.0, 49152)
    expected = np.array(apply_top_p(lp, 0.9))
    monkeypatch.setattr(sampling, "apply_top_p", lambda *a: (_ for _ in ()).throw(AssertionError("sorted")))
    assert np.array_equal(np.array(top_p_filter(lp, 0.9)), expected)
    assert np.isfinite(expected).sum() <= TOP_P_CANDIDATES


def test_sampler_with_top_p_draws_what_mlx_lms_draws():
    from mlx_lm.sample_utils import make_sampler

    lp = _logprobs(3, 6.0, 49152)
    params = sampling.SamplingParams(temperature=0.7, top_p=0.8, seed=1)
    mx.random.seed(5)
    ours = [sampling.build_sampler(params)(lp).item() for _ in range(20)]
    mx.random.seed(5)
    theirs = [make_sampler(temp=0.7, top_p=0.8)(lp).item() for _ in range(20)]
    assert ours == theirs
