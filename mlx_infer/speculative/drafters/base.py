"""The drafter interface: propose from the context, learn from what was accepted."""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import mlx.core as mx


#: DraftPolicy.worth as a drafter sees it: callable(bucket key) -> bool, or None (every source is worth it).
Worth = Optional[Callable[[Optional[int]], bool]]


@dataclass
class Draft:
    """A proposal.

    Attributes:
        tokens: the draft tokens x_1..x_g (g >= 0; may be shorter than asked, or empty).
        q: [g, V] float32 probabilities the drafter sampled each token from, or None for a deterministic
            drafter (q one-hot at the token: lookup, greedy draft models).
        key: a confidence bucket the drafter reports with the proposal (lookup: the matched n-gram length),
            so that acceptance is estimated per bucket; None when the drafter has no such signal.
    """

    tokens: List[int]
    q: Optional[mx.array] = None
    key: Optional[int] = None


class Drafter:
    """Base class of drafters.

    A drafter sees the whole context (prompt + committed tokens; the last one is the pending token whose
    continuation is drafted) and proposes at most `gamma` tokens. After verification the loop calls
    `update` with how many of them were accepted and the tokens committed this round.
    """

    #: the mode name reported in stats ("lookup", "draft", ...).
    name = "base"
    #: proposing costs nothing (no model forward): max_draft="auto" then asks for the most and cuts the
    #: proposal to the length worth verifying.
    free = False
    #: True for drafters fed the target's hidden states (DFlash, DSpark): the loop then taps the target's
    #: decoder layers `target_layer_ids` and passes `hidden=` ([1, rows, n*H], committed positions only)
    #: to `begin` (the prompt head) and `update` (the anchor and the accepted drafts).
    wants_hidden = False
    target_layer_ids: Sequence[int] = ()
    #: most tokens one proposal can hold (block drafters: their block), None: no limit of its own.
    max_draft: Optional[int] = None
    #: the drafter cuts its own proposals (DSpark's confidence schedule): max_draft="auto" then asks it for
    #: its whole block every round instead of scheduling gamma.
    self_scheduled = False
    #: a stable identity of a model drafter (its checkpoint, path or skip set) under which its calibration
    #: prior is cached on disk; None: not cached (a model object handed in by the caller).
    ident: Optional[str] = None

    def begin(self, prompt_ids: Sequence[int], params) -> None:
        """Called once before the first round with the prompt token ids and the SamplingParams."""

    def propose(self, context: Sequence[int], gamma: int, worth: Worth = None) -> Draft:
        """Propose at most `gamma` (>= 0) tokens that follow `context` (ints).

        worth: the policy's judgement of a source (DraftPolicy.worth): a drafter with several sources of
        different cost (drafters/hybrid.py) proposes only from one worth its cost; None: every source is.
        """
        raise NotImplementedError

    def offer_key(self, context: Sequence[int]) -> Optional[int]:
        """Free drafters: the bucket (Draft.key) a proposal after `context` would come from, None when there
        would be none; asked every round (those that draft nothing too) so that the policy learns how often
        each bucket offers a draft (DraftPolicy.offered). None here."""
        return None

    def possible_keys(self, context: Sequence[int]):
        """Free drafters: the buckets (Draft.key) a proposal could come from next round, once one more
        token (not known yet) is appended to `context`; None when that cannot be told."""
        return None

    def update(self, n_accepted: int, committed: Sequence[int]) -> None:
        """Called after each round: n_accepted draft tokens were kept; `committed` (n_accepted + 1 ints)
        were appended to the context."""
