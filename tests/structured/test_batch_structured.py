"""Constrained and logprob-reporting batched decoding (issue 48): each row picks under its own grammar's mask,
rows with and without grammars share a batch, forced tokens go one per step, and every row's tokens and
logprobs equal its request decoded alone; a constraint cut by max_tokens ends "length"; a cancelled or failing
constrained request leaves alone, with its blocks back in the pool.

(Named test_batch_structured.py: tests/kv/test_batch.py already holds the basename, and the test folders are
not packages.)"""

import json
import re

import jsonschema
import pytest

from mlx_infer import SamplingParams
from mlx_infer.batch.run import run_batch
from mlx_infer.generation.results import ToolCall, collect
from mlx_infer.structured.constraint import regex

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PAINT = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                           "coats": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "glossy": {"type": "boolean"}},
         "required": ["color", "coats", "glossy"], "additionalProperties": False}
PHONE = r"\(555\) [0-9]{3}-[0-9]{4}"


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


#: (prompt, response_format or None, check of the text) of the mixed batch.
ROWS = [
    ("Describe a person as JSON.", schema_format(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ("Count from 1 to 10.", None, None),
    ("Which paint should I buy? Answer in JSON.", schema_format(PAINT),
     lambda t: jsonschema.validate(json.loads(t), PAINT)),
    ("Give me a phone number.", regex(PHONE), lambda t: re.fullmatch(PHONE, t) is not None or pytest.fail(t)),
]
MAX_TOKENS = 40
TOP = 3


def batched(engine, rows, max_tokens=MAX_TOKENS, **kwargs):
    """Each row's steps, decoded together on a fresh scheduler (no prefix cache)."""
    sched = engine.scheduler(prefix_cache=False)
    steps = [[] for _ in rows]
    reqs = [engine.batch_request(p, SamplingParams(max_tokens=max_tokens), response_format=f, emit=s.append,
                                 **kwargs) for (p, f, _), s in zip(rows, steps)]
    run_batch(sched, reqs)
    return steps


def test_a_mixed_batch_equals_each_request_alone(default_engine):
    """Two schemas, a regex and a free row in one batch: each constrained output validates, and every row's
    tokens and logprobs (top 3) equal its request decoded alone through engine.generate (plain path: forced
    spans run several tokens per forward there, one per step here)."""
    results = [collect(s) for s in batched(default_engine, ROWS, logprobs=TOP)]
    for (prompt, fmt, check), got in zip(ROWS, results):
        alone = default_engine.generate(prompt, max_tokens=MAX_TOKENS, response_format=fmt, logprobs=TOP)
        assert got.token_ids == alone.token_ids, prompt
        assert got.text == alone.text
        assert got.finish_reason == alone.finish_reason == ("length" if fmt is None else "stop")
        if check is not None:
            check(got.text)
        assert len(got.logprobs) == len(got.token_ids) == len(alone.logprobs)
        for a, b in zip(got.logprobs, alone.logprobs):
            assert a.token == b.token
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


def test_a_batch_of_one_equals_the_batch(default_engine):
    """The constrained rows' tokens do not depend on what else is in the batch."""
    mixed = [collect(s) for s in batched(default_engine, ROWS)]
    for row, want in zip(ROWS, mixed):
        assert collect(batched(default_engine, [row])[0]).token_ids == want.token_ids


def test_forced_spans_off_is_valid_too(default_engine):
    for (_, fmt, check), got in zip(ROWS, [collect(s) for s in batched(default_engine, ROWS, forced_spans=False)]):
        if check is not None:
            assert got.finish_reason == "stop"
            check(got.text)


def test_a_constraint_cut_by_max_tokens_ends_with_length(default_engine):
    """max_tokens 4 is too few for the schema: "length", and the partial text starts the full answer."""
    cut = collect(batched(default_engine, ROWS[:2], max_tokens=4)[0])
    full = default_engine.generate(ROWS[0][0], max_tokens=MAX_TOKENS, response_format=ROWS[0][1])
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    assert full.text.startswith(cut.text) and cut.text.startswith("{")


def test_a_cancelled_constrained_request_leaks_no_blocks(default_engine):
    """Cancelled mid-answer, the constrained request ends "cancelled" at the next step with its blocks back
    in the pool; the free row goes on and answers as alone; then the pool is as before."""
    sched = default_engine.scheduler(prefix_cache=False)
    pool = sched.kv.pool
    before = pool.blocks_in_use
    first, second = [], []
    a = default_engine.batch_request(ROWS[0][0], SamplingParams(max_tokens=MAX_TOKENS), response_format=ROWS[0][1],
                                     emit=first.append)
    b = default_engine.batch_request(ROWS[1][0], SamplingParams(max_tokens=24), emit=second.append)
    sched.add(a)
    sched.add(b)
    while len(first) < 5:
        sched.step()
    a.cancelled = True
    sched.step()
    assert first[-1].finish_reason == "cancelled" and a not in sched.running
    assert not a.grammar.prefetched  # its next mask dropped, not left to the shared mask thread
    assert pool.blocks_in_use - before == len(b.sequence.table.blocks)
    while sched.busy:
        sched.step()
    assert collect(second).token_ids == default_engine.generate(ROWS[1][0], max_tokens=24).token_ids
    assert pool.blocks_in_use == before


def test_a_failing_grammar_fails_its_request_alone(default_engine):
    """The grammar's mask raises on the 4th token: that request gets the error (in the place of its final
    step), the others finish as alone, and its blocks go back."""
    sched = default_engine.scheduler(prefix_cache=False)
    pool = sched.kv.pool
    before = pool.blocks_in_use
    steps = [[] for _ in ROWS[:3]]
    reqs = [default_engine.batch_request(p, SamplingParams(max_tokens=MAX_TOKENS), response_format=f,
                                         emit=s.append) for (p, f, _), s in zip(ROWS[:3], steps)]
    grammar, calls = reqs[0].grammar, []
    real = grammar.mask

    def failing():
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("the mask thread broke")
        return real()

    grammar.mask = failing
    run_batch(sched, reqs)
    assert isinstance(steps[0][-1], RuntimeError) and all(s.finish_reason is None for s in steps[0][:-1])
    for (prompt, fmt, _), got in zip(ROWS[1:3], steps[1:]):
        alone = default_engine.generate(prompt, max_tokens=MAX_TOKENS, response_format=fmt)
        assert collect(got).token_ids == alone.token_ids
    assert pool.blocks_in_use == before


class OneCall:
    """A ToolPlan stand-in: every text holds one call."""

    def parse(self, text):
        return "", [ToolCall("call_" + "0" * 24, "count", json.dumps({"text": text}))]


def test_the_final_step_carries_the_tool_calls(default_engine):
    sched = default_engine.scheduler(prefix_cache=False)
    steps = []
    req = default_engine.batch_request(ROWS[1][0], SamplingParams(max_tokens=6), emit=steps.append)
    req.tools = OneCall()
    run_batch(sched, [req])
    got = collect(steps)
    assert got.finish_reason == "length"  # cut by max_tokens: "length" stays, the whole calls are attached
    assert [json.loads(c.arguments)["text"] for c in got.tool_calls] == [got.text]
