"""Repacking really frees: a request with holes in every block keeps all its blocks under Naive-Evict, and
repacking returns the sparse ones to the pool (blocks in use go down) and, once the pool shrinks, to MLX
(mx.get_active_memory() goes down)."""

import gc

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.kv import BlockPool, KVBudgetError, PagedSequence
from mlx_infer.kv.cache import PagedKVCache
from mlx_infer.kv.repack import Repacker, plan_repack

LAYERS, N_KV, D, BS = 4, 4, 64, 16


def filled(tokens: int, **pool_kw):
    pool = BlockPool(LAYERS, block_size=BS, **pool_kw)
    seq = PagedSequence(pool, LAYERS)
    caches = [PagedKVCache(seq, i) for i in range(LAYERS)]
    rng = np.random.default_rng(0)
    for c in caches:
        kv = mx.array(rng.standard_normal((1, N_KV, tokens, D)).astype(np.float32))
        c.update_and_fetch(kv, kv * 2)
    mx.eval(pool.arrays())
    return pool, seq, caches


def test_repack_frees_blocks_and_memory():
    pool, seq, caches = filled(512 * BS)
    assert pool.blocks_in_use == 512
    keep = np.arange(0, 512 * BS, 4)  # one token in four stays: every block keeps 4 of its 16
    before = [np.array(c.state[0]) for c in caches]
    seq.evict(np.setdiff1d(np.arange(512 * BS), keep))
    assert pool.blocks_in_use == 512  # Naive-Evict: no block is empty, none is freed
    assert seq.table.waste() == pytest.approx(0.75)

    plan = Repacker(low_watermark=None, max_moves=None).maybe_repack(seq)
    assert plan is not None and plan.saved == 512 - 128
    assert pool.blocks_in_use == len(seq.table.blocks) == 128
    assert pool.bytes_in_use == 128 * pool.block_bytes
    for layer, c in enumerate(caches):  # the same live tokens, in the same order
        np.testing.assert_array_equal(np.array(c.state[0]), before[layer][:, :, keep])

    mx.eval(pool.arrays())
    gc.collect()
    active = mx.get_active_memory()
    assert pool.shrink()
    mx.eval(pool.arrays())
    gc.collect()
    assert pool.capacity == 256
    freed = active - mx.get_active_memory()
    assert freed >= 0.9 * (pool_bytes := (512 - 256) * pool.block_bytes), (freed, pool_bytes)
    for layer, c in enumerate(caches):  # still the same after the shrink
        np.testing.assert_array_equal(np.array(c.state[0]), before[layer][:, :, keep])


def test_a_repack_copies_at_most_max_moves_tokens_sparsest_blocks_first():
    """64 blocks, half of them keeping 4 tokens and half 8: a repack of at most 64 tokens packs the 16
    sparsest blocks (4 live each) into 4; once triggered, the next steps go on, past the trigger's waste of
    0.25 (32 blocks), until no plan saves a block: ceil(live / 16) blocks, what one forced repack (no limit)
    gives; then nothing is due until the waste exceeds 0.25 again. Every live token keeps its K."""
    pool, seq, caches = filled(64 * BS)
    before = np.array(caches[0].state[0])
    blocks = np.arange(64 * BS) // BS
    keep = np.flatnonzero(np.arange(64 * BS) % BS < np.where(blocks % 2 == 0, 4, 8))
    seq.evict(np.setdiff1d(np.arange(64 * BS), keep))
    repacker = Repacker(low_watermark=None, max_moves=64)
    first = repacker.maybe_repack(seq)
    assert len(first.tokens) == 64 and first.saved == 16 - 4
    assert all(seq.table.live_count[b] == BS for b in first.destinations)
    plans = [first]
    while (plan := repacker.maybe_repack(seq)) is not None:
        plans.append(plan)
        if len(seq.table.blocks) == 32:  # the waste is down to the trigger's 0.25: no longer due, still packing
            assert seq.table.waste() == pytest.approx(0.25) and not repacker.due(seq) and repacker.packing
    assert all(len(p.tokens) <= 64 for p in plans) and len(plans) == 2 + 4  # 16 blocks of 4 live, then 8 of 8 live
    assert len(seq.table.blocks) == -(-len(keep) // BS) == 24 and not repacker.packing
    assert repacker.maybe_repack(seq) is None and repacker.maybe_repack(seq, force=True) is None
    np.testing.assert_array_equal(np.array(caches[0].state[0]), before[:, :, keep])
    seq.table.check()


def test_no_plan_without_saving_and_shared_blocks_stay():
    pool, seq, _ = filled(4 * BS)
    seq.evict([0, 20, 40])  # three blocks lose one token each: 61 live need 4 blocks, no saving
    assert plan_repack(seq.table, pool) is None
    seq.evict(range(1, 16))  # block 0 is now empty and freed at once (both modes)
    assert pool.blocks_in_use == 3
    pool.incref(seq.table.blocks[0])  # another request shares the first remaining block
    shared = seq.table.blocks[0]
    seq.evict(list(range(33, 47)) + list(range(48, 56)))  # 2 + 8 live left in the two unshared blocks
    plan = plan_repack(seq.table, pool)  # the shared block (15 live, sparse too) is left where it is
    assert plan is not None and plan.sources == tuple(seq.table.blocks[1:]) and len(plan.destinations) == 1
    where = seq.table.slots(seq.table.tokens_in(shared))
    Repacker(low_watermark=None).maybe_repack(seq, force=True)
    assert seq.table.blocks[0] == shared and np.array_equal(seq.table.slots(seq.table.tokens_in(shared)), where)
    assert pool.blocks_in_use == 2


def test_budget_refuses_blocks():
    pool = BlockPool(1, block_size=BS, budget_blocks=2)
    seq = PagedSequence(pool, 1)
    c = PagedKVCache(seq, 0)
    c.update_and_fetch(mx.zeros((1, 1, 2 * BS, 8)), mx.zeros((1, 1, 2 * BS, 8)))
    with pytest.raises(KVBudgetError, match="KV budget holds 2 blocks"):
        c.update_and_fetch(mx.zeros((1, 1, 1, 8)), mx.zeros((1, 1, 1, 8)))
    assert seq.table.length == 2 * BS and pool.blocks_in_use == 2  # unchanged by the refusal
