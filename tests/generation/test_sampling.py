"""Sampling parameters: validation, errors a user can cause, reproducible seeded sampling, and the
distribution plain decoding's token pick draws from."""

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from mlx_infer import MlxInferError, SamplingParams
from mlx_infer.generation.sampling import build_sampler, pick_token


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": -0.2}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"min_p": 1.0}, r"min_p must be in \[0, 1\)"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\)"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"repetition_context_size": 0}, "repetition_context_size must be an integer >= 1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": True}, "max_tokens must be an integer >= 1"),
        ({"seed": -3}, r"seed must be an integer in \[0, 2\*\*64\)"),
        ({"seed": 2 ** 64}, r"seed must be an integer in \[0, 2\*\*64\)"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"temperature": math.inf}, "finite"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(MlxInferError, match=match) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_good_parameters_and_with_():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1, stop="END")
    assert p.stop == ("END",) and not p.greedy and SamplingParams().greedy
    q = p.with_(temperature=0)
    assert q.greedy and q.top_k == 40 and p.temperature == 0.7
    with pytest.raises(MlxInferError, match="top_p"):
        p.with_(top_p=2)


def test_bad_parameters_through_engine(tiny_engine, fake_tokens):
    calls = fake_tokens([1, 2, 3])
    with pytest.raises(MlxInferError, match="temperature"):
        tiny_engine.generate("hello", temperature=-1)
    with pytest.raises(MlxInferError, match="top_p"):
        list(tiny_engine.stream("hello", top_p=0))
    assert calls == []  # rejected before any decoding


@pytest.mark.parametrize("prompt", ["", "   \n\t", []])
def test_empty_prompt(tiny_engine, prompt):
    with pytest.raises(MlxInferError, match="empty"):
        tiny_engine.generate(prompt)


def test_bad_messages(tiny_engine):
    with pytest.raises(MlxInferError, match="role"):
        tiny_engine.generate([{"content": "hi"}])


def test_prompt_longer_than_context(tiny_engine, monkeypatch):
    monkeypatch.setitem(tiny_engine.config, "max_position_embeddings", 8)
    assert tiny_engine.context_length == 8
    with pytest.raises(MlxInferError, match="context window is 8") as info:
        tiny_engine.generate("the quick brown fox jumps over the lazy dog", chat_template=False)
    assert "\n" not in str(info.value)


def test_max_tokens_capped_by_context(tiny_engine, monkeypatch, fake_tokens):
    monkeypatch.setitem(tiny_engine.config, "max_position_embeddings", 12)
    prompt_ids = tiny_engine.encode("hello there", chat_template=False)
    calls = fake_tokens([100] * 50)
    result = tiny_engine.generate("hello there", chat_template=False, max_tokens=50)
    assert calls[0][1] == 12 - len(prompt_ids)
    assert len(result.token_ids) == 12 - len(prompt_ids) and result.finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_engine):
    kw = dict(temperature=1.5, top_p=0.95, max_tokens=12, chat_template=False)
    a = tiny_engine.generate("hello there", seed=7, **kw).token_ids
    b = tiny_engine.generate("hello there", seed=7, **kw).token_ids
    c = tiny_engine.generate("hello there", seed=8, **kw).token_ids
    greedy = tiny_engine.generate("hello there", max_tokens=12, chat_template=False).token_ids
    assert a == b
    assert len(a) == 12  # the tiny vocabulary's EOS is a special token random weights rarely pick
    assert a != c or a != greedy  # sampling actually samples


def test_sampling_options_run(tiny_engine):
    r = tiny_engine.generate("hello", temperature=0.8, top_k=5, min_p=0.1, repetition_penalty=1.3,
                             seed=0, max_tokens=6, chat_template=False)
    assert 1 <= len(r.token_ids) <= 6


def test_top_k_one_is_greedy(tiny_engine):
    greedy = tiny_engine.generate("hello", max_tokens=8, chat_template=False).token_ids
    topk1 = tiny_engine.generate("hello", temperature=1.0, top_k=1, seed=3, max_tokens=8, chat_template=False).token_ids
    assert topk1 == greedy


def test_an_unknown_sampling_option_is_one_line_naming_the_options():
    """engine.generate(..., max_token=10) reaches SamplingParams.with_: one MlxInferError naming the fields,
    not dataclasses' TypeError about SamplingParams.__init__."""
    with pytest.raises(MlxInferError, match=r"unknown option 'max_token'; the sampling options are .*max_tokens"):
        SamplingParams().with_(max_token=10)
    assert SamplingParams().with_(max_tokens=10).max_tokens == 10


#: One row of logits, shifted far from 0: exp() of the unnormalized row overflows float32, so a top-p mask
#: given it without the log-softmax would break.
ROW = np.array([2.0, 1.5, 1.2, 0.3, -0.1, -0.4, -1.0, -2.5], dtype=np.float32) + 100.0


@pytest.mark.parametrize("kwargs", [{"temperature": 0.8}, {"temperature": 1.3, "top_k": 5, "min_p": 0.05},
                                    {"temperature": 0.7, "top_p": 0.8}])
def test_pick_token_draws_the_filtered_softmax(kwargs):
    """pick_token (plain decoding's draw: mlx-lm's sampler, given the log-softmax only for top-p): 20,000
    draws from ROW hit each token as often as the exact distribution says, within 4 standard errors. The
    expectation: mlx-lm's own filters (top-p, min-p, top-k, in make_sampler's order) on the row's
    log-softmax computed in float64 NumPy, then a NumPy softmax at the temperature."""
    params = SamplingParams(**kwargs)
    logprobs = ROW.astype(np.float64) - np.log(np.exp(ROW.astype(np.float64) - ROW.max()).sum()) - ROW.max()
    kept = mx.array(logprobs.astype(np.float32))[None]
    if 0 < params.top_p < 1:
        kept = apply_top_p(kept, params.top_p)
    if params.min_p:
        kept = apply_min_p(kept, params.min_p)
    if params.top_k:
        kept = apply_top_k(kept, params.top_k)
    scaled = np.array(kept[0]).astype(np.float64) / params.temperature
    want = np.exp(scaled - scaled.max())
    want /= want.sum()
    n = 20000
    mx.random.seed(5)
    drawn = np.array(pick_token(mx.broadcast_to(mx.array(ROW)[None], (n, ROW.size)), params, build_sampler(params)))
    got = np.bincount(drawn, minlength=ROW.size) / n
    assert np.all(np.abs(got - want) <= 4 * np.sqrt(want * (1 - want) / n) + 1e-9), (got, want)
    assert (want == 0).sum() == {0.8: 0, 1.3: 3, 0.7: 5}[params.temperature]  # the filters did cut
