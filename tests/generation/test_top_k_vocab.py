"""top_k against the vocabulary: above it is bad input (before any forward), equal to it keeps every
token (the same as no top-k, which mlx-lm's apply_top_k cannot take as k == V)."""

import mlx.core as mx
import pytest

from mlx_infer import MlxInferError, SamplingParams
from mlx_infer.generation import compiled
from mlx_infer.generation.sampling import build_sampler

V = 100


def test_top_k_above_the_vocabulary_is_refused():
    with pytest.raises(MlxInferError) as info:
        SamplingParams(temperature=0.7, top_k=V + 1).for_vocab(V)
    message = str(info.value)
    assert "\n" not in message
    assert f"vocabulary size ({V})" in message and "0 keeps all" in message


def test_top_k_equal_to_the_vocabulary_keeps_all():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=V, min_p=0.05, seed=3, max_tokens=9, stop="END")
    q = p.for_vocab(V)
    assert q.top_k == 0
    assert q == p.with_(top_k=0)  # every other field as it was
    assert p.top_k == V  # the original is not changed


@pytest.mark.parametrize("top_k", [0, 1, 40, V - 1])
def test_top_k_below_the_vocabulary_is_kept(top_k):
    p = SamplingParams(temperature=0.7, top_k=top_k)
    assert p.for_vocab(V).top_k == top_k


def test_keep_all_samples_the_full_distribution():
    """With top_k == V mlx-lm's sampler refuses; the for_vocab copy samples every token, each about
    as often as its probability (uniform logits here: 4000 draws over 100 tokens)."""
    p = SamplingParams(temperature=1.0, top_k=V)
    logprobs = mx.zeros((1, V)) - mx.log(mx.array(float(V)))
    with pytest.raises(ValueError):
        build_sampler(p)(logprobs)
    sampler = build_sampler(p.for_vocab(V))
    mx.random.seed(0)
    draws = [sampler(logprobs).item() for _ in range(4000)]
    counts = [draws.count(t) for t in range(V)]
    assert min(counts) > 0  # every token can be drawn: nothing was cut
    assert max(counts) < 80  # 40 expected per token; 80 is > 6 standard deviations away


def count_forwards(monkeypatch, engine) -> list:
    """Record each call of the engine's model (one entry per forward). One-token steps then run the model's
    Python every time (a compiled step replays its trace without calling the model: generation/compiled.py)."""
    monkeypatch.setattr(compiled.CompiledDecode, "applies", staticmethod(lambda model, cache: False))
    calls = []
    cls = type(engine.model)
    forward = cls.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__call__", counted)
    return calls


def test_engine_top_k_equal_to_the_vocabulary(tiny_engine):
    """Needs the engine to call SamplingParams.for_vocab once per request."""
    vocab = tiny_engine.config["vocab_size"]
    result = tiny_engine.generate("hello", temperature=0.7, top_k=vocab, seed=0, max_tokens=4, chat_template=False)
    assert 1 <= len(result.token_ids) <= 4
    assert all(0 <= t < vocab for t in result.token_ids)


def test_engine_top_k_above_the_vocabulary_fails_before_any_forward(tiny_engine, monkeypatch):
    """Needs the engine to call SamplingParams.for_vocab once per request."""
    vocab = tiny_engine.config["vocab_size"]
    forwards = count_forwards(monkeypatch, tiny_engine)
    for speculative in ("off", "lookup"):
        with pytest.raises(MlxInferError, match=rf"vocabulary size \({vocab}\)"):
            tiny_engine.generate("hello", temperature=0.7, top_k=vocab + 1, max_tokens=4, chat_template=False,
                                 speculative=speculative)
    assert forwards == []
    tiny_engine.generate("hello", max_tokens=2, chat_template=False)
    assert forwards  # the counter does see the model's forwards
