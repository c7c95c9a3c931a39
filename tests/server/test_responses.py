"""POST /v1/responses through the official openai client (issue 49): greedy text equal to the chat completion of
the same conversation, the streamed event sequence (deltas join to the text, sequence numbers in order), a
function tool round trip (tool_choice required: a call whose arguments validate; its output -> a text answer),
a JSON schema through text.format, previous_response_id continuing a conversation (store: false not kept), and
bad bodies as 400s naming their field."""

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from mlx_infer.server.protocol import APIError
from mlx_infer.server.responses import ResponseStore, input_messages

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}]
QUESTION = "What is the weather like in Paris right now?"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)


def chat_text(c, messages, max_tokens):
    r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens)
    return r.choices[0], r.usage


def test_text_equals_the_chat_completion(server):
    """Greedy: instructions + input give the chat completion's text of system + user, its usage and its end."""
    url, _ = server
    c = client(url)
    r = c.responses.create(model="smollm2", instructions="Answer in one sentence.", input="Name three colors.",
                           max_output_tokens=12)
    choice, usage = chat_text(c, [{"role": "system", "content": "Answer in one sentence."},
                                  {"role": "user", "content": "Name three colors."}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "smollm2"
    assert r.output_text == choice.message.content and r.output_text
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens
    assert r.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_input_items_equal_chat_messages(server):
    """Message items with input_text / output_text parts read as the chat messages of the same text."""
    url, _ = server
    c = client(url)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi, I am Ada."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
             {"role": "user", "content": "What is my name?"}]
    r = c.responses.create(model="smollm2", input=items, max_output_tokens=10)
    choice, usage = chat_text(c, [{"role": "user", "content": "Hi, I am Ada."},
                                  {"role": "assistant", "content": "Hello Ada!"},
                                  {"role": "user", "content": "What is my name?"}], 10)
    assert r.output_text == choice.message.content and r.usage.input_tokens == usage.prompt_tokens


def test_streamed_events(server):
    """The events in the Responses order, numbered 0.., the deltas joining to the whole answer's text (greedy);
    the client's stream helper assembles the same text."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", input="Tell me about the sea.", max_output_tokens=12)
    whole = c.responses.create(**kw)
    events = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert types == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done", end])
    assert "".join(deltas) == whole.output_text == events[-4].text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.usage.output_tokens == whole.usage.output_tokens
    assert events[0].response.status == "in_progress" and last.status == whole.status
    assert events[2].item.id == events[-2].item.id == last.output[0].id
    with c.responses.stream(**kw) as stream:
        helper = [e for e in stream]
    assert "".join(e.delta for e in helper if e.type == "response.output_text.delta") == whole.output_text


def test_an_answer_cut_by_max_output_tokens_is_incomplete_with_its_item(server):
    """Cut by max_output_tokens: the response and its message item are "incomplete" (as OpenAI marks them), the
    item still carrying the text; streamed, output_item.done and the last response say the same."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", input="Write a long story about the sea.", max_output_tokens=3)
    whole = c.responses.create(**kw)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in whole.output] == ["incomplete"] and whole.output_text
    events = list(c.responses.create(stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.status for item in done] == ["incomplete"] and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]
    assert events[-1].response.output_text == whole.output_text


def test_function_tool_round_trip(server):
    """tool_choice required: one function_call item whose arguments validate; its output in the next input
    (the previous items sent back) gives a text answer; the streamed call's argument deltas join to the same
    arguments."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", input=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_output_tokens=200)
    first = c.responses.create(**kw)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    history = [{"role": "user", "content": QUESTION},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"result": "18 degrees, sunny"})}]
    final = c.responses.create(model="smollm2", input=history, tools=TOOLS, tool_choice="none", max_output_tokens=30)
    assert not [item for item in final.output if item.type == "function_call"]
    assert final.output_text.strip()
    chat = c.chat.completions.create(  # the same conversation in chat's shape: the same prompt and answer
        model="smollm2", tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                                for t in TOOLS], tool_choice="none", max_tokens=30,
        messages=[{"role": "user", "content": QUESTION},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": call.call_id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": history[2]["output"]}])
    assert final.usage.input_tokens == chat.usage.prompt_tokens and final.output_text == chat.choices[0].message.content
    events = list(c.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and types[-1] == "response.completed"
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert pieces == done[0].arguments == call.arguments
    assert [i.type for i in events[-1].response.output] == ["function_call"]


def test_json_schema_text_format(server):
    url, _ = server
    r = client(url).responses.create(
        model="smollm2", input="Describe a made-up person as JSON.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)


def test_parse_and_the_stream_helper_with_a_pydantic_model(server):
    """The client's responses.parse (text_format: a Pydantic model, sent as a strict json_schema) gives the parsed
    object; its stream helper's final response (response.completed) the same one (greedy)."""
    url, _ = server
    c = client(url)
    kw = dict(model="smollm2", input="Invent a pet as JSON.", max_output_tokens=40, text_format=Pet)
    parsed = c.responses.parse(**kw)
    assert isinstance(parsed.output_parsed, Pet) and parsed.status == "completed"
    with c.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and final.id.startswith("resp_")


def test_previous_response_id_continues_the_conversation(server):
    """The second response's prompt is the first's input and output then the new input: the chat completion of
    those three messages (its tokens and greedy text); instructions are not carried over."""
    url, _ = server
    c = client(url)
    first = c.responses.create(model="smollm2", instructions="Be brief.", input="My name is Ada. Say hello.",
                               max_output_tokens=8)
    second = c.responses.create(model="smollm2", previous_response_id=first.id, input="What is my name?",
                                max_output_tokens=8)
    choice, usage = chat_text(c, [{"role": "user", "content": "My name is Ada. Say hello."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "What is my name?"}], 8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == usage.prompt_tokens and second.output_text == choice.message.content
    third = c.responses.create(model="smollm2", previous_response_id=second.id, input="Thanks.", max_output_tokens=4)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


@pytest.mark.parametrize("previous", ["unstored", "resp_0123456789abcdef01234567"])
def test_unknown_or_unstored_previous_response_is_a_404(server, previous):
    url, _ = server
    c = client(url)
    if previous == "unstored":
        previous = c.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False).id
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model="smollm2", previous_response_id=previous, input="Hi again", max_output_tokens=2)
    error = e.value.body
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert error["type"] == "invalid_request_error" and previous in error["message"]


@pytest.mark.parametrize("extra, param", [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": []}, "input"),
    ({"truncation": "auto"}, "truncation"),
    ({"store": "yes"}, "store"),
])
def test_bad_bodies_are_400s_naming_the_field(server, extra, param):
    url, _ = server
    body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 2, **extra}
    r = httpx.post(url + "/v1/responses", json=body, timeout=600)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


def test_unknown_model_is_a_404(server):
    r = httpx.post(server[0] + "/v1/responses", json={"model": "gpt-9", "input": "Hi"}, timeout=600)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_function_calls_join_the_assistant_message_before_them():
    items = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Let me check."},
             {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"a\": 1}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "one"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]}]
    assert input_messages(items) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"}]


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(max_items=2, max_chars=10)
    store.put("a", [{"role": "user", "content": "1234"}])
    store.put("b", [{"role": "user", "content": "5678"}])
    assert store.get("a")[0]["content"] == "1234"  # a is now the most recent
    store.put("c", [{"role": "user", "content": "9"}])  # over 2 items: b goes
    assert len(store) == 2 and store.get("c")[0]["content"] == "9"
    with pytest.raises(APIError) as e:
        store.get("b")
    assert e.value.status == 404
    store.put("d", [{"role": "user", "content": "abcdefg"}])  # 4 + 1 + 7 chars > 10: the least recent (a) goes
    assert store.chars == 8 and len(store) == 2
    with pytest.raises(APIError):
        store.get("a")
    store.put("e", [{"role": "user", "content": "x" * 11}])  # over the bound alone: not kept
    assert len(store) == 2 and store.chars == 8
