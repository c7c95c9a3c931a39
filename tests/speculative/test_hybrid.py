"""auto with a trained drafter: lookup where the context repeats, the block drafter elsewhere, each
source's acceptance and cost learned in its own bucket; greedy output identical to plain decoding."""

import pytest
from block_drafters import random_dflash
from test_dflash import prompts

from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import SpecStats, speculative_tokens
from mlx_infer.speculative.drafters.base import Draft
from mlx_infer.speculative.drafters.dflash import DFlashDrafter
from mlx_infer.speculative.drafters.hybrid import BLOCK_KEY, LookupThenBlock
from mlx_infer.speculative.cost import CostCurve
from mlx_infer.speculative.schedule import PROBE_EVERY, DraftScheduler


class KeyRecorder(DraftScheduler):
    """A DraftScheduler that records the bucket of every round it observes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys = []

    def observe(self, proposed, accepted, draft_s, verify_s, key=None, **kw):
        self.keys.append(key)
        super().observe(proposed, accepted, draft_s, verify_s, key=key, **kw)


@pytest.mark.parametrize("vocab", [64, 8])
def test_greedy_identical_and_both_sources_used(make_tiny, vocab):
    target = make_tiny(seed=1, vocab=vocab, scale=3.0)
    model = random_dflash(seed=5, vocab=vocab, block=5)
    used = set()
    for p in prompts(vocab, 12):
        base = list(plain_tokens(target, p, SamplingParams(), 24))
        drafter = LookupThenBlock(DFlashDrafter(model, target))
        scheduler = KeyRecorder(CostCurve({w: 1.0 for w in range(1, 9)}), drafter.max_draft, free=True)
        stats = SpecStats()
        out = list(speculative_tokens(target, p, SamplingParams(), 24, drafter, scheduler, stats))
        keys = scheduler.keys
        assert out == base, p
        assert stats.mode == "lookup+dflash"
        used |= {"block" if k == BLOCK_KEY else "lookup" for k in keys if k is not None}
    assert used == {"block", "lookup"}


def test_costly_bucket_is_skipped_then_probed():
    """A bucket whose drafts are rejected and whose pass costs half a verify stops being drafted from; it
    is tried again every PROBE_EVERY rounds. A free, accurate bucket stays worth it."""
    s = DraftScheduler(CostCurve({w: 1.0 + 0.02 * (w - 1) for w in range(1, 9)}), 7, free=True)
    for _ in range(20):
        s.observe(7, 7, 0.0, s.curve(8), key=3)
    for _ in range(2):
        s.observe(7, 0, 0.5, s.curve(8), key=BLOCK_KEY)
    assert s.key_costs[BLOCK_KEY] == pytest.approx(0.5)
    assert s.worth(3)
    tried = []
    for r in range(4 * PROBE_EVERY):
        worth = s.worth(BLOCK_KEY)
        tried += [r] if worth else []
        s.observe(7 if worth else 0, 0, 0.5 if worth else 0.0, s.curve(8 if worth else 1),
                  key=BLOCK_KEY if worth else None)
    assert tried == [PROBE_EVERY, 2 * PROBE_EVERY + 1, 3 * PROBE_EVERY + 2]  # PROBE_EVERY plain rounds between probes
    # once proposed, the cost is sunk: cut judges the proposal on acceptance alone
    assert s.cut(Draft(list(range(7)), key=3)) == 7


def test_offer_key_is_lookups_match_else_the_block_drafters(make_tiny):
    """The bucket the hybrid would draft from: lookup's n-gram length where the context repeats itself, else
    the block drafter's (it can always propose)."""
    target = make_tiny(seed=1, vocab=64, scale=3.0)
    drafter = LookupThenBlock(DFlashDrafter(random_dflash(seed=5, vocab=64, block=5), target))
    assert drafter.offer_key([5, 6, 7, 8, 5, 6, 7]) == 3  # "5 6 7" occurred before
    assert drafter.offer_key([5, 6, 7, 8, 9, 6]) == 1
    assert drafter.offer_key([5, 6, 7, 8, 9, 10]) == BLOCK_KEY
