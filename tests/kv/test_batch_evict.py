"""Eviction in batched decoding: each evicting request of a batch gives the tokens and evictions of the same
request alone; vToken's reservations admit more requests into one KV budget than full reservations (no
eviction, Naive-Evict); the query tap's rows of a batched forward are each request's own queries."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_infer
from mlx_infer import SamplingParams
from mlx_infer.errors import MlxInferError
from mlx_infer.generation.results import collect
from mlx_infer.kv import make_paged_cache, make_pool
from mlx_infer.kv.batch import BatchStep
from mlx_infer.kv.observe import QueryTap
from mlx_infer.kv.options import EvictSpec
from mlx_infer.kv.session import probe_kv_layout, reserved_blocks


@pytest.fixture(scope="module")
def paged(default_gguf):
    return mlx_infer.load(kv_cache="paged")


@pytest.fixture(scope="module")
def passages(paged, wikitext):
    """Six 100-token wikitext passages (token ids)."""
    ids = paged.tokenizer.encode(wikitext[5000:20000])
    return [ids[i * 100:(i + 1) * 100] for i in range(6)]


def test_reserved_blocks_by_hand():
    h2o, snap = EvictSpec("h2o", 0.5), EvictSpec("snapkv", 0.5)
    # 100 prompt + 100 new tokens in blocks of 16: 13 blocks hold all 200
    assert reserved_blocks(None, True, 100, 100, 16) == (13, 13)
    assert reserved_blocks(h2o, False, 100, 100, 16) == (13, 13)  # Naive-Evict promises nothing less
    # h2o keeps ceil(0.5 * 200) = 100 live, 101 before a step's eviction: 7 blocks + 1; the prompt and the
    # first token (101 tokens) take 7 before the first eviction
    assert reserved_blocks(h2o, True, 100, 100, 16) == (8, 8)
    # a long prompt: 1000 + 1 tokens take 63 blocks until the first eviction, then 550 + 1 live: 35 + 1
    assert reserved_blocks(h2o, True, 1000, 100, 16) == (63, 36)
    # SnapKV evicts once: 500 of the prompt stay, and every new token: 600 live, 38 blocks + 1
    assert reserved_blocks(snap, True, 1000, 100, 16) == (63, 39)
    # never more than every token's blocks
    assert reserved_blocks(h2o, True, 3, 2, 16) == (1, 1)


def test_tap_rows_of_a_batched_forward_are_each_requests_queries(tiny_models):
    model = tiny_models["llama"]
    pool = make_pool(model)
    pool.configure(*probe_kv_layout(model))  # a BatchStep needs the pool's layout
    chunks = [[5, 9, 13, 2, 7], [11, 3]]
    caches = [make_paged_cache(model, pool) for _ in chunks]
    with QueryTap(model) as tap:
        step = BatchStep([c[0].sequence for c in caches], [len(c) for c in chunks])
        model(step.inputs(chunks), cache=step.caches())
        step.done()
        rows = [tap.rows(b, len(c)) for b, c in enumerate(chunks)]
        for b, c in enumerate(chunks):
            model(mx.array(c)[None], cache=make_paged_cache(model, make_pool(model)))
            alone = tap.queries()  # [1, H, n_b, D] per layer
            assert rows[b].n == len(c)
            for layer, want in enumerate(alone):
                got = rows[b].last(layer, len(c))  # [H, n_b, D]
                np.testing.assert_allclose(np.array(got), np.array(want[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy,repack", [("h2o:0.5", True), ("scissorhands:0.5", True), ("h2o:0.5", False)])
def test_batched_eviction_equals_each_alone(paged, passages, policy, repack):
    alone = []
    for p in passages[:4]:
        paged.reset()
        alone.append(paged.generate(p, max_tokens=24, evict=policy, repack=repack))
    paged.reset()
    batched = paged.generate_batch(passages[:4], max_tokens=24, evict=policy, repack=repack)
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids
        ka, kb = a.stats.kv, b.stats.kv
        assert kb["evict"] == policy and kb["repack"] is repack
        # the same decisions; the lone request also observes after its last token's forward, which a batched
        # request whose last token is sampled never runs
        assert 0 < ka["evicted_tokens"] - kb["evicted_tokens"] <= 1 or ka["evicted_tokens"] == kb["evicted_tokens"]
        assert kb["evicted_tokens"] > 40  # half of 100 + 24 tokens
        assert abs(kb["live_tokens"] - ka["live_tokens"]) <= 1 and kb["live_tokens"] <= 62 + 2  # ceil(123 / 2)
    assert paged.kv_pool.blocks_in_use == 0  # every batched request's blocks are back (none cached: evicted)


def max_running(engine, prompts, evict, repack, max_tokens=100):
    """Run `prompts` through one scheduler; returns (most requests running at once, results)."""
    sched = engine.scheduler()
    steps = [[] for _ in prompts]
    for p, s in zip(prompts, steps):
        sched.add(engine.batch_request(p, SamplingParams(max_tokens=max_tokens), evict=evict, repack=repack, emit=s.append))
    most = 0
    while sched.busy:
        sched.step()
        most = max(most, len(sched.running))
        assert engine.kv_pool.blocks_in_use <= engine.kv_pool.max_blocks
    engine.reset()
    return most, [collect(s) for s in steps]


def test_vtoken_admits_more_requests_under_one_budget(default_gguf, passages):
    """41 blocks of 16 tokens: requests of 100 + 100 tokens reserve 13 blocks without eviction or with
    Naive-Evict (3 at once), 8 with vToken at h2o:0.5 (5 at once; forced repacking keeps them within it)."""
    engine = mlx_infer.load(kv_cache="paged", kv_budget="29MiB")
    assert engine.kv_pool.max_blocks == 41
    full, full_out = max_running(engine, passages, None, True)
    naive, _ = max_running(engine, passages, "h2o:0.5", False)
    packed, packed_out = max_running(engine, passages, "h2o:0.5", True)
    assert (full, naive, packed) == (3, 3, 5)
    assert all(r.stats.generated_tokens == 100 for r in full_out + packed_out)
    assert all(r.finish_reason == "length" for r in packed_out)
    assert sum(r.stats.kv["repacks"] for r in packed_out) > 0
    assert engine.kv_pool.blocks_in_use == 0


def test_batched_eviction_options(paged, passages):
    with pytest.raises(MlxInferError, match="not supported yet"):
        paged.generate_batch(passages[:1], max_tokens=2, evict="h2o:0.5", speculative="lookup")
    with pytest.raises(MlxInferError, match="unknown eviction policy"):
        paged.generate_batch(passages[:1], max_tokens=2, evict="lru:0.5")
    with pytest.raises(MlxInferError, match="repack must be True or False"):
        paged.generate_batch(passages[:1], max_tokens=2, evict="h2o:0.5", repack="yes")
    # auto speculation with eviction decodes plainly (a batched request that never speculates: no spec_mode)
    out = paged.generate_batch(passages[:1], max_tokens=4, evict="h2o:0.5", speculative="auto")
    assert out[0].stats.spec_mode is None and out[0].stats.kv["evict"] == "h2o:0.5"


def test_runner_submit_with_eviction(paged, passages):
    paged.reset()
    want = paged.generate(passages[0], max_tokens=12, evict="streaming:0.5")
    paged.reset()
    with paged.batch_runner() as runner:
        handles = [runner.submit(paged.batch_request(passages[0], SamplingParams(max_tokens=12), evict="streaming:0.5")),
                   runner.submit(paged.batch_request(passages[1], SamplingParams(max_tokens=12)))]
        got = [h.result() for h in handles]
    assert got[0].token_ids == want.token_ids and got[0].stats.kv["evicted_tokens"] > 0
    assert got[1].stats.kv is None


def test_result_after_iterating_returns_the_whole_answer(paged, passages):
    """A handle iterated to its end, or half-way, still gives its whole result (it used to wait forever)."""
    paged.reset()
    with paged.batch_runner() as runner:
        whole = runner.submit(paged.batch_request(passages[2], SamplingParams(max_tokens=8)))
        steps = list(whole)
        half = runner.submit(paged.batch_request(passages[2], SamplingParams(max_tokens=8)))
        first = next(iter(half))
        assert whole.result() == collect(steps) and half.result().token_ids == collect(steps).token_ids
        assert first.token == steps[0].token and len(collect(steps).token_ids) == 8
