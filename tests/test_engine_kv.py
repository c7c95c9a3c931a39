"""The Engine on the paged KV cache: greedy tokens identical to the dense cache (plain and speculative), the
kept cache reused across a chat's turns, blocks back in the pool whenever a cache is dropped, eviction with
repacking vs Naive-Evict (the same tokens, fewer blocks), the budget error before prefill, the kv stats, and
the options' one-line errors."""

import math

import pytest

import mlx_infer
from mlx_infer.errors import MlxInferError
from mlx_infer.kv import KVBudgetError

PROMPTS = ["What is the capital of France?",
           "Copy this: one two three four five six seven eight nine ten. one two three four five six seven"]
KV_KEYS = {"retained_blocks", "retained_blocks_end", "retained_blocks_max", "live_tokens", "waste", "repacks",
           "repack_s", "peak_kv_bytes", "block_size", "evict", "repack", "evicted_tokens"}


@pytest.fixture(scope="module")
def tiny_paged(tiny_llama):
    return mlx_infer.load(str(tiny_llama[0]), weights="float32", kv_cache="paged", block_size=4)


@pytest.fixture(scope="module")
def paged(default_gguf):
    return mlx_infer.load(weights="float32", kv_cache="paged")


@pytest.fixture
def fresh(paged):
    """The paged default engine with no kept cache before and after the test."""
    paged.reset()
    yield paged
    paged.reset()


def long_prompt(wikitext, paged, n=160):
    ids = paged.tokenizer.encode(wikitext[2000:2000 + 10 * n])[:n]
    return paged.tokenizer.decode(ids)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("mode", ["off", "lookup", "draft"])
def test_tiny_paged_greedy_equals_dense(tiny_engine, tiny_paged, prompt, mode):
    kw = {"speculative": mode, "max_draft": 3, "draft_model": tiny_engine if mode == "draft" else None}
    tiny_engine.reset()
    dense = tiny_engine.generate(prompt, max_tokens=24)
    tiny_paged.reset()
    got = tiny_paged.generate(prompt, max_tokens=24, **kw)
    assert got.token_ids == dense.token_ids and got.finish_reason == dense.finish_reason
    assert dense.stats.kv is None and got.stats.kv["block_size"] == 4
    if mode != "off":
        assert got.stats.spec_mode == mode and got.stats.rounds > 0


@pytest.mark.parametrize("mode, max_draft", [("off", "auto"), ("lookup", 6), ("dflash", 3)])
def test_default_paged_greedy_equals_dense(default_engine, fresh, mode, max_draft):
    default_engine.reset()
    dense = default_engine.generate(PROMPTS[1], max_tokens=16)
    got = fresh.generate(PROMPTS[1], max_tokens=16, speculative=mode, max_draft=max_draft)
    assert got.token_ids == dense.token_ids and got.text == dense.text
    if mode != "off":
        assert got.stats.spec_mode == mode and got.stats.rounds > 0


def test_chat_next_turn_reuses_the_kept_paged_cache(default_engine, fresh):
    turn1 = [{"role": "user", "content": "Name a color."}]
    first = fresh.generate(turn1, max_tokens=8)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a fruit?"}]
    kept = fresh.generate(turn2, max_tokens=12)
    assert kept.stats.cached_prompt_tokens > 0
    default_engine.reset()
    assert kept.token_ids == default_engine.generate(turn2, max_tokens=12).token_ids
    fresh.reset()
    again = fresh.generate(turn2, max_tokens=12)
    assert again.stats.cached_prompt_tokens == 0 and again.token_ids == kept.token_ids


def test_blocks_return_to_the_pool(fresh):
    """A finished request's full blocks stay in the prefix cache, its partial last block goes back; reset
    returns every block; a stopped request leaks none."""
    pool, bs = fresh.kv_pool, fresh.kv_pool.block_size

    def held(r) -> range:
        """The full blocks a finished request's cache may hold: its prompt and every token but the last, or
        with the last one too (forwarded ahead before the request ended; an EOS as well)."""
        n = r.stats.prompt_tokens + len(r.token_ids)
        return range((n - 1) // bs, (n + 1) // bs + 1)

    first = fresh.generate(PROMPTS[0], max_tokens=8)
    assert pool.blocks_in_use > 0 and pool.blocks_in_use in held(first)
    fresh.reset()
    assert pool.blocks_in_use == 0
    a = fresh.generate(PROMPTS[1], max_tokens=8, chat_template=False)
    in_a = pool.blocks_in_use
    b = fresh.generate("Something else entirely, please. " * 3, max_tokens=8, chat_template=False)
    assert b.stats.cached_prompt_tokens == 0 and in_a in held(a)
    assert pool.blocks_in_use - in_a in held(b) and in_a > 0  # both prefixes cached
    # the consumer stopping early keeps the full blocks of what was delivered and no block leaks
    fresh.reset()
    steps = fresh.stream_steps(PROMPTS[1], max_tokens=20)
    for _, _ in zip(range(3), steps):
        pass
    steps.close()
    assert pool.blocks_in_use <= (len(fresh.encode(PROMPTS[1])) + 3) // bs
    fresh.reset()
    assert pool.blocks_in_use == 0


def test_eviction_repack_vs_naive_evict(fresh, wikitext):
    prompt = long_prompt(wikitext, fresh)
    packed = fresh.generate(prompt, max_tokens=32, chat_template=False, evict="h2o:0.5")
    assert fresh.kv_pool.blocks_in_use == 0  # an evicted cache is not kept: its blocks are back
    naive = fresh.generate(prompt, max_tokens=32, chat_template=False, evict="h2o:0.5", repack=False)
    assert naive.stats.cached_prompt_tokens == 0
    assert packed.token_ids == naive.token_ids  # the same decisions: Naive-Evict and vToken give the same output
    p, n = packed.stats.kv, naive.stats.kv
    assert p["evicted_tokens"] == n["evicted_tokens"] > 0 and p["live_tokens"] == n["live_tokens"]
    assert p["repacks"] > 0 and n["repacks"] == 0 and (p["repack"], n["repack"]) == (True, False)
    assert p["retained_blocks"] < n["retained_blocks"] and p["retained_blocks_end"] < n["retained_blocks_end"]
    assert p["retained_blocks_max"] < n["retained_blocks_max"]
    assert p["waste"] < n["waste"]
    # half the tokens live: vToken keeps about ceil(live / 16) blocks, Naive-Evict nearly all of them
    assert p["retained_blocks_end"] <= math.ceil(p["live_tokens"] / 16) + 1
    total = len(fresh.encode(prompt, chat_template=False)) + 32
    assert abs(p["live_tokens"] - total / 2) <= 2


def test_request_over_budget_fails_before_prefill(default_gguf, paged):
    paged.generate(PROMPTS[0], max_tokens=2)
    block = paged.kv_pool.block_bytes  # bytes of one block, all layers, K and V
    small = mlx_infer.Engine(paged.model, paged.tokenizer, paged.config, paged.source, kv_cache="paged",
                             kv_budget=4 * block)  # 4 blocks of 16 tokens
    n = len(small.encode(PROMPTS[0]))
    ok = small.generate(PROMPTS[0], max_tokens=4)
    assert ok.stats.kv["retained_blocks_end"] == math.ceil((n + 4) / 16) <= 4
    cached = small.kv_pool.blocks_in_use  # the full blocks the prefix cache kept
    assert (n + 3) // 16 <= cached <= (n + 4) // 16 and cached > 0
    with pytest.raises(KVBudgetError, match="KV budget") as e:
        small.generate(PROMPTS[0], max_tokens=64)
    assert "\n" not in str(e.value) and f"needs {math.ceil((n + 64) / 16)} KV blocks" in str(e.value)
    assert small.kv_pool.blocks_in_use == cached  # the refused request's blocks went back; the cache's stay
    with pytest.raises(KVBudgetError):
        small.generate("Something else entirely. " * 3, max_tokens=64)
    assert small.kv_pool.blocks_in_use == cached  # a refused request that shares nothing frees no cached block
    m = len(small.encode(PROMPTS[1]))
    with pytest.raises(KVBudgetError):
        small.generate(PROMPTS[1], max_tokens=64 - m + 1)
    # with eviction only the prompt (and its first token) must fit: eviction keeps the rest within budget
    evicted = small.generate(PROMPTS[1], max_tokens=64 - m + 1, evict="streaming:0.5")
    assert evicted.stats.generated_tokens > 0 and evicted.stats.kv["peak_kv_bytes"] <= 4 * block
    with pytest.raises(KVBudgetError, match="evicting streaming:0.5 without repacking"):  # Naive-Evict: every token
        small.generate(PROMPTS[1], max_tokens=64 - m + 1, evict="streaming:0.5", repack=False)
    with pytest.raises(KVBudgetError, match="evicting h2o:0.5.* holds 4: raise kv_budget or lower max_tokens$"):
        small.generate(PROMPTS[1], max_tokens=200, evict="h2o:0.5")  # keeps ~100 tokens live: 8 blocks
    with pytest.raises(KVBudgetError, match=r"^the KV budget of 4\.0 KiB \(smaller than one block of 16 tokens, "
                                            r"which takes 720\.0 KiB with this model\) holds no KV block"):
        small.configure_kv(kv_cache="paged", kv_budget="4KiB")  # refused where it is given, not per request
    assert small.kv_pool.max_blocks == 4  # the previous setting stays


def test_an_evicting_request_that_fits_once_packed_runs_to_the_end(paged):
    """13 blocks of 16 tokens and a request of ~300 tokens evicting half: it fits only packed (about 150
    live tokens, 10 blocks), so it is repacked when the pool runs out of free blocks, not failed mid-answer
    (before, only its prompt was checked and the repack waited for a low watermark it never reached)."""
    small = mlx_infer.Engine(paged.model, paged.tokenizer, paged.config, paged.source, kv_cache="paged",
                             kv_budget=13 * paged.kv_pool.block_bytes)
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    r = small.generate(prompt, max_tokens=290, evict="h2o:0.5", chat_template=False)
    kv = r.stats.kv
    assert r.stats.generated_tokens == 290 and kv["repacks"] > 0
    assert kv["peak_kv_bytes"] <= 13 * small.kv_pool.block_bytes and small.kv_pool.blocks_in_use == 0


def test_kv_stats(fresh, default_engine):
    r = fresh.generate(PROMPTS[0], max_tokens=10)
    kv = r.stats.kv
    assert set(kv) == KV_KEYS and set(r.stats.to_dict()["kv"]) == KV_KEYS
    held = kv["retained_blocks_end"]  # the request's blocks when it ended
    assert kv["peak_kv_bytes"] == held * fresh.kv_pool.block_bytes
    # no eviction: the cache holds the prompt and every delivered token, EOS included (mlx-lm ran the last
    # one's forward)
    assert r.finish_reason == "stop"
    assert kv["live_tokens"] == r.stats.prompt_tokens + r.stats.generated_tokens + 1
    assert held == math.ceil(kv["live_tokens"] / 16)
    assert fresh.kv_pool.blocks_in_use == kv["live_tokens"] // 16  # its full blocks stay in the prefix cache
    assert kv["waste"] == pytest.approx(1 - kv["live_tokens"] / (16 * held), abs=1e-4)
    assert math.ceil(r.stats.prompt_tokens / 16) <= kv["retained_blocks"] <= kv["retained_blocks_max"] == held
    assert (kv["evict"], kv["repack"], kv["repacks"], kv["evicted_tokens"]) == (None, None, 0, 0)
    default_engine.reset()
    assert default_engine.generate(PROMPTS[0], max_tokens=2).stats.kv is None


@pytest.mark.parametrize("kwargs, message", [
    ({"evict": "nope:0.5"}, "unknown eviction policy 'nope'"),
    ({"evict": "h2o:0"}, "must be in (0, 1)"),
    ({"evict": "h2o:1"}, "must be in (0, 1)"),
    ({"evict": "h2o:-0.2"}, "must be in (0, 1)"),
    ({"evict": "h2o"}, "POLICY:RATIO"),
    ({"evict": "h2o:half"}, "not a number"),
    ({"evict": "h2o:0.5", "speculative": "lookup"}, "not supported yet"),
    ({"evict": "h2o:0.5", "repack": "no"}, "repack must be True or False"),
])
def test_bad_request_options(fresh, kwargs, message):
    with pytest.raises(MlxInferError, match=None) as e:
        fresh.generate("hi", max_tokens=2, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_evict_with_auto_speculation_decodes_plainly(fresh):
    r = fresh.generate(PROMPTS[1], max_tokens=8, speculative="auto", evict="streaming:0.3")
    assert r.stats.spec_mode == "off" and r.stats.rounds == 0 and r.stats.kv["evict"] == "streaming:0.3"


def test_evict_needs_the_paged_cache(default_engine):
    with pytest.raises(MlxInferError, match="evict needs the paged KV cache"):
        default_engine.generate("hi", max_tokens=2, evict="h2o:0.5")


@pytest.mark.parametrize("kwargs, message", [
    ({"kv_cache": "sparse"}, "kv_cache must be one of dense, paged"),
    ({"kv_cache": "paged", "kv_budget": "12XB"}, "does not parse"),
    ({"kv_cache": "paged", "kv_budget": "1.5"}, "in (0, 1]"),
    ({"kv_cache": "paged", "kv_budget": 0}, "must be positive"),
    ({"kv_cache": "paged", "block_size": 0}, "block_size must be an integer >= 1"),
    ({"kv_budget": "512MB"}, "add kv_cache='paged'"),
])
def test_bad_engine_options(default_engine, kwargs, message):
    with pytest.raises(MlxInferError) as e:
        mlx_infer.Engine(default_engine.model, default_engine.tokenizer, default_engine.config,
                         default_engine.source, **kwargs)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_failing_request_returns_its_blocks(fresh):
    fresh.generate(PROMPTS[0], max_tokens=4)
    cached = fresh.kv_pool.blocks_in_use  # the prefix cache's
    assert cached > 0
    with pytest.raises(MlxInferError, match="no model at"):  # the drafter fails to load after the cache was taken
        fresh.generate(PROMPTS[0], max_tokens=4, speculative="draft", draft_model="/missing/dir")
    assert fresh.kv_pool.blocks_in_use == cached  # its own blocks went back, the shared ones stay cached
    fresh.reset()
    assert fresh.kv_pool.blocks_in_use == 0  # and it holds no reference to those


@pytest.mark.parametrize("name", ["kv_cahce", "evict", "max_tokens"])
def test_an_unknown_load_option_fails_before_loading(name):
    """A misspelt or misplaced option names load() and the options it takes, before any model work (the
    path does not exist, so reaching the loader would raise another error)."""
    with pytest.raises(MlxInferError, match=rf"^load\(\) got an unknown option '{name}'; it takes model, .*kv_bits"):
        mlx_infer.load("/nonexistent/model.gguf", **{name: "paged"})


def test_reset_gives_the_pool_back(tiny_paged):
    """A prompt longer than the pool's first capacity grows it; reset forgets the prefix cache and shrinks
    the pool back to its initial size."""
    pool = tiny_paged.kv_pool
    tiny_paged.reset()
    first = pool.initial_blocks
    tiny_paged.generate(list(range(3, 3 + 4 * first + 10)), max_tokens=2)  # block size 4: past the capacity
    assert pool.capacity > first and pool.blocks_in_use > first
    tiny_paged.reset()
    assert pool.blocks_in_use == 0 and pool.capacity == first
