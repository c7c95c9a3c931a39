"""Token-table edge cases the random sequences reach rarely: a freed block id handed out again while dead
tokens still name it, and a repack reusing a source block as its destination, followed by a rollback; when
the table says its tokens form one run of slots."""

import mlx.core as mx
import numpy as np

from mlx_infer.kv import BlockPool, TokenTable
from mlx_infer.kv.repack import commit, plan_repack
from mlx_infer.kv.sequence import PagedSequence


def test_rollback_after_block_reuse_keeps_slots_unique():
    pool = BlockPool(1, block_size=4)
    pool.configure(1, 1, 1, mx.float32)
    seq = PagedSequence(pool, 1)
    t = seq.table
    t.append(8)  # tokens 0..3 in block 0, 4..7 in block 1
    assert t.evict(range(4)) == [0]  # block 0 is free again
    t.evict([5, 6])
    t.append(4)  # 8..11 get block 0 back
    assert t.location(8) == (0, 0)
    t.evict([9, 10])
    plan = plan_repack(t, pool)  # 4, 7, 8, 11 packed into block 0 (a source) in logical order
    assert plan.destinations == (0,) and set(plan.sources) == {0, 1}
    commit(seq, plan)
    assert [t.location(i) for i in (4, 7, 8, 11)] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert t.truncate(9) == 3  # 9..11 rolled back: 11 frees slot 3; the dead 9, 10 free nothing
    assert t.fill[0] == 3
    new = t.append(2)
    t.check()
    assert new.tolist() == [3, pool.block_size * t.blocks[-1]]  # slot 3 of block 0, then a fresh block
    assert np.array_equal(t.live_tokens(), [4, 7, 8, 9, 10])


def test_waste_and_block_list():
    pool = BlockPool(1, block_size=4)
    pool.configure(1, 1, 1, mx.float32)
    t = TokenTable(pool)
    t.append(10)
    assert t.blocks == [0, 1, 2] and t.waste() == 1 - 10 / 12
    t.evict([0, 1, 4, 5, 6])
    assert t.waste() == 1 - 5 / 12 and pool.blocks_in_use == 3
    t.evict([2, 3])
    assert t.blocks == [1, 2] and pool.blocks_in_use == 2 and t.waste() == 1 - 3 / 8


def test_run_of_consecutive_slots():
    """`run` names the first slot while every token is live in consecutive slots: lost with a block that
    does not follow, or an eviction; back when a rollback removes what broke it."""
    pool = BlockPool(1, block_size=4)
    pool.configure(1, 1, 1, mx.float32)
    a, b = TokenTable(pool), TokenTable(pool)
    assert a.run is None
    a.append(3)
    assert a.run == 0
    a.append(3)  # into block 1, which follows block 0
    assert a.run == 0 and a.blocks == [0, 1]
    b.append(1)  # block 2 goes to another request
    a.append(3)  # block 3: slot 12 does not follow slot 7
    assert a.run is None and a.blocks == [0, 1, 3]
    a.truncate(8)  # back to blocks 0 and 1: consecutive again
    assert a.run == 0
    a.evict([2])
    assert a.run is None
    a.truncate(2)  # the evicted token rolled back too
    assert a.run == 0
    a.check()
    # a cached prefix: a run when its blocks follow one another
    pool = BlockPool(1, block_size=4)
    pool.configure(1, 1, 1, mx.float32)
    writer = TokenTable(pool)
    writer.append(12)  # blocks 0, 1, 2
    forward, backward = TokenTable(pool), TokenTable(pool)
    forward.adopt([1, 2])
    backward.adopt([2, 1])
    assert forward.run == 4 and backward.run is None
    for t in (writer, forward, backward):
        t.check()
