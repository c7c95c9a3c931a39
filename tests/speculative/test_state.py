"""SpecState, the Engine's per-model speculative state: what it measures and when, what it keeps between
requests, and how it decides between speculative and plain decoding."""

import gc

import mlx.core as mx
import pytest
from block_drafters import random_dflash
from mlx_lm.models import mamba
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.errors import MlxInferError
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import SpecOptions, SpecState, SpecStats, state as state_mod
from mlx_infer.speculative.cost import CostCurve
from mlx_infer.speculative.drafters.dflash import save_dflash_model
from mlx_infer.speculative.schedule import DraftScheduler, FixedGamma, Prior
from mlx_infer.speculative.verify import process_logits


def tiny_mamba(vocab: int = 64):
    """A random Mamba: its cache is an ArraysCache (recurrent state), which cannot roll back."""
    mx.random.seed(0)
    args = mamba.ModelArgs(model_type="mamba", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                           state_size=8, num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True,
                           time_step_rank=4)
    return mamba.Model(args)


@pytest.fixture
def widths(monkeypatch):
    """Record the width of every cost-curve lookup (a flat curve: speculation always pays)."""
    asked = []

    def curve(target, width, say=None, compiled=None):
        asked.append(width)
        return CostCurve({w: 1.0 + 0.01 * (w - 1) for w in range(1, width + 1)}, 1.0)

    monkeypatch.setattr(state_mod, "cost_curve", curve)
    return asked


def test_auto_on_a_cache_that_cannot_roll_back_measures_nothing_and_decodes_plainly(make_target, widths):
    """Before: prepare() measured the cost curve first and then crashed on the model's ArraysCache
    ('ArraysCache' object has no attribute 'trim')."""
    state = SpecState(make_target(tiny_mamba()))
    state.prepare(SpecOptions("auto"))
    assert widths == []
    stats = SpecStats()
    cache = make_prompt_cache(state.target.model)
    assert state.tokens([1, 2, 3], SamplingParams(), 4, SpecOptions("auto"), stats, cache) is None
    assert stats.mode == "off" and widths == []
    with pytest.raises(MlxInferError, match="roll back"):
        state.tokens([1, 2, 3], SamplingParams(), 4, SpecOptions("lookup"), SpecStats(), cache)


def test_a_16_token_block_drafter_is_measured_once_wide_enough(target, make_target, tmp_path, widths, monkeypatch):
    """Before: prepare() measured the curve to width 9 while a 16-token block needs 16 (+1), so the first
    request measured again inside its TTFT."""
    save_dflash_model(random_dflash(seed=3, block=17), tmp_path / "d")  # drafts up to 16 tokens
    monkeypatch.setattr(state_mod, "drafter_prior", lambda target, drafter, say=None: Prior(0.9, 4.0, 0.01))
    state = SpecState(make_target(target))
    options = SpecOptions("dflash", str(tmp_path / "d"))
    state.prepare(options)
    assert widths == [17]
    tokens = state.tokens([1, 2, 3, 4], SamplingParams(), 6, options, SpecStats(), make_prompt_cache(target))
    assert len(list(tokens)) == 6 and widths == [17]  # the request measured nothing more


def test_each_request_gets_a_fresh_scheduler_from_the_prior(target, make_tiny, make_target, widths):
    """A draft model's scheduler starts every request from its calibration prior, measured once per draft
    model object (carrying what one request learned into the next showed no benefit; before, that memory
    was keyed by id() of the draft model, which a new object can reuse once the old one is freed)."""
    state = SpecState(make_target(target))
    options = SpecOptions("draft", make_tiny(seed=9, layers=1))
    first = state.policy(options, state.drafter(options), SamplingParams())
    second = state.policy(options, state.drafter(options), SamplingParams())
    assert isinstance(first, DraftScheduler) and second is not first
    assert second.rates() == first.rates() and second.draft_cost == first.draft_cost > 0
    del options, first, second
    gc.collect()
    other = SpecOptions("draft", make_tiny(seed=10, layers=3))  # another object, perhaps at the same id()
    again = state.policy(other, state.drafter(other), SamplingParams())
    assert len(state._object_priors) == 2 and again.draft_cost == state._object_priors[1][1].draft_cost


def test_pinned_and_self_scheduled_drafters_get_a_fixed_gamma(target, make_target, widths):
    state = SpecState(make_target(target))
    policy = state.policy(SpecOptions("lookup", max_draft=3), state.drafter(SpecOptions("lookup")), SamplingParams())
    assert isinstance(policy, FixedGamma) and policy.gamma() == 3 and widths == []


def test_repetition_penalty_looks_back_only_its_context(target):
    """Before: every verified position rebuilt the whole history into a new array; the processors look
    back repetition_context_size tokens at most, so they get at most that plus the draft, and the
    processed logits equal those computed with the whole history."""
    params = SamplingParams(repetition_penalty=1.3, repetition_context_size=5)
    history, draft = list(range(40)), [3, 7, 11]
    logits = mx.random.normal((4, 64), key=mx.random.key(1))
    seen = []

    def spy(tokens, row):  # mlx-lm's repetition penalty, recording what it was given
        seen.append(tokens.size)
        picked = tokens[-params.repetition_context_size:]
        vals = row[:, picked]
        vals = mx.where(vals < 0, vals * params.repetition_penalty, vals / params.repetition_penalty)
        row[:, picked] = vals
        return row

    got = process_logits(logits, history, draft, params, [spy])
    assert max(seen) <= params.repetition_context_size + len(draft)
    rows = []
    for i in range(4):  # the reference: the whole history, as plain decoding sees it
        row = logits[i : i + 1]
        picked = mx.array(history + draft[:i])[-params.repetition_context_size:]
        vals = row[:, picked]
        row[:, picked] = mx.where(vals < 0, vals * params.repetition_penalty, vals / params.repetition_penalty)
        rows.append(row)
    want = mx.concatenate(rows, axis=0)  # greedy: the processed logits, whose argmax plain decoding takes
    assert mx.allclose(got, want, atol=1e-6).item()
