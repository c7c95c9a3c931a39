"""Engine's structured-generation keywords (response_format, tools, tool_choice, parallel_tool_calls, logprobs,
forced_spans) on generate / stream / stream_steps / generate_batch / agenerate / astream: checked before any
decoding, the same outputs on every path."""

import asyncio
import json

import jsonschema
import pytest

from mlx_infer.errors import RequestError
from mlx_infer.structured import Grammars
from mlx_infer.structured.constraint import ConstraintError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
PROMPT = "The weather in a city, as JSON."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.mark.parametrize("kwargs, param", [
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": 2.0}, "logprobs"), ({"forced_spans": "yes"}, "forced_spans"),
    ({"response_format": {"type": "xml"}}, "response_format"), ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "nope"}}}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"), ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_options_raise_naming_the_field_before_decoding(default_engine, fake_tokens, kwargs, param):
    calls = fake_tokens([1, 2, 3])
    for call in (lambda: default_engine.generate(PROMPT, max_tokens=4, **kwargs),
                 lambda: default_engine.batch_request(PROMPT, max_tokens=4, **kwargs),
                 lambda: default_engine.generate_batch([PROMPT], max_tokens=4, **kwargs)):
        with pytest.raises(RequestError) as err:
            call()
        assert err.value.param == param
    assert calls == []  # nothing decoded


def test_constraint_errors_are_request_errors(default_engine):
    with pytest.raises(ConstraintError, match="uniqueItems"):
        default_engine.generate(PROMPT, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}})


def test_grammars_are_built_once(default_engine):
    assert isinstance(default_engine.grammars, Grammars)
    assert default_engine.grammars is default_engine.grammars
    assert default_engine.grammars.vocab == default_engine.vocab_size


def test_stream_steps_carry_logprobs_and_stream_the_constrained_text(default_engine):
    steps = list(default_engine.stream_steps(PROMPT, max_tokens=40, response_format=FORMAT, logprobs=2))
    tokens = [s for s in steps if s.token is not None]
    assert all(s.logprob is not None and s.logprob.token == s.token and len(s.logprob.top) == 2 for s in tokens)
    text = "".join(s.text for s in steps)
    assert steps[-1].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "".join(default_engine.stream(PROMPT, max_tokens=40, response_format=FORMAT)) == text


def test_batched_and_async_paths_give_the_plain_paths_answer(default_engine):
    plain = default_engine.generate(PROMPT, max_tokens=40, response_format=FORMAT, logprobs=1)
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    batched = default_engine.generate_batch([PROMPT, "Hello"], max_tokens=40, response_format=FORMAT, logprobs=1)
    assert batched[0].token_ids == plain.token_ids
    jsonschema.validate(json.loads(batched[1].text), SCHEMA)
    assert [lp.token for lp in batched[0].logprobs] == plain.token_ids
    for a, b in zip(batched[0].logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)

    async def both():
        result = await default_engine.agenerate(PROMPT, max_tokens=40, response_format=FORMAT)
        chunks = [c async for c in default_engine.astream(PROMPT, max_tokens=40, response_format=FORMAT)]
        return result, "".join(chunks)

    result, streamed = asyncio.run(both())
    assert result.token_ids == plain.token_ids and streamed == plain.text


def test_required_tool_call_ends_with_tool_calls(default_engine):
    result = default_engine.generate("What is the weather in Paris?", max_tokens=80, tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False)
    assert result.finish_reason == "tool_calls", result.text
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(result.tool_calls[0].arguments), TOOLS[0]["function"]["parameters"])


def test_tool_calls_cut_by_max_tokens_end_with_length(default_engine):
    """With parallel calls the model repeats its call until max_tokens: "length", not "tool_calls"."""
    result = default_engine.generate("What is the weather in Paris?", max_tokens=46, tools=TOOLS,
                                     tool_choice="required")
    assert result.finish_reason == "length"
    assert result.tool_calls and result.tool_calls[0].name == "get_weather"
    for call in result.tool_calls:  # a call cut off mid-arguments is not reported
        jsonschema.validate(json.loads(call.arguments), TOOLS[0]["function"]["parameters"])
    assert result.text.count("<tool_call>") > len(result.tool_calls)  # the last one was cut off


@pytest.mark.parametrize("batched", [False, True])
def test_a_repeated_call_ends_the_answer(default_engine, batched):
    """With parallel calls the small model repeats its call: the repeat ends the request at its end marker
    ("tool_calls", well before max_tokens) and is not reported."""
    kwargs = dict(tools=TOOLS, tool_choice="required", max_tokens=200)
    prompt = "What's the weather in Paris?"
    result = (default_engine.generate_batch([prompt], **kwargs)[0] if batched
              else default_engine.generate(prompt, **kwargs))
    assert result.finish_reason == "tool_calls", result.text
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert result.text.count("<tool_call>") == 2 and result.text.endswith("</tool_call>"), result.text
    assert result.stats.generated_tokens < 60


def test_tool_choice_none_is_a_plain_answer(default_engine):
    plain = default_engine.generate("What is the weather in Paris?", max_tokens=8)
    none = default_engine.generate("What is the weather in Paris?", max_tokens=8, tools=TOOLS, tool_choice="none")
    assert none.tool_calls == [] and none.finish_reason == "length"
    assert none.text == plain.text
