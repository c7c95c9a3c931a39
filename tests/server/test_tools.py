"""Tool calls through `mlx-infer serve` and the official openai client (issue 48): a round trip (call, tool
result, final answer) under tool_choice "required" and a named function, arguments that validate against the
tool's schema, and streamed tool-call deltas that assemble to the non-streamed call."""

import json

import jsonschema
import openai
import pytest

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def check_calls(message, names):
    """The message's calls: each names one of `names`, with arguments that validate against its schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_tool_round_trip(server, tool_choice, names):
    """One call (parallel_tool_calls false: with parallel calls allowed, the 135M model repeats its call until
    max_tokens), its result in the history, then the answer in text."""
    url, _ = server
    c = client(url)
    first = c.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                      parallel_tool_calls=False, max_tokens=200)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message, names)
    assert len(calls) == 1
    history = QUESTION + [choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "18 degrees, sunny"})}
                for call in calls]
    final = c.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, tool_choice="none", max_tokens=40)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str) and answer.message.content.strip()
    alone = c.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 10  # the call and its result are in the prompt


def test_one_call_without_parallel_calls(server):
    url, _ = server
    r = client(url).chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=200)
    assert len(check_calls(r.choices[0].message, set(SCHEMAS))) == 1


@pytest.mark.parametrize("tool_choice, parallel", [("required", True), ("required", False),
                                                   ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_streamed_tool_call_deltas_assemble_to_the_whole_answer(server, tool_choice, parallel):
    """Greedy: the stream's deltas (content, and per call index its id and name first, then its arguments in
    pieces) assemble to the non-streamed message, calls, content and finish reason alike."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
              max_tokens=200)
    whole = c.chat.completions.create(**kw).choices[0]
    calls: dict = {}
    finish, content = None, ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # its first delta: id, type and name
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and not delta.function.name
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason and content == (whole.message.content or "")
    assert whole.message.tool_calls
    streamed = [calls[i] for i in sorted(calls)]
    if finish == "length":  # cut by max_tokens: the stream has sent the cut-off last call, the answer leaves it out
        streamed = streamed[:len(whole.message.tool_calls)]
    assert streamed == [{"name": t.function.name, "arguments": t.function.arguments}
                        for t in whole.message.tool_calls]
    assert sorted(calls) == list(range(len(calls)))


def test_auto_may_answer_in_text_or_call(server):
    """tool_choice auto: either text, or calls that parse and validate (the call is constrained once started)."""
    url, _ = server
    r = client(url).chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, max_tokens=120)
    choice = r.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message, set(SCHEMAS))
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
