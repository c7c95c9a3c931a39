"""The Anthropic Messages API through `mlx-infer serve` and the official anthropic client (issue 49): a message
equal to the chat completion's greedy text, its stream (text deltas and Anthropic's event order), a tool use
round trip (tool_choice any and a named tool: a tool_use block whose input validates, then a tool_result and a
text answer), stop sequences (stop_reason stop_sequence naming the one that matched), max_tokens,
count_tokens, the x-api-key header, and bad bodies answered in Anthropic's error shape."""

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from server_helpers import live_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER},
         {"name": "get_time", "description": "Current time in a timezone", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
SYSTEM = "You are a helpful assistant who answers in full sentences."
PROMPT = [{"role": "user", "content": "Tell me about the moon."}]


def client(url, key="none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=600)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_equals_the_chat_completion(server):
    """Greedy: the message's text, its stop reason and usage are the chat completion's (system string and
    system text blocks alike)."""
    url, _ = server
    chat = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600).chat.completions.create(
        model="smollm2", messages=[{"role": "system", "content": SYSTEM}] + PROMPT, max_tokens=24, temperature=0)
    m = client(url).messages.create(model="smollm2", system=SYSTEM, messages=PROMPT, max_tokens=24,
                                    extra_body={"temperature": 0, "top_k": 0, "top_p": 1})  # (the client's 2.x dropped them)
    assert m.type == "message" and m.role == "assistant" and m.model == "smollm2" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and text_of(m) == chat.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert m.stop_sequence is None
    assert (m.usage.input_tokens, m.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    blocks = client(url).messages.create(model="smollm2", system=[{"type": "text", "text": SYSTEM, "cache_control": {
        "type": "ephemeral"}}], messages=[{"role": "user", "content": [{"type": "text", "text": PROMPT[0]["content"]}]}],
        max_tokens=24)
    assert text_of(blocks) == text_of(m)


def test_stream_joins_to_the_message_in_anthropics_event_order(server):
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", system=SYSTEM, messages=PROMPT, max_tokens=24)
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text_of(whole) and len(pieces) > 1
    assert final.content[0].text == text_of(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = list(c.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens and events[0].message.content == []
    assert events[1].index == 0 and events[1].content_block.type == "text"
    assert "".join(e.delta.text for e in events[2:-3]) == text_of(whole)
    assert events[-2].delta.stop_reason == whole.stop_reason and events[-2].usage.output_tokens == whole.usage.output_tokens


def check_tool_use(message, names):
    """The message's tool_use blocks: each names one of `names`, with input that validates against its schema."""
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses, message
    for use in uses:
        assert use.id and use.name in names
        jsonschema.validate(use.input, SCHEMAS[use.name])
    return uses


@pytest.mark.parametrize("tool_choice, names", [
    ({"type": "any", "disable_parallel_tool_use": True}, {"get_weather", "get_time"}),
    ({"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}, {"get_time"}),
])
def test_tool_use_round_trip(server, tool_choice, names):
    """A forced call (one: with parallel calls allowed, the 135M model repeats its call until max_tokens), its
    tool_result in the next user message, then the answer in text."""
    url, _ = server
    c = client(url)
    first = c.messages.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
    assert first.stop_reason == "tool_use"
    uses = check_tool_use(first, names)
    assert len(uses) == 1
    history = QUESTION + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                        "content": json.dumps({"result": "18 degrees, sunny"})}]}]
    final = c.messages.create(model="smollm2", messages=history, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=40)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    assert text_of(final).strip()
    alone = c.messages.count_tokens(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice={"type": "none"})
    assert final.usage.input_tokens > alone.input_tokens + 10  # the call and its result are in the prompt


def test_streamed_tool_use_equals_the_whole_message(server):
    """Greedy: the stream's tool_use block (id and name at its start, then input_json_delta pieces) assembles to
    the non-streamed block's input, and the stop reason is the same."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", messages=QUESTION, tools=TOOLS, max_tokens=200,
              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    whole = c.messages.create(**kw)
    events = list(c.messages.create(stream=True, **kw))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == [b.type for b in whole.content]
    use = next(s for s in starts if s.content_block.type == "tool_use")
    assert use.content_block.name == "get_weather" and use.content_block.input == {}
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == check_tool_use(whole, {"get_weather"})[0].input
    assert events[-2].delta.stop_reason == whole.stop_reason == "tool_use"
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [b.input for b in whole.content
                                                                         if b.type == "tool_use"]


def test_stop_sequences_say_which_one_matched(server):
    """Two words of the greedy answer as a stop sequence (spanning tokens; beside one that never comes and one
    that shares its start): the text ends before them, stop_reason stop_sequence and stop_sequence those words;
    streamed, the message_delta says the same."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", system=SYSTEM, messages=PROMPT, max_tokens=40)
    full = text_of(c.messages.create(**kw))
    words = " ".join(full.split()[4:6])
    assert len(words) > 5 and full.index(words) > 0
    stops = ["#never#", words[:3] + "#", words]
    m = c.messages.create(stop_sequences=stops, **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == words
    assert text_of(m) == full[:full.index(words)]
    events = list(c.messages.create(stop_sequences=stops, stream=True, **kw))
    assert events[-2].delta.stop_reason == "stop_sequence" and events[-2].delta.stop_sequence == words
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text_of(m)
    plain = c.messages.create(stop_sequences=["#never#"], **kw)
    assert plain.stop_sequence is None and plain.stop_reason in ("end_turn", "max_tokens")


def test_max_tokens(server):
    url, _ = server
    m = client(url).messages.create(model="smollm2", messages=PROMPT, max_tokens=3)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3 and text_of(m)


def test_count_tokens_is_the_prompt_the_model_is_given(server):
    url, _ = server
    c = client(url)
    counted = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=PROMPT)
    sent = c.messages.create(model="smollm2", system=SYSTEM, messages=PROMPT, max_tokens=1)
    assert counted.input_tokens == sent.usage.input_tokens > 10
    with_tools = c.messages.count_tokens(model="smollm2", system=SYSTEM, messages=PROMPT, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens + 20  # the tools' schemas are in the prompt
    used = c.messages.create(model="smollm2", system=SYSTEM, messages=PROMPT, tools=TOOLS, max_tokens=1)
    assert used.usage.input_tokens == with_tools.input_tokens


def test_x_api_key(engine):
    """A server with an API key takes it as x-api-key (the anthropic client's header) or as a Bearer token;
    a wrong or missing key is a 401 in Anthropic's shape, on both routes."""
    with live_server(engine, api_key="s3cret") as (url, _):
        m = client(url, "s3cret").messages.create(model="smollm2", messages=PROMPT, max_tokens=2)
        assert m.usage.output_tokens == 2
        for call in (lambda c: c.messages.create(model="smollm2", messages=PROMPT, max_tokens=2),
                     lambda c: c.messages.count_tokens(model="smollm2", messages=PROMPT)):
            with pytest.raises(anthropic.AuthenticationError) as e:
                call(client(url, "wrong"))
            assert e.value.status_code == 401 and e.value.body["type"] == "error"
            assert e.value.body["error"]["type"] == "authentication_error"
            assert "x-api-key" in e.value.body["error"]["message"]
        bearer = httpx.post(url + "/v1/messages/count_tokens", headers={"Authorization": "Bearer s3cret"},
                            json={"model": "smollm2", "messages": PROMPT}, timeout=600)
        assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
        none = httpx.post(url + "/v1/messages", json={"model": "smollm2", "messages": PROMPT, "max_tokens": 2},
                          timeout=600)
        assert none.status_code == 401 and none.json()["error"]["type"] == "authentication_error"


GOOD = {"model": "smollm2", "messages": PROMPT, "max_tokens": 4}


@pytest.mark.parametrize("body, needle", [
    ({"model": "smollm2", "messages": PROMPT}, "'max_tokens' is required"),
    ({**GOOD, "max_tokens": 0}, "'max_tokens' must be an integer from 1"),
    ({**GOOD, "logit_bias": {}}, "unsupported field 'logit_bias'"),
    ({**GOOD, "temperature": 1.5}, "'temperature' must be a number from 0 to 1.0"),
    ({**GOOD, "messages": []}, "'messages' must be a non-empty list"),
    ({**GOOD, "messages": [{"role": "system", "content": "x"}]}, "the system prompt goes in 'system'"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "images and documents"),
    ({**GOOD, "messages": PROMPT + [{"role": "assistant", "content": "The moon is"}]}, "prefilled answer"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, "tool_use_id"),
    ({**GOOD, "tool_choice": {"type": "any"}}, "'tool_choice' needs 'tools'"),
    ({**GOOD, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among the tools"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({**GOOD, "tools": [{"name": "f"}]}, "needs 'input_schema'"),
    ({**GOOD, "stop_sequences": "x"}, "'stop_sequences' must be a list"),
    ({**GOOD, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "'thinking' is not supported"),
    ({**GOOD, "system": [{"type": "image"}]}, "system[0]: only text blocks"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_bodies_are_400s_in_anthropics_shape(server, body, needle):
    url, _ = server
    r = httpx.post(url + "/v1/messages", json=body, timeout=600)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert needle in r.json()["error"]["message"], r.json()


def test_bad_json_unknown_model_and_the_client_errors(server):
    url, _ = server
    r = httpx.post(url + "/v1/messages", content=b"{not json", timeout=600)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client(url).messages.create(model="claude-sonnet-4-5", messages=PROMPT, max_tokens=2)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client(url).messages.count_tokens(model="smollm2", messages=[{"role": "user", "content": 5}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
