"""Speculative rollback on the paged cache: trim(n) after a multi-token forward leaves the state of never
having appended (slots freed), and speculative decoding with prompt lookup (default model) and DFlash (tiny
llamas of tests/speculative) gives plain decoding's tokens."""

import mlx.core as mx
import numpy as np
import pytest
from speculative.block_drafters import random_dflash
from speculative.conftest import tiny_llama as speculative_tiny_llama

from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.kv import make_paged_cache, make_pool
from mlx_infer.speculative import LookupDrafter, SpecStats, speculative_tokens
from mlx_infer.speculative.drafters.dflash import DFlashDrafter

REPEAT = "one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. one two"


def test_trim_after_multi_token_forward_is_never_appended(default_engine):
    model = default_engine.model
    ids = default_engine.tokenizer.encode(REPEAT)
    pool_a, pool_b = make_pool(model, block_size=4), make_pool(model, block_size=4)
    a, b = make_paged_cache(model, pool_a), make_paged_cache(model, pool_b)
    model(mx.array(ids[:-7])[None], cache=a)
    model(mx.array(ids[:-7])[None], cache=b)
    model(mx.array(ids[-7:])[None], cache=a)  # 7 draft tokens verified at once ...
    assert a[0].offset == len(ids) and pool_a.blocks_in_use > pool_b.blocks_in_use
    assert all(c.trim(7) == 7 for c in a)  # ... and all rejected
    ta, tb = a[0].sequence.table, b[0].sequence.table
    assert [c.offset for c in a] == [c.offset for c in b] == [len(ids) - 7] * len(a)
    assert pool_a.blocks_in_use == pool_b.blocks_in_use == len(ta.blocks)  # the slots were freed
    assert np.array_equal(ta.live_slots(), tb.live_slots()) and ta.fill == tb.fill
    for ca, cb in zip(a, b):
        for x, y in zip(ca.state, cb.state):
            np.testing.assert_array_equal(np.array(x), np.array(y))
    nxt = mx.array([ids[-7:-4]])
    np.testing.assert_array_equal(np.array(model(nxt, cache=a)), np.array(model(nxt, cache=b)))


def test_speculative_lookup_greedy_identical(default_engine):
    model = default_engine.model
    ids = default_engine.tokenizer.encode(REPEAT)
    pool = make_pool(model)
    stats = SpecStats()
    cache = make_paged_cache(model, pool)
    got = list(speculative_tokens(model, ids, SamplingParams(), 24, LookupDrafter(), 4, stats=stats, cache=cache))
    assert got == list(plain_tokens(model, ids, SamplingParams(), 24))
    assert stats.committed == 24 and sum(stats.proposed) > 0  # multi-token forwards were rolled back or kept
    assert pool.blocks_in_use == -(-cache[0].offset // pool.block_size)


@pytest.mark.parametrize("block", [3, 5])
def test_tiny_dflash_greedy_identical_on_the_paged_cache(block):
    """DFlash (a block drafter fed the target's hidden states) on a tiny llama: the paged cache gives the
    tokens of plain decoding on the dense cache, and the rolled-back drafts leave no block behind."""
    target = speculative_tiny_llama(seed=1, vocab=64, scale=3.0)
    drafter = DFlashDrafter(random_dflash(seed=block, vocab=64, block=block), target)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 4, 33, 2, 17]):
        base = list(plain_tokens(target, prompt, SamplingParams(), 24))
        pool = make_pool(target, block_size=4)
        cache = make_paged_cache(target, pool)
        stats = SpecStats()
        got = list(speculative_tokens(target, prompt, SamplingParams(), 24, drafter, block - 1, stats, cache=cache))
        assert got == base and stats.mode == "dflash" and stats.rounds > 0
        assert pool.blocks_in_use == -(-cache[0].offset // 4)
        cache[0].sequence.release()
        assert pool.blocks_in_use == 0
