"""Prompt lookup / n-gram drafting (arXiv 2311.03511): copy what followed the last earlier occurrence
of the context's final n-gram, searched in the prompt and the text generated so far. Free: no model.

The search runs over the ids packed as int32 bytes with `bytes.rfind` (C's substring search), not NumPy: it
runs right after each verify forward's evaluation, and there the first NumPy calls wait on MLX's CPU
backend far longer than the few microseconds of work.
"""

from array import array
from typing import List, Optional, Sequence

from ...defaults import LOOKUP_MAX_NGRAM, LOOKUP_MIN_NGRAM
from .base import Draft, Drafter, Worth

_ITEM = array("i").itemsize  # bytes per packed id (int32)


def pack(context: Sequence[int]) -> bytes:
    """The ids as int32 bytes, what find_continuation searches (token ids are below 2^31)."""
    return array("i", context).tobytes()


def find_continuation(context: Sequence[int], n: int, limit: int, packed: Optional[bytes] = None) -> List[int]:
    """Tokens that followed the most recent earlier occurrence of context's last n tokens.

    Args:
        context: [L] int token ids.
        n: n-gram length (>= 1).
        limit: most tokens to return.
        packed: pack(context), when the caller has it (several n over one context).

    Returns:
        [<= limit] int ids (empty when the n-gram does not occur earlier, or nothing follows it).
    """
    L = len(context)
    if L <= n or limit <= 0:
        return []
    data = pack(context) if packed is None else packed
    pattern = data[(L - n) * _ITEM:]
    end = (L - 1) * _ITEM  # candidate windows lie inside context[:L - 1]: they end before the final n-gram does
    while True:
        pos = data.rfind(pattern, 0, end)
        if pos < 0:
            return []
        if pos % _ITEM == 0:  # a match on id boundaries (others straddle two ids' bytes)
            start = pos // _ITEM + n
            return list(context[start:start + limit])
        end = pos + len(pattern) - 1  # the next search: matches starting before pos


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
        ctx = list(context)
        packed = pack(ctx)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            limit = -(-gamma * n // self.max_ngram)
            cont = find_continuation(ctx, n, limit, packed)
            if cont:
                return Draft([int(t) for t in cont], key=n)
        return Draft([])

    def offer_key(self, context: Sequence[int]) -> Optional[int]:
        """The length of the longest n-gram match (propose's key), None without one."""
        return self.propose(context, 1).key

    def possible_keys(self, context: Sequence[int]) -> set:
        """Match lengths n a proposal could have once an unknown token t is appended to `context`: n = 1
        whenever the context is not empty (t may occur earlier), n >= 2 only if the context's last n - 1
        tokens occur earlier with a token after them (t may be that token)."""
        ctx = list(context)
        packed = pack(ctx)
        keys = {1} if ctx and self.min_ngram <= 1 else set()
        for n in range(max(2, self.min_ngram), self.max_ngram + 1):
            if find_continuation(ctx, n - 1, 1, packed):
                keys.add(n)
        return keys
