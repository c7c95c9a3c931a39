"""Eviction on real models: the tokens' original RoPE positions are kept (logits equal those of a plain dense
cache holding exactly the live tokens), the query tap changes nothing, the observer's statistics are the
attention probabilities, and repacking changes the retained blocks but not the logits (vs Naive-Evict)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.kv import make_paged_cache, make_pool
from mlx_infer.kv.evict import EvictionController
from mlx_infer.kv.observe import AttentionObserver, QueryTap
from mlx_infer.kv.policies import make_policy
from mlx_infer.kv.repack import Repacker

IDS = [(i * 37 + 11) % 250 + 3 for i in range(80)]


class LiveList:
    """A reference cache: live K/V concatenated in a list, the RoPE offset counted apart."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return None if N == 1 else "causal"

    def keep(self, idx):
        self.keys, self.values = self.keys[:, :, idx], self.values[:, :, idx]


def test_evicted_positions_stay_original(tiny_models):
    model = tiny_models["qwen3"]
    paged = make_paged_cache(model, make_pool(model, block_size=4))
    ref = [LiveList() for _ in paged]
    model(mx.array(IDS[:40])[None], cache=paged)
    model(mx.array(IDS[:40])[None], cache=ref)
    dead = [1, 2, 3, 9, 10, 17, 30, 31, 32, 33, 38]
    paged[0].sequence.evict(dead)
    keep = mx.array([i for i in range(40) if i not in dead])
    for c in ref:
        c.keep(keep)
    for t in IDS[40:50]:
        x = mx.array([[t]])
        got, want = model(x, cache=paged), model(x, cache=ref)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5 * float(mx.abs(want).max()))
    assert paged[0].offset == 50 and paged[0].sequence.table.n_live == 50 - len(dead)


@pytest.mark.parametrize("dead", [[], [1, 2], [9]], ids=["all-live", "old-evicted", "window-evicted"])
def test_query_tap_and_observer_statistics(tiny_models, dead):
    """The observer's statistics are the probabilities of the last 8 queries over the live keys they see
    (keys at positions <= theirs). Evicting old tokens keeps each query's keys a prefix growing by one per
    query (the causal softmax kernel's rule); evicting a token inside the window breaks that (the masked
    path)."""
    model = tiny_models["llama"]
    dense = make_prompt_cache(model)
    plain = np.array(model(mx.array(IDS[:12])[None], cache=dense))
    paged = make_paged_cache(model, make_pool(model))
    with QueryTap(model) as tap:
        tapped = np.array(model(mx.array(IDS[:12])[None], cache=paged))
        obs = AttentionObserver(tap.scales, paged, period=1, window=8)
        obs.record(tap.rows())
        queries = [np.array(q[0]) for q in tap.queries()]  # [H, 12, D]
        paged[0].sequence.evict(dead)
        stats = obs.stats()
    np.testing.assert_array_equal(tapped, plain)
    live = np.setdiff1d(np.arange(12), dead)
    assert np.array_equal(stats.tokens, live) and stats.n_queries == 8
    rows = []
    for layer, c in enumerate(dense):
        k = np.array(c.keys[0, :, :12])[:, live]  # [n_kv, S, D]
        q = queries[layer][:, 4:]  # the last 8 queries: positions 4..11
        rep = q.shape[0] // k.shape[0]
        for h in range(q.shape[0]):
            s = q[h] @ k[h // rep].T * tap.scales[layer]  # [8, S]
            s[np.arange(4, 12)[:, None] < live[None]] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            rows.append((p / p.sum(1, keepdims=True)).sum(0))
    np.testing.assert_allclose(stats.attention, np.stack(rows), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(stats.attention.sum(1), 8.0, rtol=1e-5)


def run_h2o(model, repack: bool):
    pool = make_pool(model, block_size=4)
    cache = make_paged_cache(model, pool)
    out = []
    with QueryTap(model) as tap:
        ctl = EvictionController(cache[0].sequence, make_policy("h2o"), 0.5, AttentionObserver(tap.scales, cache, 4, 4),
                                 Repacker(low_watermark=None, enabled=repack))
        model(mx.array(IDS[:16])[None], cache=cache)
        ctl.step(tap.rows())
        for t in IDS[16:]:
            out.append(np.array(model(mx.array([[t]]), cache=cache)))
            ctl.step(tap.rows())
            cache[0].sequence.table.check()
    return np.concatenate(out), ctl, cache[0].sequence


def test_repacking_keeps_logits_and_retains_fewer_blocks(tiny_models):
    model = tiny_models["llama"]
    naive_logits, naive, naive_seq = run_h2o(model, repack=False)
    packed_logits, packed, packed_seq = run_h2o(model, repack=True)
    np.testing.assert_array_equal(packed_logits, naive_logits)
    assert naive.record.live == packed.record.live and naive.record.evicted == packed.record.evicted > 0
    assert np.array_equal(naive_seq.table.live_tokens(), packed_seq.table.live_tokens())
    assert packed.repacker.repacks > 0
    assert packed.record.blocks[-1] < naive.record.blocks[-1]
    assert packed.record.mean_blocks() < naive.record.mean_blocks()
    assert packed_seq.pool.blocks_in_use == len(packed_seq.table.blocks)
