"""Prompt lookup's n-gram search (speculative/drafters/lookup.py) against a brute-force oracle: the
most recent earlier occurrence of the context's last n ids, searched over the ids packed as bytes (a byte
match that straddles two ids is not an occurrence)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_infer.speculative.drafters.lookup import LookupDrafter, find_continuation


def oracle(context: list, n: int, limit: int) -> list:
    L = len(context)
    for s in range(L - n - 1, -1, -1):  # windows context[s:s+n] inside context[:L - 1], newest first
        if context[s:s + n] == context[L - n:]:
            return context[s + n:s + n + limit]
    return []


#: Ids from a small alphabet (many matches), large ones (their bytes can line up across id boundaries).
IDS = st.one_of(st.integers(0, 5), st.sampled_from([0, 5, 0x05000000, 0x00000500, 2 ** 31 - 1]))


@settings(max_examples=400, deadline=None)
@given(st.lists(IDS, max_size=40), st.integers(1, 4), st.integers(0, 6))
def test_find_continuation_equals_the_oracle(context, n, limit):
    assert find_continuation(context, n, limit) == oracle(context, n, limit)


def test_a_match_across_id_boundaries_is_not_an_occurrence():
    # little-endian bytes: 00 00 00 05 | 00 00 00 00 | 05 00 00 00 -> "05 00 00 00" also at byte 3
    context = [0x05000000, 0, 7, 5]
    assert find_continuation(context, 1, 3) == []
    assert find_continuation([5, 9] + context, 1, 2) == [9, 0x05000000]


def test_the_drafter_takes_the_longest_match():
    drafter = LookupDrafter(max_ngram=3, min_ngram=1)
    context = [1, 2, 3, 4, 9, 9, 2, 3, 7, 7, 1, 2, 3]
    draft = drafter.propose(context, gamma=3)  # "1 2 3" occurred at 0, followed by 4 9 9
    assert draft.tokens == [4, 9, 9] and draft.key == 3
    assert drafter.possible_keys([1, 2, 3, 1, 2]) == {1, 2, 3}
    assert drafter.possible_keys([8, 9]) == {1}
