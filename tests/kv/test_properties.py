"""Random sequences of append / evict / repack / trim / share / shrink on the paged cache keep vToken's
invariants (token conservation, unique mapping, no live token lost, strictly fewer blocks per committed
plan, shared blocks never moved) and give the same K/V and attention outputs as a dense list holding
exactly the live tokens."""

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_infer.kv import BlockPool, PagedSequence
from mlx_infer.kv.cache import PagedKVCache
from mlx_infer.kv.repack import Repacker, plan_repack

N_KV, D, H, LAYERS = 2, 4, 4, 2

op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 9)),
    st.tuples(st.just("evict"), st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=6)),
    st.tuples(st.just("repack"), st.booleans()),
    st.tuples(st.just("trim"), st.integers(0, 6)),
    st.tuples(st.just("share"), st.floats(0, 1, allow_nan=False)),
    st.tuples(st.just("shrink"), st.just(0)),
)


def dense_attention(q, keys, values):
    """SDPA over K/V stacked from the reference list: q [1, H, 1, D]; keys/values [S, N_KV, D] numpy."""
    k = mx.array(np.ascontiguousarray(keys.transpose(1, 0, 2)))[None]
    v = mx.array(np.ascontiguousarray(values.transpose(1, 0, 2)))[None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)


@settings(max_examples=60, deadline=None)
@given(block_size=st.sampled_from([1, 2, 4, 16]), ops=st.lists(op, min_size=1, max_size=25), seed=st.integers(0, 99))
def test_random_operations_keep_invariants_and_attention(block_size, ops, seed):
    rng = np.random.default_rng(seed)
    pool = BlockPool(LAYERS, block_size=block_size, initial_blocks=2)
    seq = PagedSequence(pool, LAYERS)
    caches = [PagedKVCache(seq, i) for i in range(LAYERS)]
    ref = {i: [] for i in range(LAYERS)}  # per layer: [(k [N_KV, D], v)] in logical order
    live = []  # live bit per logical token
    shared = {}  # block -> (tokens it held when shared, their slots)
    repacker = Repacker(low_watermark=None)

    for name, arg in ops:
        if name == "append":
            for layer in range(LAYERS):
                k = rng.standard_normal((1, N_KV, arg, D)).astype(np.float32)
                v = rng.standard_normal((1, N_KV, arg, D)).astype(np.float32)
                caches[layer].update_and_fetch(mx.array(k), mx.array(v))
                ref[layer] += [(k[0, :, j], v[0, :, j]) for j in range(arg)]
            live += [True] * arg
        elif name == "evict":
            alive = [i for i, a in enumerate(live) if a]
            chosen = sorted({alive[int(f * (len(alive) - 1))] for f in arg}) if alive else []
            seq.evict(chosen)
            for i in chosen:
                live[i] = False
        elif name == "repack":
            before = len(seq.table.blocks)
            plan = plan_repack(seq.table, pool)
            committed = repacker.maybe_repack(seq, force=True) if arg else None
            if committed is not None:
                assert committed.saved > 0 and len(seq.table.blocks) == before - committed.saved
                assert not set(committed.sources) & set(shared)  # shared blocks are never moved
            elif not arg:
                assert plan is None or plan.saved > 0  # plans that cannot save a block are not made
        elif name == "trim":
            n = min(arg, len(live))
            for c in caches:
                assert c.trim(arg) == n
            for layer in range(LAYERS):
                del ref[layer][len(live) - n :]
            del live[len(live) - n :]
            for b in [b for b, (toks, _) in shared.items() if any(t >= len(live) for t in toks)]:
                pool.release(b)
                del shared[b]
        elif name == "share" and seq.table.blocks:
            b = seq.table.blocks[int(arg * (len(seq.table.blocks) - 1))]
            if b not in shared:
                toks = seq.table.tokens_in(b)
                pool.incref(b)  # another request holds it (a common prefix)
                shared[b] = (toks, seq.table.slots(toks))
        elif name == "shrink":
            pool.shrink()

        # invariants
        table = seq.table
        table.check()
        expect_live = np.flatnonzero(live)
        assert table.length == len(live) and all(c.offset == len(live) for c in caches)
        assert np.array_equal(table.live_tokens(), expect_live)  # conservation, none lost
        assert pool.blocks_in_use == len(set(table.blocks) | set(shared))
        assert len(table.blocks) >= -(-len(expect_live) // block_size)
        for b, (toks, slots) in shared.items():  # still held, still in place
            assert np.array_equal(table.slots(toks[table.is_live(toks)]), slots[table.is_live(toks)])
        if len(expect_live) == 0:
            continue
        q = mx.array(rng.standard_normal((1, H, 1, D)).astype(np.float32))
        for layer in range(LAYERS):
            keys = np.stack([ref[layer][i][0] for i in expect_live], axis=0)  # [S, N_KV, D]
            values = np.stack([ref[layer][i][1] for i in expect_live], axis=0)
            k, v = caches[layer].state  # [1, N_KV, S, D]
            assert np.array_equal(np.array(k[0]), keys.transpose(1, 0, 2))
            assert np.array_equal(np.array(v[0]), values.transpose(1, 0, 2))
            got = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5)
            np.testing.assert_allclose(np.array(got), np.array(dense_attention(q, keys, values)), rtol=1e-6,
                                       atol=1e-6)
    for b in shared:
        pool.release(b)
    seq.release()
    assert pool.blocks_in_use == 0
