"""Each policy evicts what its paper says on a constructed example."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import MlxInferError
from mlx_infer.kv import BlockPool, TokenTable
from mlx_infer.kv.policies import AttentionStats, make_policy


def table_of(n: int, dead=()) -> TokenTable:
    pool = BlockPool(1, block_size=4)
    pool.configure(1, 1, 1, mx.float32)
    t = TokenTable(pool)
    t.append(n)
    t.evict(list(dead))
    return t


def stats(tokens, rows) -> AttentionStats:
    """rows: [H, S] attention summed over the observed queries (one query per row here)."""
    return AttentionStats(np.asarray(tokens), np.asarray(rows, np.float32), 1)


def test_h2o_keeps_heavy_hitters_and_recent_window():
    t = table_of(20)
    heavy = [2, 7, 11]
    score = np.full(20, 0.01)
    score[heavy] = 0.3
    score[[0, 13]] = 0.02  # the next best among the rest
    p = make_policy("h2o")
    p.observe(stats(range(20), [score / score.sum()]))
    evicted = p.choose(t, 10)
    # 10 kept: half of them the recent window (15..19), the rest the 5 highest scores before it.
    assert set(evicted) == set(range(20)) - set(heavy) - {0, 13} - set(range(15, 20))
    assert len(evicted) == 10


def test_h2o_accumulates_over_observations():
    t = table_of(8)
    p = make_policy("h2o", recent_fraction=0.0)
    p.observe(stats(range(8), [[0.5, 0, 0, 0, 0, 0, 0, 0.5]]))
    p.observe(stats(range(8), [[0, 0, 0.6, 0, 0, 0, 0, 0.4]]))
    p.observe(stats(range(8), [[0, 0, 0.3, 0, 0, 0, 0, 0.7]]))
    assert set(p.choose(t, 5)) == {1, 3, 4, 5, 6}  # 7 (1.6), 2 (0.9) and 0 (0.5) are the heavy hitters


def test_scissorhands_evicts_persistently_unimportant_and_protects_recent():
    t = table_of(12)
    p = make_policy("scissorhands", history=2, recent=3, low=1.0)
    uniform = 1 / 12
    old = np.full(12, 0.5 / 11)
    old[3] = 0.5  # token 3 was important only in an observation that leaves the history window
    p.observe(stats(range(12), [old]))
    for _ in range(2):
        a = np.full(12, 0.2 / 9)  # low: below 1/12
        a[[1, 5, 6]] = 0.8 / 3  # high in every remembered observation
        p.observe(stats(range(12), [a]))
        assert a[0] < uniform < a[1]
    evicted = p.choose(t, 5)
    # low twice: 0, 2, 3, 4, 7, 8 (9..11 are the protected recent tokens); the oldest 5 of them go
    assert list(evicted) == [0, 2, 3, 4, 7]


def test_streaming_keeps_sinks_and_window():
    t = table_of(20, dead=[5])
    evicted = make_policy("streaming").choose(t, 8)
    assert list(evicted) == [4, 6, 7, 8, 9, 10, 11, 12]  # live tokens after the 4 sinks, oldest first


def test_snapkv_pools_per_head_and_keeps_window():
    t = table_of(24)
    a = np.zeros((2, 24))
    a[0, 5] = 0.9  # head 0: one spike; pooling (kernel 5) spreads its vote to 3..7
    a[1, 15] = 0.5  # head 1: a weaker spike at 15
    p = make_policy("snapkv", window=4, kernel=5)
    p.observe(stats(range(24), a))
    evicted = p.choose(t, 15)  # the prefix is 0..19 (20..23 is the window): keep 5 of it
    assert set(range(24)) - set(evicted) == {3, 4, 5, 6, 7, 20, 21, 22, 23}
    assert p.once


def test_snapkv_heads_vote():
    t = table_of(24)
    a = np.zeros((2, 24))
    a[0, 5], a[1, 6] = 0.9, 0.95  # pooled: head 0 marks 3..7, head 1 (slightly stronger) 4..8
    p = make_policy("snapkv", window=4, kernel=5)
    p.observe(stats(range(24), a))
    kept = set(range(24)) - set(p.choose(t, 15))
    assert kept == {4, 5, 6, 7, 8, 20, 21, 22, 23}  # 4..7 kept by both heads, then 8 over 3


def test_snapkv_evicts_nothing_from_a_prompt_within_its_window():
    """A prompt no longer than the window has no prefix to rank: nothing is evicted (it raised on the empty
    prefix); asked for more than the prefix, it evicts the prefix alone."""
    p = make_policy("snapkv", window=32, kernel=5)
    p.observe(stats(range(31), np.ones((3, 31))))
    assert p.choose(table_of(31), 15).size == 0
    p.observe(stats(range(40), np.ones((3, 40))))
    assert list(p.choose(table_of(40), 20)) == list(range(8))


def test_random_evicts_distinct_live_tokens_repeatably():
    t = table_of(30, dead=range(0, 30, 3))
    a, b = make_policy("random", seed=4).choose(t, 12), make_policy("random", seed=4).choose(t, 12)
    assert np.array_equal(a, b) and len(set(a.tolist())) == 12
    assert not set(a.tolist()) & set(range(0, 30, 3))
    assert not np.array_equal(a, make_policy("random", seed=5).choose(t, 12))


def test_unknown_policy():
    with pytest.raises(MlxInferError, match="unknown eviction policy 'lru'"):
        make_policy("lru")
