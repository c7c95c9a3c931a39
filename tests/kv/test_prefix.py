"""The prefix cache: full blocks keyed by their whole prefix, shared by reference, idle ones freed least
recently used first; and on the default model, a shared system prompt prefilled once."""

import mlx.core as mx
import pytest

import mlx_infer
from mlx_infer.kv import BlockPool, TokenTable
from mlx_infer.kv.prefix import PrefixCache, block_keys


def pool_of(blocks=8, block_size=4):
    pool = BlockPool(1, block_size=block_size, budget_blocks=blocks)
    pool.configure(1, 2, 2, mx.float32)
    return pool


def request(pool, tokens):
    """A finished request's table holding `tokens` (no holes)."""
    t = TokenTable(pool)
    t.append(len(tokens))
    return t


def test_keys_name_whole_prefixes():
    a, b = block_keys(list(range(12)), 4), block_keys([0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11], 4)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # same third block, other parent
    assert block_keys([1, 2, 3], 4) == []


def test_lookup_insert_and_sharing():
    pool, tokens = pool_of(), list(range(100, 110))  # 2 full blocks + 2 tokens
    cache = PrefixCache(pool)
    t = request(pool, tokens)
    assert cache.insert(tokens, t.blocks) == 2 and len(cache) == 2
    assert cache.lookup(tokens[:8]) == t.blocks[:1]  # the last token is always prefilled: 7 tokens, 1 block
    shared = cache.lookup(tokens[:8] + [5, 6, 7])
    assert shared == t.blocks[:2] and cache.hits == 4 + 8
    assert cache.lookup([100, 101, 102, 999, 104, 105, 106, 107, 108]) == []
    u = TokenTable(pool)
    u.adopt(shared)
    u.append(3)
    assert u.length == 11 and u.blocks[:2] == shared and pool.refcount[shared[0]] == 3  # t, the cache, u
    t.release()
    u.release()
    assert cache.idle_blocks == 2 and pool.blocks_in_use == 2  # only the cache holds them now


def test_make_room_frees_least_recently_used_idle_blocks():
    pool = pool_of(blocks=6)
    cache = PrefixCache(pool)
    old, new = list(range(8)), list(range(50, 58))
    for tokens in (old, new):
        t = request(pool, tokens)
        cache.insert(tokens, t.blocks)
        t.release()
    assert pool.free_blocks == 2 and cache.idle_blocks == 4
    held = TokenTable(pool)
    held.adopt(cache.lookup(old + [1]))  # `old` is in use again: not idle, and the most recently used
    assert cache.make_room(4) == 2 and pool.free_blocks == 4
    assert cache.lookup(new + [1]) == [] and len(cache.lookup(old + [1])) == 2
    assert cache.make_room(6) == 0  # nothing idle is left: held blocks are never freed


def test_max_blocks_bounds_the_idle_blocks():
    pool = pool_of(blocks=16)
    cache = PrefixCache(pool, max_blocks=2)
    for start in (0, 100, 200):
        tokens = list(range(start, start + 8))
        t = request(pool, tokens)
        cache.insert(tokens, t.blocks)
        t.release()
    assert cache.idle_blocks == 2 and pool.blocks_in_use == 2


def test_shared_system_prompt_is_prefilled_once(default_gguf):
    engine = mlx_infer.load()
    system = "You are a careful assistant. Answer in one short sentence, and never use lists. " * 3
    questions = ["What is the capital of France?", "Name a river in Egypt.", "Who wrote Hamlet?"]
    first = engine.generate_batch(questions, system=system, max_tokens=12)
    second = engine.generate_batch(questions, system=system, max_tokens=12)
    alone = [engine.generate(q, system=system, max_tokens=12) for q in questions]
    assert [r.token_ids for r in second] == [r.token_ids for r in first] == [r.token_ids for r in alone]
    shared = len(engine.encode(questions[0], system=system)) - 12  # the system part, at least
    assert all(r.stats.cached_prompt_tokens == 0 for r in first)  # admitted together: nothing cached yet
    assert all(r.stats.cached_prompt_tokens >= (shared // 16) * 16 for r in second)
    engine.reset()
    assert engine.generate_batch(questions[:1], system=system, max_tokens=2)[0].stats.cached_prompt_tokens == 0
