"""What `speculative="auto"` drafts with when the target has a trained block drafter: prompt lookup where
the context repeats itself (free, and nearly always right on copied text), the block drafter elsewhere.

Each proposal is tagged with its bucket (`Draft.key`: lookup's matched n-gram length, BLOCK_KEY for the
block drafter), so the scheduler (schedule.DraftScheduler, free mode) learns the acceptance of each source
separately and cuts each proposal to the length worth verifying. The block drafter's pass is not free:
it runs only while the policy's `worth(BLOCK_KEY)` (passed to `propose`) says its expected gain covers its
cost (with a probe now and then), so a weak drafter costs almost nothing and a strong one is used wherever lookup has no match.
"""

from typing import Optional, Sequence

import mlx.core as mx

from .base import Draft, Drafter, Worth
from .lookup import LookupDrafter

#: Draft.key of the block drafter's proposals (lookup keys are match lengths >= 1).
BLOCK_KEY = 0


def always(key: Optional[int]) -> bool:
    """Every source is worth drafting from (no policy given)."""
    return True


class LookupThenBlock(Drafter):
    """Prompt lookup first, a block drafter (DFlash / DSpark) when lookup finds no match.

    Args:
        block: a BlockDrafter (fed the target's taps; its context is updated every round, drafting or not).
        lookup: the lookup drafter (default LookupDrafter()).
    """

    free = True
    wants_hidden = True

    def __init__(self, block: Drafter, lookup: Optional[LookupDrafter] = None):
        self.block = block
        self.lookup = lookup or LookupDrafter()
        self.name = f"lookup+{block.name}"
        self.target_layer_ids = list(block.target_layer_ids)
        self.max_draft = block.max_draft
        self.ident = block.ident

    def begin(self, prompt_ids: Sequence[int], params, hidden: Optional[mx.array] = None) -> None:
        self.lookup.begin(prompt_ids, params)
        self.block.begin(prompt_ids, params, hidden=hidden)

    def propose(self, context: Sequence[int], gamma: int, worth: Worth = None) -> Draft:
        """Lookup's proposal when it has one worth verifying, else the block drafter's when that is worth its
        pass (worth: DraftPolicy.worth; None: both always are), else an empty draft."""
        worth = worth or always
        draft = self.lookup.propose(context, gamma)
        if draft.tokens and worth(draft.key):
            return draft
        if worth(BLOCK_KEY):
            draft = self.block.propose(context, gamma)
            return Draft(draft.tokens, draft.q, BLOCK_KEY)
        return Draft([], key=BLOCK_KEY)

    def offer_key(self, context: Sequence[int]) -> Optional[int]:
        """Lookup's bucket when it has a match, else the block drafter's (it can always propose)."""
        key = self.lookup.offer_key(context)
        return BLOCK_KEY if key is None else key

    def possible_keys(self, context: Sequence[int]) -> set:
        """Lookup's possible buckets, and the block drafter's (it can always propose)."""
        return self.lookup.possible_keys(context) | {BLOCK_KEY}

    def update(self, n_accepted: int, committed: Sequence[int], hidden: Optional[mx.array] = None) -> None:
        self.lookup.update(n_accepted, committed)
        self.block.update(n_accepted, committed, hidden=hidden)
