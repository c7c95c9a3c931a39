"""What the scheduler knows before a request: a model drafter's calibration prior (calibrate.py), and which lookup
buckets the next round could draft from (what lets a plain round be launched ahead)."""

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from block_drafters import random_dflash
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_infer.speculative import SpecOptions, SpecState, state as state_mod
from mlx_infer.speculative.calibrate import (PRIOR_WEIGHT, block_agreement, drafter_prior, measure_block_prior,
                                             measure_prior)
from mlx_infer.speculative.capture import TargetTaps
from mlx_infer.speculative.cost import CostCurve
from mlx_infer.speculative.drafters.base import Draft, Drafter
from mlx_infer.speculative.drafters.dflash import DFlashDrafter, save_dflash_model
from mlx_infer.speculative.drafters.draft_model import DraftModelDrafter
from mlx_infer.speculative.drafters.hybrid import BLOCK_KEY, LookupThenBlock
from mlx_infer.speculative.drafters.lookup import LookupDrafter
from mlx_infer.speculative.schedule import Prior, drafter_pays


def test_prior_agreement_is_one_for_the_target_itself_and_lower_for_a_stranger(target, weak_drafter_model, make_target):
    t = make_target(target)
    same = measure_prior(t, target)
    other = measure_prior(t, weak_drafter_model)
    assert same.acceptance == 1.0 and same.weight == PRIOR_WEIGHT and same.draft_cost > 0
    assert other.acceptance < 0.5


def test_prior_is_cached_per_drafter_identity(target, weak_drafter_model, tmp_path, monkeypatch, make_target):
    """Measured once per identity (a line said before measuring), then read from disk; no identity (a
    model object): measured afresh, never cached."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    t = make_target(target)
    said = []
    first = drafter_prior(t, DraftModelDrafter(weak_drafter_model, "draft:/x"), said.append)
    again = drafter_prior(t, DraftModelDrafter(target, "draft:/x"), said.append)  # the cache answers, not the model
    assert len(said) == 1 and again.acceptance == first.acceptance
    assert drafter_prior(t, DraftModelDrafter(target, "draft:/y")).acceptance == 1.0
    assert drafter_prior(t, DraftModelDrafter(target)).acceptance == 1.0
    assert len(list((tmp_path / "prior").glob("*.json"))) == 2


class OracleBlock(Drafter):
    """A block drafter that drafts the target's own greedy token (it runs the target on the context)."""

    wants_hidden = True
    target_layer_ids = [0]
    max_draft = 3

    def __init__(self, target):
        self.target = target

    def begin(self, prompt_ids, params, hidden=None):
        self.rows = 0 if hidden is None else hidden.shape[1]

    def propose(self, context, gamma, worth=None):
        assert self.rows == len(context) - 1  # fed the taps of every committed token but the anchor
        return Draft([mx.argmax(self.target(mx.array(context)[None])[0, -1]).item()][:gamma])

    def update(self, n_accepted, committed, hidden=None):
        assert hidden.shape[1] == len(committed) == n_accepted + 1
        self.rows += hidden.shape[1]


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_block_agreement_is_one_for_the_target_and_matches_fresh_drafters(make_tiny, make_target, stride):
    """An oracle drafter agrees everywhere (the anchors and taps line up); a random DFlash drafter fed its
    context incrementally agrees exactly where a fresh drafter given the same taps at once does."""
    target = make_tiny(seed=1, vocab=8, scale=3.0)  # a small vocabulary: a random drafter is sometimes right
    engine = make_target(target, vocab=8)
    tokens = mx.array([(5 * i * i + 3 * i) % 8 for i in range(40)])[None]
    assert block_agreement(engine, OracleBlock(target), tokens, stride) == 1.0
    model = random_dflash(seed=7, vocab=8, block=4)
    got = block_agreement(engine, DFlashDrafter(model, target), tokens, stride)
    with TargetTaps(target, model.target_layer_ids) as taps:
        wanted = mx.argmax(target(tokens), axis=-1)[0].tolist()
        feats = taps.features()
    ids, same, anchors = tokens[0].tolist(), 0, range(0, tokens.shape[1] - 1, stride)
    for a in anchors:
        fresh = DFlashDrafter(model, target)
        fresh.begin(ids[: a + 1], None, hidden=feats[:, :a] if a else None)
        same += fresh.propose(ids[: a + 1], 1).tokens[0] == wanted[a]
    assert 0 < same < len(anchors)  # a random drafter: neither always right nor always wrong here
    assert got == pytest.approx(same / len(anchors))


def test_block_prior_measures_a_drafting_pass(target, make_target):
    prior = measure_block_prior(make_target(target), DFlashDrafter(random_dflash(seed=7), target))
    assert 0 <= prior.acceptance < 0.5 and prior.draft_cost > 0
    assert prior.weight == PRIOR_WEIGHT


@pytest.mark.parametrize("acceptance, draft_cost, pays", [(0.9, 0.1, True), (0.05, 0.1, False), (0.9, 5.0, False)])
def test_auto_leaves_out_a_block_drafter_that_cannot_pay(target, tmp_path, monkeypatch, make_target, acceptance,
                                                         draft_cost, pays):
    """auto backs lookup with the registered block drafter only when the drafter's prior, on the cost curve,
    makes some draft length beat a plain step. Expected by hand: on a curve of 1 + 0.1 (w - 1) s a 3-token
    block fully accepted at 0.9 commits 1 + .9 + .81 + .73 = 3.44 tokens in 1.3 s + the pass (0.1 s): 2.5
    tokens/s against 1 for a plain step; at acceptance 0.05 about 1.05 tokens in 1.1 s + 0.1 s (0.88 /s);
    with a 5 s pass 3.44 tokens in 6.3 s (0.55 /s)."""
    save_dflash_model(random_dflash(seed=7), tmp_path / "d")
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"drafters": [{"match": ["tiny"], "kind": "dflash", "path": "d"}]}))
    monkeypatch.setattr(state_mod, "cost_curve", lambda target, width, say=None, compiled=None: CostCurve(
        {w: 1.0 + 0.1 * (w - 1) for w in range(1, width + 1)}, 1.0))
    monkeypatch.setattr(state_mod, "drafter_prior", lambda target, drafter, say=None: Prior(acceptance, 4.0, draft_cost))
    state = SpecState(make_target(target), registry=registry)
    drafter = state.drafter(SpecOptions("auto"))
    assert isinstance(drafter, LookupThenBlock) is pays and isinstance(drafter, LookupDrafter) is not pays
    curve = CostCurve({w: 1.0 + 0.1 * (w - 1) for w in range(1, 10)}, 1.0)
    assert drafter_pays(curve, Prior(acceptance, 4.0, draft_cost), 3, per_round=True) is pays


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=30))
def test_lookup_possible_keys_cover_every_next_token(context):
    """For every token t that could come next, the bucket lookup proposes from after t is among
    possible_keys(context), and every possible bucket is reached by some t."""
    drafter = LookupDrafter()
    keys = drafter.possible_keys(context)
    reached = set()
    for t in range(6):
        draft = drafter.propose(context + [t], 8)
        if draft.tokens:
            assert draft.key in keys, (context, t, draft.key, keys)
            reached.add(draft.key)
    # a bucket n is possible when some t makes the final n-gram match: the longest match wins, so a
    # possible shorter bucket may be shadowed by a longer one; each possible key is at least a real match
    for n in keys:
        assert any(_matches(context + [t], n) for t in range(6)), (context, n)
    assert reached <= keys


def _matches(context, n):
    ctx = np.asarray(context)
    L = len(ctx)
    return L > n and any((ctx[s : s + n] == ctx[L - n :]).all() for s in range(L - n))


def test_hybrid_can_always_draft_from_its_block_drafter():
    block = SimpleNamespace(name="dflash", target_layer_ids=[0], max_draft=4, ident=None)
    assert LookupThenBlock(block).possible_keys([1, 2, 3]) == {1, BLOCK_KEY}
