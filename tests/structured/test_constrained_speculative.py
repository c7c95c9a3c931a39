"""Speculative decoding under a grammar (issue 48, rule 3): greedy output equals plain constrained decoding with
the same forced_spans setting (lookup and a draft model cut from the target, on the default model); sampled
output has exactly the masked distribution (a tiny random model with the default model's vocabulary, many
seeded runs against the distribution computed from its logits); logprobs come from the raw rows."""

import json
import math
from collections import Counter

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_map

import mlx_infer
from mlx_infer.generation.logprobs import LogprobQueue, token_logprobs
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import DraftModelDrafter, LookupDrafter, SpecStats, cut_draft_model, speculative_tokens
from mlx_infer.structured.constraint import json_schema, regex
from mlx_infer.structured.mask import allows, apply_masks, one_hot_mask

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
ITEMS = {"type": "object", "additionalProperties": False, "required": ["colors", "count"],
         "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
                        "count": {"type": "integer"}}}
CASES = [
    (PERSON, "Give a JSON object with name, age and city for Alice, 30, Paris. Then the same for Bob, 41, Rome."),
    (ITEMS, "List the colors of the French flag that are in red, green, blue as JSON, with their count."),
]


@pytest.fixture(scope="module")
def engine():
    return mlx_infer.load(weights="float32")


def chat(engine, text):
    return list(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                     add_generation_prompt=True, tokenize=True))


def until_eos(tokens, eos, max_tokens):
    """The tokens a consumer receives: up to and including the first EOS, at most max_tokens (closes)."""
    out = []
    for t in tokens:
        out.append(t)
        if t in eos or len(out) >= max_tokens:
            break
    if hasattr(tokens, "close"):
        tokens.close()
    return out


def consume_with_forced(grammar, token: int) -> list:
    """The grammar consumes `token` and then every span it forces after it; the tokens consumed."""
    grammar.consume([token])
    block = [token]
    while not grammar.stopped and grammar.forced():
        forced = grammar.forced()
        grammar.consume(forced)
        block += forced
    return block


def reference(model, prompt, grammar, max_tokens, eos):
    """Plain constrained greedy decoding written out (issue 48, rules 1-2): the argmax of the masked logits,
    token by token; after each, the grammar's forced tokens committed unchanged and run through the model with
    it in one forward."""
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=cache)
    row = model(mx.array(prompt[-1:])[None], cache=cache)[0, -1:].astype(mx.float32)
    out = []
    while len(out) < max_tokens:
        t = int(mx.argmax(apply_masks(row, [grammar.mask()]), axis=-1).item())
        block = consume_with_forced(grammar, t)
        out += block
        if t in eos:
            break
        row = model(mx.array(block)[None], cache=cache)[0, -1:].astype(mx.float32)
    return until_eos(iter(out), eos, max_tokens)


def check_json(engine, tokens, schema):
    text = engine.tokenizer.decode([t for t in tokens if t not in engine.tokenizer.eos_token_ids])
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("forced_spans", [True, False])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_lookup_equals_plain_constrained(engine, case, forced_spans):
    schema, text = CASES[case]
    grammars, eos = engine.grammars, set(engine.tokenizer.eos_token_ids)
    compiled = grammars.compile(json_schema(schema))
    prompt = chat(engine, text)
    want = reference(engine.model, prompt, grammars.state(compiled, forced_spans), 48, eos)
    stats = SpecStats()
    got = until_eos(speculative_tokens(engine.model, prompt, SamplingParams(), 48, LookupDrafter(), 8, stats,
                                       grammar=grammars.state(compiled, forced_spans)), eos, 48)
    assert got == want
    assert got[-1] in eos  # the grammar ended the output
    check_json(engine, got, schema)
    if forced_spans:  # the keys and punctuation are forced: several tokens per forward
        assert stats.rounds < len(got)


@pytest.mark.slow
def test_greedy_draft_model_equals_plain_constrained(engine, tmp_path):
    """A draft model cut from the target (its first 8 layers) drafts under the grammar: after a forced span
    at a round's start it is asked from the span's end (its cache follows the context it is given)."""
    from mlx_lm import load as mlx_lm_load

    draft_model = mlx_lm_load(str(cut_draft_model(engine.source.mlx_dir, tmp_path / "draft", 8)))[0]
    schema, text = CASES[0]
    grammars, eos = engine.grammars, set(engine.tokenizer.eos_token_ids)
    compiled = grammars.compile(json_schema(schema))
    prompt = chat(engine, text)
    for forced_spans in (True, False):
        want = reference(engine.model, prompt, grammars.state(compiled, forced_spans), 40, eos)
        got = until_eos(speculative_tokens(engine.model, prompt, SamplingParams(), 40, DraftModelDrafter(draft_model),
                                           4, grammar=grammars.state(compiled, forced_spans)), eos, 40)
        assert got == want
        check_json(engine, got, schema)


def test_logprobs_are_the_raw_rows(engine):
    """Each committed token's logprob is the log-softmax of the raw logits at its position (before the mask),
    the same as the reference computes from its own forwards."""
    grammars, eos = engine.grammars, set(engine.tokenizer.eos_token_ids)
    compiled = grammars.compile(regex(r"(yes|no|maybe), (yes|no|maybe)"))
    prompt = chat(engine, "Answer with yes, no or maybe twice: yes, no")
    queue = LogprobQueue(top=2)
    got = until_eos(speculative_tokens(engine.model, prompt, SamplingParams(), 12, LookupDrafter(), 4,
                                       grammar=grammars.state(compiled), logprobs=queue), eos, 12)
    rows = engine.model(mx.array(prompt + got[:-1])[None])[0, len(prompt) - 1:].astype(mx.float32)
    want = token_logprobs(rows, got, 2)
    for tok, ref in zip(got, want):
        have = queue.take()
        assert have.token == tok
        assert have.logprob == pytest.approx(ref.logprob, abs=2e-4)
        assert [t for t, _ in have.top] == [t for t, _ in ref.top]


def test_one_hot_mask():
    m = one_hot_mask(37, 100)
    assert m.dtype == np.int32 and m.shape == (4,)
    assert [t for t in range(100) if allows(m, t, 100)] == [37]
    assert not allows(m, 137, 100)


# -- sampling: the exact masked distribution ---------------------------------------------------------------

def tiny_target(seed, vocab, scale):
    """A random one-layer float32 llama with the default model's vocabulary (cheap forwards)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
                           max_position_embeddings=256, tie_word_embeddings=False)
    model = llama.Model(args)
    model.update(tree_map(lambda a: a * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


def exact(model, prompt, grammar, params, depth):
    """{first `depth` delivered tokens: probability} of plain constrained sampling (rules 1-2): each sampled
    token from softmax(masked logits / T), the forced tokens after it with probability 1."""
    out = {}

    def walk(path, prob):
        if len(path) >= depth:
            out[tuple(path[:depth])] = out.get(tuple(path[:depth]), 0.0) + prob
            return
        logits = model(mx.array(prompt + path)[None])[0, -1:].astype(mx.float32)
        p = np.array(mx.softmax(apply_masks(logits, [grammar.mask()])[0] / params.temperature))
        for t in np.nonzero(p > 1e-7)[0].tolist():
            block = consume_with_forced(grammar, t)
            walk(path + block, prob * float(p[t]))
            grammar.rollback(len(block))

    walk([], 1.0)
    return out


@pytest.mark.parametrize("drafter_kind,forced_spans", [("lookup", False), ("draft", True)])
def test_sampled_distribution_is_the_masked_one(engine, drafter_kind, forced_spans):
    """800 seeded runs (lookup: deterministic drafts; a random draft model: q rows, forced one-hot rows beside
    them, and drafts the grammar refuses, whose q row shapes the residual) against the exact distribution of
    the first three tokens: Pearson chi-square over the outcomes expected >= 5 times (the rest pooled) below
    its 0.001 upper quantile, and total variation below 0.1 (its sampling noise at N = 800 over this support
    is about 0.04-0.05). About 40 s each on a 2-core Zen 3."""
    grammars = engine.grammars
    vocab = grammars.vocab
    target = tiny_target(3, vocab, 6.0)
    compiled = grammars.compile(regex(r"(yes|no|maybe)[!.]"))
    prompt = engine.tokenizer.encode("yes! maybe. no! yes. maybe! no.", add_special_tokens=False)
    params = SamplingParams(temperature=1.0)
    want = exact(target, prompt, grammars.state(compiled, forced_spans), params, 3)
    assert abs(sum(want.values()) - 1) < 1e-4 and len(want) >= 4
    runs = 800
    drafters = {"lookup": LookupDrafter, "draft": lambda: DraftModelDrafter(tiny_target(4, vocab, 6.0))}
    for drafter in (drafters[drafter_kind](),):
        counts = Counter()
        for seed in range(runs):
            gen = speculative_tokens(target, prompt, SamplingParams(temperature=1.0, seed=seed), 3, drafter, 3,
                                     grammar=grammars.state(compiled, forced_spans))
            counts[tuple(gen)] += 1
        assert set(counts) <= set(want)
        tv = 0.5 * sum(abs(counts[k] / runs - p) for k, p in want.items())
        assert tv < 0.1, (drafter.name, tv)
        big = [k for k, p in want.items() if p * runs >= 5]
        observed = [counts[k] for k in big] + [runs - sum(counts[k] for k in big)]
        expected = [want[k] * runs for k in big] + [runs * (1 - sum(want[k] for k in big))]
        if expected[-1] < 5:  # the pooled rest joins the smallest cell
            observed[-2:] = [sum(observed[-2:])]
            expected[-2:] = [sum(expected[-2:])]
        cells = list(zip(observed, expected))
        chi2 = sum((o - e) ** 2 / e for o, e in cells)
        dof = len(cells) - 1
        # Wilson-Hilferty: the chi-square 0.001 upper quantile
        bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < bound, (drafter.name, chi2, bound, dof)


def test_rollback_over_an_end_of_sequence(engine):
    """An end-of-sequence token consumed once the grammar has stopped is not in llguidance's rollback history:
    rolling back over it, or checking it with `accepted`, must not undo the token before it (a draft that
    ends with EOS and is rejected is rolled back so)."""
    grammars, tok = engine.grammars, engine.tokenizer
    state = grammars.state(grammars.compile(regex(r"(yes|no)[!.]")))
    eos = sorted(tok.eos_token_ids)[0]
    yes, bang = tok.encode("yes", add_special_tokens=False), tok.encode("!", add_special_tokens=False)
    state.consume(yes + bang)
    assert state.stopped
    state.consume([eos])
    state.rollback(2)  # EOS and "!"
    assert state.accepted(tok.encode(".", add_special_tokens=False)) == 1
    assert not allows(state.mask(), eos, grammars.vocab)


@pytest.mark.parametrize("stop_after", [3, 7, 12])
def test_closing_mid_round_leaves_the_grammar_after_the_tokens_delivered(engine, stop_after):
    """A consumer that stops mid-round (a batch taking a lone request back) finds the grammar after exactly the
    tokens it received: the next forced tokens and mask are those of a grammar fed those tokens alone."""
    schema, text = CASES[0]
    grammars = engine.grammars
    compiled = grammars.compile(json_schema(schema))
    state = grammars.state(compiled, True)
    tokens = speculative_tokens(engine.model, chat(engine, text), SamplingParams(), 48, LookupDrafter(), 8,
                                SpecStats(), grammar=state)
    got = [t for _, t in zip(range(stop_after), tokens)]
    tokens.close()
    fresh = grammars.state(compiled, True)
    fresh.consume(got)
    assert state.consumed == stop_after
    assert state.forced() == fresh.forced()
    assert np.array_equal(state.mask(), fresh.mask())
