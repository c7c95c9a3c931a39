"""Rank 0's pick of a sharded request with a grammar (response_format, tools) or logprobs.

Every rank computes the same logits and rank 0 alone picks each token (generate.lockstep_tokens), so the
request's grammar and logprobs live on rank 0 only and run as in one process's plain decoding
(generation/decode.py's pick_structured and commit_forced): the logits processors, then the grammar's mask,
then the pick; the grammar consumes the token and the tokens it forces after it (jump-forward decoding), which
go to every rank with the token and into the next forward together, as one process runs them; each token's
logprob comes from the raw logits row it was picked from (a forced token's: its row of that forward).

    picker = LeadPick(params, grammar, logprobs)         # rank 0; None on the other ranks
    for token in lockstep_tokens(shard, ids, params, picker=picker): ...
    picker.close()
"""

from typing import List, Optional

import mlx.core as mx

from ..generation.decode import commit_forced, pick_structured
from ..generation.logprobs import LogprobQueue
from ..generation.sampling import SamplingParams, build_logits_processors, build_sampler
from ..structured.grammar import GrammarState

__all__ = ["LeadPick"]


class LeadPick:
    """Rank 0's picks of one request under its grammar, recording logprobs.

    Args:
        params: the request's sampling parameters.
        grammar: its GrammarState (None: unconstrained).
        logprobs: its LogprobQueue (None: no logprobs); the request takes one per token it delivers.
    """

    def __init__(self, params: SamplingParams, grammar: Optional[GrammarState] = None,
                 logprobs: Optional[LogprobQueue] = None):
        self.params, self.grammar, self.logprobs = params, grammar, logprobs
        self.processors, self.sampler = build_logits_processors(params), build_sampler(params)
        if grammar is not None:
            grammar.prefetch()  # the first token's mask, computed while the prompt prefills

    def pick(self, raw: mx.array, history: List[int], room: int) -> List[int]:
        """The next token from raw logits [1, V] float32 (history: the prompt and the tokens so far), then the
        tokens the grammar forces after it (at most `room`), all consumed by the grammar; its logprob recorded.

        Raises:
            ConstraintError: a token the grammar refuses (a bug: picks are made under its mask).
        """
        window = history[-self.params.repetition_context_size:]
        token = pick_structured(raw, window, self.processors, self.params, self.sampler, self.grammar)
        if self.logprobs is not None:
            self.logprobs.add(raw, [token])
        forced = commit_forced(self.grammar, token, room)
        if self.grammar is not None:
            self.grammar.prefetch()  # the next mask, on the mask thread while the next forward runs
        return [token] + forced

    def forced_rows(self, rows: mx.array, forced: List[int]) -> None:
        """The logprobs of the forced tokens, from the rows [F, V] of the forward that took them (row i: the
        logits that predict forced[i])."""
        if self.logprobs is not None and forced:
            self.logprobs.add(rows, forced)

    def close(self) -> None:
        """The request has ended: drop a mask prefetched for a pick that will not come."""
        if self.grammar is not None:
            self.grammar.close()
