"""Tool calls decoded by the real default model (SmolLM2-135M) under the call grammar, through GrammarState
and a greedy loop of the model's own forward: under tool_choice "required" and a named function every call
parses and its arguments validate (jsonschema, an independent validator); "auto" leaves a plain answer as the
model writes it unconstrained."""

import json

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.structured.mask import apply_masks
from mlx_infer.tools import plan_tools

from test_tool_calls import TOOLS  # noqa: E402 (tests/tools is on sys.path: pytest prepends it)

PROMPTS = ["What is the weather in Paris, in celsius?", "Add 2 and 3.", "How warm is it in Tokyo today?",
           "What is 40 plus 2?"]


def greedy(engine, prompt_ids, grammar=None, max_tokens=80):
    """Greedy decoding of the model (masked by grammar, a GrammarState, when given): the generated ids, EOS
    excluded, and whether it stopped on EOS."""
    cache = make_prompt_cache(engine.model)
    eos = set(engine.tokenizer.eos_token_ids)
    logits = engine.model(mx.array([prompt_ids]), cache=cache)[:, -1, :]
    out = []
    for _ in range(max_tokens):
        if grammar is not None:
            logits = apply_masks(logits, [grammar.mask()])
        token = int(mx.argmax(logits, axis=-1).item())
        if grammar is not None:
            grammar.consume([token])
        if token in eos:
            return out, True
        out.append(token)
        logits = engine.model(mx.array([[token]]), cache=cache)[:, -1, :]
    return out, False


def schemas():
    return {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_required_and_named_calls_always_parse_and_validate(default_engine, choice):
    engine = default_engine
    for prompt in PROMPTS:
        plan = plan_tools(engine.tokenizer, TOOLS, choice, False, grammars=engine.grammars)
        ids = engine._prompts.encode([{"role": "user", "content": prompt}], tools=plan)
        grammar = engine.grammars.state(engine.grammars.compile(plan.constraint), forced_spans=False)
        out, stopped = greedy(engine, ids, grammar)
        text = engine.tokenizer.decode(out)
        assert stopped and grammar.accepting, text
        content, calls = plan.parse(text)
        assert content == "" and len(calls) == 1, text
        if isinstance(choice, dict):
            assert calls[0].name == "add"
        jsonschema.validate(json.loads(calls[0].arguments), schemas()[calls[0].name])


def test_auto_lets_a_plain_answer_through(default_engine):
    engine = default_engine
    plan = plan_tools(engine.tokenizer, TOOLS, "auto", True, grammars=engine.grammars)
    ids = engine._prompts.encode([{"role": "user", "content": "Say hello to my friend Anna."}], tools=plan)
    free, _ = greedy(engine, ids, max_tokens=30)
    assert "<tool_call>" not in engine.tokenizer.decode(free)
    grammar = engine.grammars.state(engine.grammars.compile(plan.constraint), forced_spans=False)
    constrained, _ = greedy(engine, ids, grammar, max_tokens=30)
    assert constrained == free
    assert plan.parse(engine.tokenizer.decode(free)) == (engine.tokenizer.decode(free), [])
