"""What the scheduler knows before a request: a model drafter's calibration prior, and which lookup
buckets the next round could draft from (what lets a plain round be launched ahead)."""

from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_infer.speculative.drafters.hybrid import BLOCK_KEY, LookupThenBlock
from mlx_infer.speculative.drafters.lookup import LookupDrafter
from mlx_infer.speculative.prior import PRIOR_WEIGHT, drafter_prior, measure_prior


def fake_engine(model, tmp_path):
    tokenizer = SimpleNamespace(vocab_size=64, encode=lambda text: [1 + (ord(c) % 60) for c in text])
    return SimpleNamespace(model=model, tokenizer=tokenizer,
                           source=SimpleNamespace(mlx_dir=tmp_path / "m", weights="float32"))


def test_prior_agreement_is_one_for_the_target_itself_and_lower_for_a_stranger(target, weak_drafter_model, tmp_path):
    engine = fake_engine(target, tmp_path)
    same = measure_prior(engine, target)
    other = measure_prior(engine, weak_drafter_model)
    assert same.acceptance == 1.0 and same.weight == PRIOR_WEIGHT and same.draft_cost > 0
    assert other.acceptance < 0.5


def test_prior_is_cached_per_drafter_identity(target, weak_drafter_model, tmp_path, monkeypatch):
    """Measured once per identity (a line said before measuring), then read from disk; no identity (a
    model object): measured afresh, never cached."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    engine = fake_engine(target, tmp_path)
    said = []
    first = drafter_prior(engine, weak_drafter_model, "draft:/x", said.append)
    again = drafter_prior(engine, target, "draft:/x", said.append)  # the cache answers, not the model
    assert len(said) == 1 and again.acceptance == first.acceptance
    assert drafter_prior(engine, target, "draft:/y").acceptance == 1.0
    assert drafter_prior(engine, target, None).acceptance == 1.0
    assert len(list((tmp_path / "prior").glob("*.json"))) == 2


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
    block = SimpleNamespace(name="dflash", target_layer_ids=[0], max_draft=4)
    assert LookupThenBlock(block).possible_keys([1, 2, 3]) == {1, BLOCK_KEY}
