"""Prompt lookup / n-gram drafting (arXiv 2311.03511): copy what followed the last earlier occurrence
of the context's final n-gram, searched in the prompt and the text generated so far. Free: no model."""

from typing import Sequence

import numpy as np

from ...defaults import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM
from .base import Draft, Drafter, Worth


def find_continuation(context: np.ndarray, n: int, limit: int) -> np.ndarray:
    """Tokens that followed the most recent earlier occurrence of context's last n tokens.

    Args:
        context: [L] int token ids.
        n: n-gram length (>= 1).
        limit: most tokens to return.

    Returns:
        [<= limit] int ids (empty when the n-gram does not occur earlier, or nothing follows it).
    """
    L = context.shape[0]
    if L <= n or limit <= 0:
        return context[:0]
    pattern = context[L - n :]
    # candidate starts s in [0, L - n - 1]: windows context[s:s+n] that end before the final n-gram's end
    windows = np.lib.stride_tricks.sliding_window_view(context[: L - 1], n)  # [L - n, n]
    hits = np.nonzero((windows == pattern).all(axis=1))[0]
    if hits.size == 0:
        return context[:0]
    start = int(hits[-1]) + n
    return context[start : start + limit]


class LookupDrafter(Drafter):
    """Prompt lookup decoding: deterministic (q one-hot), works with any target.

    The longest matching n-gram (LOOKUP_MAX_NGRAM down to LOOKUP_MIN_NGRAM) wins; the match length scales
    the draft: an n-gram of length n proposes at most ceil(gamma * n / max_ngram) tokens, so weak
    (short) matches risk less verify width.
    """

    name = "lookup"
    free = True

    def __init__(self, max_ngram: int = LOOKUP_MAX_NGRAM, min_ngram: int = LOOKUP_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, context: Sequence[int], gamma: int, worth: Worth = None) -> Draft:
        if gamma <= 0:
            return Draft([])
        ctx = np.asarray(context, dtype=np.int64)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            limit = -(-gamma * n // self.max_ngram)
            cont = find_continuation(ctx, n, limit)
            if cont.size:
                return Draft([int(t) for t in cont], key=n)
        return Draft([])

    def possible_keys(self, context: Sequence[int]) -> set:
        """Match lengths n a proposal could have once an unknown token t is appended to `context`: n = 1
        whenever the context is not empty (t may occur earlier), n >= 2 only if the context's last n - 1
        tokens occur earlier with a token after them (t may be that token)."""
        ctx = np.asarray(context, dtype=np.int64)
        keys = {1} if ctx.size and self.min_ngram <= 1 else set()
        for n in range(max(2, self.min_ngram), self.max_ngram + 1):
            if find_continuation(ctx, n - 1, 1).size:
                keys.add(n)
        return keys
