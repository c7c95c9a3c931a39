"""Tools without a model forward: validation errors naming their field, parsing and the stream reader
(hypothesis: any split of a text gives the events parse gives), the call grammar's language checked with
llguidance on the default model's tokenizer, and the prompts (SmolLM2's generic form, a Qwen-style template
with tool support)."""

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools

from mlx_infer.errors import RequestError
from mlx_infer.structured.constraint import ConstraintError, json_schema
from mlx_infer.tools import GENERIC, plan_tools
from mlx_infer.tools.parse import ToolStream, assemble

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


@pytest.fixture(scope="module")
def engine(default_engine):
    return default_engine


def plan(engine, choice="auto", parallel=True, tools=TOOLS):
    return plan_tools(engine.tokenizer, tools, choice, parallel, grammars=engine.grammars)


# ---- validation ----

@pytest.mark.parametrize("tools, needle", [
    ([], "non-empty list"),
    ({"type": "function"}, "non-empty list"),
    ([{"type": "retrieval"}], "tools[0] must be"),
    ([{"type": "function"}], 'needs "function"'),
    ([{"type": "function", "function": {"description": "x"}}], "has no name"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "'bad name!'"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "1-64 letters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "parameters must be"),
    ([WEATHER, WEATHER], "twice"),
])
def test_bad_tools_name_the_tools_field(engine, tools, needle):
    with pytest.raises(RequestError) as e:
        plan(engine, tools=tools)
    assert e.value.param == "tools" and needle in str(e.value)
    assert "\n" not in str(e.value)


def test_a_bad_parameters_schema_is_a_constraint_error_naming_the_tool(engine):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "strin"}}}}}
    with pytest.raises(ConstraintError) as e:
        plan(engine, tools=[WEATHER, bad])
    assert e.value.param == "tools" and "'f'" in str(e.value) and "strin" in str(e.value)
    with pytest.raises(ConstraintError):  # without the model's Grammars: llguidance checks it alone
        plan_tools(engine.tokenizer, [bad], "auto")


@pytest.mark.parametrize("choice, needle", [
    ("sometimes", "got 'sometimes'"),
    ({"type": "function", "function": {"name": "nope"}}, "'nope', which is not among the tools"),
    ({"type": "function"}, 'tool_choice must be'),
    (3, "tool_choice must be"),
])
def test_bad_tool_choice_names_tool_choice(engine, choice, needle):
    with pytest.raises(RequestError) as e:
        plan(engine, choice)
    assert e.value.param == "tool_choice" and needle in str(e.value)


def test_parallel_tool_calls_must_be_a_bool_and_tool_choice_needs_tools(engine):
    with pytest.raises(RequestError) as e:
        plan(engine, parallel="yes")
    assert e.value.param == "parallel_tool_calls"
    with pytest.raises(RequestError) as e:
        plan_tools(engine.tokenizer, None, "required")
    assert e.value.param == "tool_choice"
    assert plan_tools(engine.tokenizer, None, None) is None
    assert plan(engine, "none") is None


def test_named_choice_keeps_only_that_function(engine):
    p = plan(engine, {"type": "function", "function": {"name": "add"}})
    assert p.choice == "add" and '"const": "add"' in p.constraint.source
    assert "get_weather" not in p.constraint.source


# ---- parsing and streaming ----

CALL_W = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}\n</tool_call>'
CALL_A = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"x": "}"}}}\n</tool_call>'
CALL_SWAPPED = '<tool_call>\n{"arguments": {"a": 2, "b": 3}, "name": "add"}\n</tool_call>'


def test_parse_separates_content_and_calls(engine):
    p = plan(engine)
    content, calls = p.parse("Let me look.\n" + CALL_W + "\n" + CALL_A + "\n")
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("add", {"a": 1, "b": {"x": "}"}})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29 and calls[0].id != calls[1].id
    int(calls[0].id[5:], 16)
    # a body whose arguments come before its name is read whole by mlx-lm's json_tools parser
    content, calls = p.parse(CALL_SWAPPED)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    # text without calls is kept as it is; a broken call stays content
    assert p.parse("Plain answer. \n") == ("Plain answer. \n", [])
    assert p.parse("<tool_call>\nnot json\n</tool_call>")[1] == []


def test_stream_holds_back_a_possible_marker(engine):
    s = plan(engine).stream()
    assert [e.text for e in s.feed("Hi <tool")] == ["Hi"]
    events = s.feed('_call>\n{"name":"add","arguments":{"a":1')
    assert [(e.kind, e.name, e.text) for e in events] == [("call", "add", ""), ("arguments", "", '{"a":1')]
    events = s.feed(',"b":2}}\n</tool_call>') + s.finish()
    assert "".join(e.text for e in events if e.kind == "arguments") == ',"b":2}'
    s2 = plan(engine).stream()
    assert "".join(e.text for e in s2.feed("a <tool") + s2.finish()) == "a <tool"


CALL_W_SPACED = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}\n</tool_call>'


def test_a_repeated_call_ends_the_answer(engine):
    p = plan(engine)
    text = CALL_W + "\n" + CALL_A + "\n" + CALL_W_SPACED + "\nmore text " + CALL_A
    content, calls = p.parse(text)
    assert content == "" and [c.name for c in calls] == ["get_weather", "add"]
    assert p.ended(text) and not p.ended(CALL_W + "\n" + CALL_A) and not p.ended(CALL_W + "\n" + CALL_W[:-3])
    # the arguments differ: a new call
    other = CALL_W.replace("Paris", "Lyon")
    assert [json.loads(c.arguments)["city"] for c in p.parse(CALL_W + other)[1]] == ["Paris", "Lyon"]
    # a whole-parsed repeat (arguments before the name) ends it too
    assert len(p.parse(CALL_SWAPPED + CALL_SWAPPED)[1]) == 1 and p.ended(CALL_SWAPPED + CALL_SWAPPED)
    # the first call streams as it comes; a later call is held until its end marker
    s = p.stream()
    assert [e.kind for e in s.feed(CALL_W[:-12])] == ["call", "arguments"]
    assert s.feed("</tool_call>\n" + CALL_W[:-12]) == [] and s.feed("</tool_call> tail") == [] and s.ended
    assert s.finish() == []


def test_a_later_call_cut_off_is_dropped(engine):
    """max_tokens ends the text inside a second call (often the small model's repeat of its first): the call
    is not made and its markup is not content."""
    p = plan(engine)
    for cut in (CALL_W[:14], CALL_W[:30], CALL_A[:-13]):
        content, calls = p.parse(CALL_W + "\n" + cut)
        assert content == "" and [c.name for c in calls] == ["get_weather"], (cut, content)


TEXTS = ["Let me look.\n" + CALL_W + "\n" + CALL_A + "\n",
         CALL_W + "\n" + CALL_A + "\n" + CALL_W_SPACED + "\nafter " + CALL_A,  # a repeat ends the answer
         "x" + CALL_W + CALL_A + "\n" + CALL_W[:-13],  # a repeat cut before its end marker
         CALL_A + CALL_SWAPPED + CALL_SWAPPED + CALL_W,
         CALL_W, "No call here, only <tags> and < tool_call text.", CALL_SWAPPED + "\nDone.",
         "x " + CALL_A[:-5],  # cut by max_tokens inside the end marker
         "<tool_call>\n{\"name\":\"add\",\"argu"]


@settings(max_examples=300, deadline=None)
@given(which=st.integers(0, len(TEXTS) - 1), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_streamed_events_assemble_to_parse(tiny_plan, which, cuts):
    text = TEXTS[which]
    pieces, last = [], 0
    for c in sorted(min(c, len(text)) for c in cuts) + [len(text)]:
        pieces.append(text[last:c])
        last = c
    reader = tiny_plan.stream()
    events = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
    assert assemble(events) == tiny_plan.parse(text)
    assert all(e.text for e in events if e.kind != "call")  # no empty pieces


@pytest.fixture(scope="module")
def tiny_plan(engine):
    return plan(engine)


def test_parse_of_a_family_without_end_marker_reads_to_the_end():
    from mlx_lm.tool_parsers import mistral
    from mlx_infer.tools.formats import ToolFormat

    fmt = ToolFormat("mistral", mistral.tool_call_start, "", mistral.parse_tool_call, True)
    reader = ToolStream(fmt, TOOLS, lambda i: f"call_{i:024x}")
    events = reader.feed('Sure [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]') + reader.finish()
    content, calls = assemble(events)
    assert content == "Sure" and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]


# ---- the call grammar's language ----

def accepts(engine, constraint, text):
    """Whether llguidance takes the tokens of text under constraint and may end there."""
    m = llguidance.LLMatcher(engine.grammars.tokenizer, engine.grammars.compile(constraint))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_required_grammar_takes_valid_calls_only(engine):
    p = plan(engine, "required")
    assert accepts(engine, p.constraint, CALL_W)
    assert accepts(engine, p.constraint, CALL_W + "\n" + CALL_W.replace("Paris", "Oslo"))
    assert not accepts(engine, p.constraint, "Hello")
    assert not accepts(engine, p.constraint, CALL_W.replace('"c"', '"k"'))  # enum
    assert not accepts(engine, p.constraint, CALL_W.replace("get_weather", "get_time"))
    one = plan(engine, "required", parallel=False)
    assert not accepts(engine, one.constraint, CALL_W + "\n" + CALL_W)


def test_auto_grammar_lets_text_through_and_constrains_calls(engine):
    p = plan(engine, "auto")
    assert accepts(engine, p.constraint, "The weather is < 20 degrees; no <tool> needed.\nBye.")
    assert accepts(engine, p.constraint, "Checking. " + CALL_W)
    assert not accepts(engine, p.constraint, 'Checking. <tool_call>\n{"name":"nope","arguments":{}}\n</tool_call>')
    assert not accepts(engine, p.constraint, CALL_W + " and then some text")


def test_merge_with_a_response_format(engine):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    auto = plan(engine, "auto").merge(json_schema(schema))
    assert accepts(engine, auto, '{"answer":"hi"}') and accepts(engine, auto, CALL_W)
    assert not accepts(engine, auto, "free text")
    required = plan(engine, "required")
    assert required.merge(json_schema(schema)) == required.constraint
    from mlx_infer.structured.constraint import regex
    with pytest.raises(RequestError) as e:
        plan(engine, "auto").merge(regex("a+"))
    assert e.value.param == "response_format"


# ---- prompts ----

def test_smollm2_gets_the_generic_form(engine):
    p = plan(engine, "required")
    assert p.format is GENERIC or p.format.family == "generic"
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    text = engine.tokenizer.decode(engine._prompts.encode(history, tools=p))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions.")
    assert json.dumps(WEATHER["function"]) in system and json.dumps(ADD["function"]) in system
    assert "<|im_start|>assistant\n" + CALL_W + "<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    # the same history without tools (tool_choice "none") still renders its calls and results
    plain = engine.tokenizer.decode(engine._prompts.encode(history))
    assert CALL_W in plain and "You can call functions" not in plain


QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{%- for tool_call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tool_call.function.name }}\", "
    "\"arguments\": {{ tool_call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


@pytest.fixture(scope="module")
def qwen_style(engine):
    """The default model's tokenizer with a template that renders tools (mlx-lm reads it as json_tools)."""
    import copy

    hf = copy.deepcopy(engine.tokenizer._tokenizer)
    hf.chat_template = QWEN_STYLE
    return TokenizerWrapper(hf, tool_call_start=json_tools.tool_call_start, tool_call_end=json_tools.tool_call_end,
                            tool_parser=json_tools.parse_tool_call)


def test_a_template_with_tools_renders_them_itself(qwen_style, engine):
    from mlx_infer.generation.prompt import PromptCodec

    p = plan_tools(qwen_style, TOOLS, "auto")
    assert p.format.native and p.format.family == "json_tools"
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city":"Paris","unit":"c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    text = qwen_style.decode(PromptCodec(qwen_style, engine.vocab_size).encode(history, tools=p))
    assert text.startswith("<|im_start|>system\nTools:" + json.dumps(WEATHER))
    assert "You can call functions" not in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n18C\n</tool_response>" in text
