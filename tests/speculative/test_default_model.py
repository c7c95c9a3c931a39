"""On the embedded default model (float32 on this CPU): lookup mode gives plain decoding's tokens, text
and finish reason, also when a stop string or max_tokens falls inside an accepted block."""

import pytest

import mlx_infer
from mlx_infer.speculative import SpecOptions, cut_draft_model

CODE = "def add(a, b):\n    return a + b\n\ndef subtract(a, b):\n    return a - b\n\ndef multiply(a, b):\n    return a * b\n"
PROMPTS = [
    "Rewrite this Python code, adding a docstring to each function and keeping everything else identical:\n\n" + CODE,
    "What is 12 + 30? Answer briefly.",
    pytest.param("Copy this sentence: The quick brown fox jumps over the lazy dog. The quick brown fox",
                 marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def engine():
    return mlx_infer.load()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_lookup_equals_plain(engine, prompt):
    plain = engine.generate(prompt, max_tokens=16)
    spec = engine.generate(prompt, max_tokens=16, speculative="lookup", max_draft=6)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert spec.stats.spec_mode == "lookup" and spec.stats.rounds > 0 and spec.stats.tau >= 1
    assert plain.stats.spec_mode is None and plain.stats.rounds == 0


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"stop": "multiply"}, {"max_tokens": 9}])
def test_stops_inside_accepted_block(engine, kw):
    kw = {"max_tokens": 40, **kw}
    plain = engine.generate(PROMPTS[0], **kw)
    spec = engine.generate(PROMPTS[0], speculative="lookup", max_draft=8, **kw)
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert spec.stats.tau > 1.5  # the stop really fell inside multi-token blocks


def test_bad_arguments(engine):
    with pytest.raises(mlx_infer.MlxInferError, match="speculative"):
        engine.generate("hi", speculative="nope")
    with pytest.raises(mlx_infer.MlxInferError, match="draft_model"):
        engine.generate("hi", speculative="draft")
    with pytest.raises(mlx_infer.MlxInferError, match="max_draft"):
        engine.generate("hi", speculative="lookup", max_draft=-1)


@pytest.mark.slow
def test_draft_model_cut_from_target(engine, tmp_path):
    """A draft model cut from the target (first 8 layers + norm + head) drafts losslessly."""
    out = cut_draft_model(engine.source.mlx_dir, tmp_path / "draft", 8)
    prompt = PROMPTS[1]
    plain = engine.generate(prompt, max_tokens=16)
    spec = engine.generate(prompt, max_tokens=16, speculative="draft", draft_model=str(out), max_draft=3)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.spec_mode == "draft"


@pytest.mark.parametrize("max_draft", [2, 7])
def test_shipped_dflash_drafter_equals_plain(engine, max_draft):
    """The DFlash drafter shipped for the default model (models/, picked from the registry with no
    draft_model) drafts losslessly, greedy, with the block cut to max_draft."""
    prompt = PROMPTS[1]
    plain = engine.generate(prompt, max_tokens=16)
    spec = engine.generate(prompt, max_tokens=16, speculative="dflash", max_draft=max_draft)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert spec.stats.spec_mode == "dflash" and spec.stats.rounds > 0
    assert len(spec.stats.acceptance) == max_draft


def test_auto_leaves_out_the_shipped_drafter_that_cannot_pay(engine):
    """The shipped DFlash drafter agrees with the default model on about 5% of first draft tokens (its
    calibration prior): too few to pay for its pass. Bound by hand: with per-position acceptance a, a
    round commits at most 1 + a / (1 - a) tokens and costs at least a width-2 verify plus one pass; below
    a plain step's rate, auto drafts with lookup alone."""
    block = engine.spec.drafter(SpecOptions("dflash"))
    prior = engine.spec.prior(block)
    curve = engine.spec.curve(engine.spec.width(block))
    best_rate = (1 + prior.acceptance / (1 - prior.acceptance)) / (curve(2) + prior.draft_cost)
    assert prior.acceptance < 0.2 and best_rate < 1 / curve.plain()
    spec = engine.generate(PROMPTS[1], max_tokens=8, speculative="auto", max_draft=3)
    plain = engine.generate(PROMPTS[1], max_tokens=8)
    assert spec.stats.spec_mode == "lookup" and spec.token_ids == plain.token_ids
