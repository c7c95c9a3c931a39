"""Structured generation on plain decoding (generation/decode.py's _structured_tokens) with the default model:
outputs validated independently (jsonschema, re), forced spans against token-by-token decoding, logprobs
against mlx-lm's own forward, the kept KV after a stream closed inside a forced span."""

import json
import re

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.generation import decode
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.structured import lark, regex

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "minItems": 1,
                 "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                                  "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                 "required": ["city", "zip"], "additionalProperties": False},
        "nickname": {"type": "string", "maxLength": 8},
    },
    "required": ["name", "color", "tags", "home"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
PROMPT = "Describe a person as JSON."


def test_json_schema_output_validates(default_engine):
    result = default_engine.generate(PROMPT, max_tokens=80, response_format=FORMAT)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), SCHEMA)


def test_sampled_json_schema_output_validates(default_engine):
    result = default_engine.generate(PROMPT, max_tokens=80, response_format=FORMAT, temperature=0.8, top_p=0.9,
                                     seed=3)
    assert result.finish_reason == "stop", result.text
    jsonschema.validate(json.loads(result.text), SCHEMA)


def test_regex_output_fullmatches(default_engine):
    pattern = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    result = default_engine.generate("When was the Eiffel tower built?", max_tokens=20,
                                     response_format=regex(pattern))
    assert result.finish_reason == "stop"
    assert re.fullmatch(pattern, result.text), result.text


def test_lark_grammar_output(default_engine):
    grammar = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z ]{1,20}/'
    result = default_engine.generate("Is the sky blue?", max_tokens=20, response_format=lark(grammar))
    assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}", result.text), result.text


def test_json_object_parses(default_engine):
    result = default_engine.generate("Give me a JSON object about a cat.", max_tokens=60,
                                     response_format={"type": "json_object"})
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict)
    else:
        assert result.text.startswith("{")


def _count_forwards(engine, monkeypatch, **kwargs):
    """(result, model forwards) of one request from an empty cache, the model run uncompiled so that every
    forward is a call of the model."""
    calls = []
    model_type = type(engine.model)
    original = model_type.__call__

    def counted(self, *args, **kw):
        calls.append(1)
        return original(self, *args, **kw)

    monkeypatch.setattr(decode.CompiledDecode, "applies", staticmethod(lambda model, cache: False))
    monkeypatch.setattr(model_type, "__call__", counted)
    engine.reset()
    try:
        result = engine.generate(PROMPT, max_tokens=80, response_format=FORMAT, **kwargs)
    finally:
        monkeypatch.setattr(model_type, "__call__", original)
    return result, len(calls)


def test_forced_spans_take_fewer_forwards(default_engine, monkeypatch):
    on, forwards_on = _count_forwards(default_engine, monkeypatch, forced_spans=True)
    off, forwards_off = _count_forwards(default_engine, monkeypatch, forced_spans=False)
    for result in (on, off):
        assert result.finish_reason == "stop", result.text
        jsonschema.validate(json.loads(result.text), SCHEMA)
    # JSON's keys and punctuation are forced: they go into the forward of the token before them
    assert forwards_on < forwards_off
    assert forwards_off >= len(off.token_ids)  # one forward per token without forced spans


def test_max_tokens_too_small_ends_with_length(default_engine):
    result = default_engine.generate(PROMPT, max_tokens=5, response_format=FORMAT)
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 5
    assert result.text.startswith('{"name":"')


def test_unsupported_keyword_is_named(default_engine):
    from mlx_infer.structured.constraint import ConstraintError

    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    with pytest.raises(ConstraintError, match="uniqueItems") as err:
        default_engine.generate(PROMPT, max_tokens=5,
                                response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert err.value.param == "response_format"


def _reference_logprobs(engine, prompt_ids, tokens):
    """log-softmax of mlx-lm's forward over prompt + tokens, the rows that predict each token: [n, V]."""
    cache = make_prompt_cache(engine.model)
    ids = list(prompt_ids) + list(tokens)
    logits = engine.model(mx.array(ids)[None], cache=cache)[0].astype(mx.float32)
    rows = logits[len(prompt_ids) - 1:len(ids) - 1]
    return rows - mx.logsumexp(rows, axis=-1, keepdims=True)


@pytest.mark.parametrize("constrained", [False, True])
def test_logprobs_match_an_independent_forward(default_engine, constrained):
    kwargs = {"response_format": FORMAT} if constrained else {}
    result = default_engine.generate(PROMPT, max_tokens=30, logprobs=3, **kwargs)
    assert [lp.token for lp in result.logprobs] == result.token_ids
    ref = _reference_logprobs(default_engine, default_engine.encode(PROMPT), result.token_ids)
    for i, lp in enumerate(result.logprobs):
        assert lp.logprob == pytest.approx(ref[i, lp.token].item(), abs=2e-3)
        values = [v for _, v in lp.top]
        assert len(lp.top) == 3 and values == sorted(values, reverse=True)
        for token, value in lp.top:
            assert value == pytest.approx(ref[i, token].item(), abs=2e-3)
        if not constrained:  # greedy, unconstrained: the chosen token is the argmax
            assert lp.top[0][0] == lp.token


def test_zero_top_logprobs(default_engine):
    result = default_engine.generate(PROMPT, max_tokens=4, logprobs=0)
    assert len(result.logprobs) == 4 and all(lp.top == [] and lp.logprob <= 0 for lp in result.logprobs)


def test_closed_inside_a_forced_span_keeps_what_was_delivered(default_engine):
    """A stream stopped inside a forced span (after '{"' and 'name', with '":"' in the same forward) leaves the
    kept KV holding the prompt and the delivered tokens only: the next request reuses them (its cached prompt
    tokens) and decodes what a fresh engine decodes."""
    default_engine.reset()
    fresh = default_engine.generate(PROMPT, max_tokens=40, response_format=FORMAT)
    default_engine.reset()
    steps = default_engine.stream_steps(PROMPT, max_tokens=40, response_format=FORMAT)
    first = [next(steps).token for _ in range(2)]
    steps.close()
    assert [default_engine.decode([t]) for t in fresh.token_ids[:3]] == ['{"', "name", '":"']
    assert first == fresh.token_ids[:2]
    again = default_engine.generate(PROMPT, max_tokens=40, response_format=FORMAT)
    assert again.stats.cached_prompt_tokens > 0
    assert again.token_ids == fresh.token_ids


def test_a_closed_stream_leaves_no_mask_pending(default_engine):
    """Closed mid-answer, plain decoding drops the mask it prefetched for the next pick (GrammarState.close):
    the mask thread, shared by every request, computes nothing for a request that has ended."""
    grammars = default_engine.grammars
    grammar = grammars.state(grammars.compile(regex("[a-z ]{40}")), forced_spans=True)
    prompt = default_engine.encode("Say something.")
    tokens = decode.plain_tokens(default_engine.model, prompt, SamplingParams(), 20, grammar=grammar)
    for _ in range(3):
        next(tokens)
    assert grammar.prefetched  # the next pick's mask is being computed while the forward runs
    tokens.close()
    assert not grammar.prefetched
