"""Structured outputs, logprobs and n through `mlx-infer serve` and the official openai client (issue 48):
`chat.completions.parse` with Pydantic models returns a parsed object every time; logprobs equal a
log-softmax computed here from mlx-lm's forward of the same tokens; n choices with seed + i; bad values are a
400 naming their field, before any decoding."""

import json
from enum import Enum
from typing import Annotated, List, Optional

import httpx
import jsonschema
import mlx.core as mx
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache
from pydantic import BaseModel, Field

#: Logprobs agree with the independent forward within this (float32 log-softmax of the same weights).
LOGPROB_TOL = 1e-3


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favorite_color: Color
    hobbies: List[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=3)
    address: Address
    nickname: Optional[str] = Field(default=None, max_length=12)


PERSON_PROMPTS = ["Describe a made-up person as JSON.", "Invent a character who lives in Paris.",
                  "Give me a profile of a retired teacher.", "Tell me about a young painter."]


def independent_logprobs(engine, prompt_ids, token_ids):
    """log-softmax rows [len(token_ids), V] of mlx-lm's forward of prompt + tokens on `engine`'s model (a
    fresh mlx-lm cache), the rows that score each generated token."""
    tokens = list(prompt_ids) + list(token_ids)
    logits = engine.model(mx.array([tokens]), cache=make_prompt_cache(engine.model))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logp[len(prompt_ids) - 1:len(tokens) - 1]


@pytest.mark.parametrize("prompt", PERSON_PROMPTS)
def test_parse_returns_a_parsed_object_every_time(server, prompt):
    url, _ = server
    r = client(url).chat.completions.parse(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                           response_format=Person, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())
    assert 1 <= len(choice.message.parsed.hobbies) <= 3 and len(choice.message.parsed.address.zip_code) == 5
    assert all(len(h) <= 20 for h in choice.message.parsed.hobbies)


def test_parse_sampled_with_a_seed_and_streamed_equals_whole(server):
    url, _ = server
    c = client(url)
    messages = [{"role": "user", "content": PERSON_PROMPTS[0]}]
    for seed in (1, 2, 3):
        r = c.chat.completions.parse(model="smollm2", messages=messages, response_format=Person, max_tokens=300,
                                     temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Person)
    whole = c.chat.completions.parse(model="smollm2", messages=messages, response_format=Person, max_tokens=300)
    with c.chat.completions.stream(model="smollm2", messages=messages, response_format=Person, max_tokens=300) as s:
        streamed = s.get_final_completion()
    assert streamed.choices[0].message.content == whole.choices[0].message.content
    assert streamed.choices[0].message.parsed == whole.choices[0].message.parsed


def test_json_object_mode(server):
    url, _ = server
    r = client(url).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"}, max_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # could not finish within max_tokens: the partial text, still the start of an object
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("response_format", [None, {"type": "json_object"}])
def test_chat_logprobs_equal_an_independent_log_softmax(server, reference, response_format):
    """The served logprobs (greedy, top 5) against mlx-lm's forward of the same tokens on the same weights:
    the raw model's distribution, also under a constraint (the mask does not change them)."""
    url, _ = server
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    extra = {"response_format": response_format} if response_format else {}
    r = client(url).chat.completions.create(model="smollm2", messages=messages, max_tokens=10, logprobs=True,
                                            top_logprobs=5, **extra)
    reference.reset()
    expected = reference.generate(messages, max_tokens=10, **extra)
    assert r.choices[0].message.content == expected.text
    content = r.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    logp = independent_logprobs(reference, reference.encode(messages), expected.token_ids)
    for j, (entry, token) in enumerate(zip(content, expected.token_ids)):
        assert entry.token == reference.decode([token]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - logp[j, token].item()) <= LOGPROB_TOL
        best = mx.argsort(-logp[j])[:5].tolist()
        assert len(entry.top_logprobs) == 5
        for alt, token_id in zip(entry.top_logprobs, best):
            assert abs(alt.logprob - logp[j, token_id].item()) <= LOGPROB_TOL
        if response_format is None:  # greedy without a mask: the chosen token is the most likely one
            assert abs(entry.top_logprobs[0].logprob - entry.logprob) <= LOGPROB_TOL
    streamed = [e for ch in client(url).chat.completions.create(model="smollm2", messages=messages, max_tokens=10,
                                                                logprobs=True, top_logprobs=5, stream=True, **extra)
                for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # (the prompt's KV now from the prefix cache)
    for got, want in zip(streamed, content):
        assert abs(got.logprob - want.logprob) <= LOGPROB_TOL and len(got.top_logprobs) == 5


def test_completions_legacy_logprobs(server, reference):
    url, _ = server
    prompt = "The capital of France is"
    r = client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=6, logprobs=3)
    reference.reset()
    expected = reference.generate(prompt, max_tokens=6, chat_template=False)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == expected.text and len(lp.tokens) == len(expected.token_ids)
    logp = independent_logprobs(reference, reference.encode(prompt, chat_template=False), expected.token_ids)
    offset = 0
    for j, token in enumerate(expected.token_ids):
        assert lp.tokens[j] == reference.decode([token])
        assert abs(lp.token_logprobs[j] - logp[j, token].item()) <= LOGPROB_TOL
        assert lp.tokens[j] in lp.top_logprobs[j] and 3 <= len(lp.top_logprobs[j]) <= 4
        assert lp.text_offset[j] == offset
        offset += len(lp.tokens[j])
    streamed = list(client(url).completions.create(model="smollm2", prompt=prompt, max_tokens=6, logprobs=3, stream=True))
    tokens = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_n_choices_with_a_seed(server):
    """n=2 sampled with a seed: choice i is the single request with seed + i; usage sums the completions and
    counts the prompt once; the stream interleaves the choices by index and assembles to the same texts."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Write a short poem about rain."}], max_tokens=16,
              temperature=0.9, seed=7)
    r = c.chat.completions.create(n=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1]
    singles = [c.chat.completions.create(**{**kw, "seed": 7 + i}) for i in range(2)]
    assert [ch.message.content for ch in r.choices] == [s.choices[0].message.content for s in singles]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(c.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw))
    texts, finishes = ["", ""], [None, None]
    for ch in chunks:
        for choice in ch.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [ch.message.content for ch in r.choices]
    assert finishes == [ch.finish_reason for ch in r.choices]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}]}, "tools", "name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "get_time"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"n": 9}, "n", "8"),
    ({"n": 0}, "n", "1"),
])
def test_bad_values_are_a_400_naming_the_field(server, body, param, needle):
    url, runner = server
    r = httpx.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 4, **body}, timeout=600)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert needle in error["message"] and "\n" not in error["message"]
    assert httpx.get(url + "/health").status_code == 200
