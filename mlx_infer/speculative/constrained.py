"""Speculative decoding under a grammar: drafts built by simulating the grammar from the committed state, the
mask of every verified row, and the commit of a round's tokens into the grammar.

A draft is built token by token from the committed state (issue 48's rule 3): while the grammar forces tokens
(GrammarState.forced: jump-forward decoding, arXiv 2312.07104) they join the draft with a one-hot mask row, so
the verify accepts them for certain (greedy: the argmax is the forced token; sampling: p = 1); otherwise the
drafter's next token joins it if the grammar allows it, with the grammar's mask as its row, and the draft ends
at the first token it refuses. The drafter proposed after the committed context: a forced span inserted into
the draft shifts what follows, so after one it is asked again from the new end (only a drafter that can: one
fed no target taps, and mid-draft only a free one), or drafting stops. The grammar is left in the state after
the whole draft; `commit` rolls the rejected tail back and consumes the round's own token.
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..errors import MlxInferError
from ..structured.grammar import GrammarState
from ..structured.mask import allows, one_hot_mask
from .drafters.base import Draft, Drafter

#: callable(context, room) -> (the drafter's Draft or None, its tokens to use (<= room), their [k, V] q rows
#: fitted to the target's vocabulary or None): the loop's proposal, cut by its policy.
Ask = Callable[[List[int], int], Tuple[Optional[Draft], List[int], Optional[mx.array]]]


@dataclass
class GrammarDraft:
    """A draft built under the grammar.

    Attributes:
        tokens: the g draft tokens, forced ones and the drafter's, in order.
        forced: forced[i]: tokens[i] was forced by the grammar (the drafter did not propose it).
        masks: g bitmasks, masks[i] the row predicting tokens[i] (one-hot for a forced token).
        bonus: the mask of the row after the draft (one-hot on forced_next[0] when tokens are forced there),
            None when it is to be read from the grammar (GrammarState.mask: its computation was started with
            prefetch and runs while the forward does).
        q: [g, V] float32 rows of the distributions the tokens were drawn from (one-hot rows for forced
            tokens), None when every token is deterministic (greedy, or a deterministic drafter).
        refused_q: [V] q row of the drafter's next token, which the grammar refused (the draft ends before it;
            its target probability is 0, so it is rejected for certain and the round's token comes from the
            residual, as for a token outside the vocabulary: verify.verify_sampling's rejected_q), or None.
        refused: the drafter proposed a token the grammar refused (counted as proposed, not verified).
        forced_next: tokens forced right after the draft that did not fit (the bonus row is one-hot on the
            first); a round that accepts the whole draft commits them next, unchanged.
        draft: the drafter's first proposal of the round (its key buckets the round), None if not asked.
    """

    tokens: List[int] = field(default_factory=list)
    forced: List[bool] = field(default_factory=list)
    masks: List[np.ndarray] = field(default_factory=list)
    bonus: Optional[np.ndarray] = None
    q: Optional[mx.array] = None
    refused_q: Optional[mx.array] = None
    refused: bool = False
    forced_next: List[int] = field(default_factory=list)
    draft: Optional[Draft] = None

    @property
    def drafted(self) -> int:
        """How many of the tokens the drafter proposed."""
        return len(self.forced) - sum(self.forced)

    def split(self, n: int) -> Tuple[int, int]:
        """(drafter tokens, forced tokens) among the first n tokens (the accepted ones)."""
        forced = sum(self.forced[:n])
        return n - forced, forced


def build_draft(grammar: GrammarState, vocab: int, drafter: Drafter, history: Sequence[int], ask: Ask,
                limit: int, gamma: int, pending: Sequence[int] = ()) -> GrammarDraft:
    """Build a round's draft under the grammar (see the module docstring), consuming it into the grammar.

    Args:
        grammar: the request's grammar, in the committed state (history's tokens consumed).
        vocab: the target's V.
        drafter: the request's drafter (its `free` and `wants_hidden` say when it may be asked again).
        history: prompt + committed tokens (the last one pending).
        ask: the loop's proposal (see `Ask`).
        limit: most draft tokens in all (the verify width and max_tokens allow), >= 0.
        gamma: most drafter tokens (the policy's), >= 0.
        pending: forced tokens left over from the previous round's draft (GrammarDraft.forced_next[1:]),
            committed before anything else.

    Returns:
        The GrammarDraft; the grammar is left after its tokens, with the bonus mask prefetched when
        GrammarDraft.bonus is None.
    """
    out = GrammarDraft()
    offered: List[int] = []
    q_rows: List[Optional[mx.array]] = []  # per token: its q row, None for forced / deterministic tokens
    offered_q: Optional[mx.array] = None
    queue, can_ask = list(pending), True
    while not grammar.stopped:
        span = queue or grammar.forced()
        queue = []
        if span:
            take = span[: limit - len(out.tokens)]
            _append(out, q_rows, take, forced=True, vocab=vocab)
            grammar.consume(take)
            if len(take) < len(span):
                out.forced_next = list(span[len(take):])
                out.bonus = one_hot_mask(out.forced_next[0], vocab)
                break
            offered, offered_q = [], None  # the drafter's tokens no longer follow the draft's end
            if out.drafted:  # inserted mid-draft: only a free drafter is asked again
                can_ask = can_ask and drafter.free
            continue
        room = min(limit - len(out.tokens), gamma - out.drafted)
        if room <= 0:
            break
        if not offered:
            if not can_ask or (out.tokens and drafter.wants_hidden):  # taps exist for committed rows only
                break
            can_ask = drafter.free
            draft, offered, offered_q = ask(list(history) + out.tokens, room)
            if out.draft is None:
                out.draft = draft
            if not offered:
                break
        token, offered = offered[0], offered[1:]
        row, offered_q = (None, None) if offered_q is None else (offered_q[0], offered_q[1:])
        mask = grammar.mask()
        if not allows(mask, token, vocab):
            out.refused, out.refused_q, out.bonus = True, row, mask
            break
        _append(out, q_rows, [token], forced=False, vocab=vocab, q_row=row, mask=mask)
        grammar.consume([token])
    if out.bonus is None:
        grammar.prefetch()
    if any(r is not None for r in q_rows):
        out.q = mx.stack([r if r is not None else _one_hot_row(t, vocab) for r, t in zip(q_rows, out.tokens)])
    return out


def _append(out: GrammarDraft, q_rows: List[Optional[mx.array]], tokens: Sequence[int], forced: bool, vocab: int,
            q_row: Optional[mx.array] = None, mask: Optional[np.ndarray] = None) -> None:
    """Add tokens to the draft: forced ones with one-hot masks, a drafter's token with its mask and q row."""
    for t in tokens:
        out.tokens.append(int(t))
        out.forced.append(forced)
        out.masks.append(one_hot_mask(int(t), vocab) if forced else mask)
        q_rows.append(q_row)


def _one_hot_row(token: int, vocab: int) -> mx.array:
    """[V] float32 one-hot at token: the q row of a forced token."""
    return (mx.arange(vocab) == token).astype(mx.float32)


def commit(grammar: GrammarState, draft: GrammarDraft, n: int, token: int) -> List[int]:
    """Leave the grammar after the round's committed tokens draft.tokens[:n] + [token]: roll back the rejected
    tail, consume `token`. Returns the forced tokens the next round commits first (GrammarDraft.forced_next
    past the first, when the whole draft was accepted; else []).

    A token after the grammar has ended (an end-of-sequence token was committed before it: the consumer stops
    there and never receives it) is not consumed.

    Raises:
        MlxInferError: the grammar refuses `token` before it has ended (a bug: it was picked under the mask).
    """
    grammar.rollback(len(draft.tokens) - n)
    if grammar.accepted([token]) == 1:
        grammar.consume([token])
    elif not grammar.stopped:
        raise MlxInferError(f"the verify committed token {token}, which the grammar refuses")
    if n == len(draft.tokens) and draft.forced_next:
        return list(draft.forced_next[1:])
    return []
