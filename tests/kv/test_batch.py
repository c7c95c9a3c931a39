"""Batched decoding (continuous batching over the block pool): the same tokens as each request alone,
requests joining and leaving, the KV budget, the threaded runner and cancellation; the fused attention (the
paged-attention kernel reading the pool in place) against the gather it replaces."""

import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_infer
from gguf_factory import MODEL_TYPES
from mlx_infer import SamplingParams
from mlx_infer.errors import MlxInferError, RunnerClosedError
from mlx_infer.kernels import cpu
from mlx_infer.kernels.paged_attention import PAGED_MAX_QUERIES
from mlx_infer.kv import KVBudgetError, make_paged_cache, make_pool
from mlx_infer.kv import batch as kv_batch
from mlx_infer.kv import cache as kv_cache
from mlx_infer.kv.attention_hook import install as install_attention_hook
from mlx_infer.kv.batch import BatchStep
from mlx_infer.kv.quant_options import kv_quant

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
           "Explain what a CPU does in one sentence.", "Say hi.", "Count from one to ten."]


@pytest.fixture(scope="module")
def engine(default_gguf):
    """The default model as users load it (quantized weights on the kernels), its own engine (the batch
    tests change its KV configuration)."""
    return mlx_infer.load()


def batched_forward(model, caches, chunks, fused=True):
    """One BatchStep forward of `chunks` (token lists) over the requests' paged caches: last-column logits
    [B, V] as float32 numpy."""
    step = BatchStep([c[0].sequence for c in caches], [len(t) for t in chunks], fused=fused)
    out = model(step.inputs(chunks), cache=step.caches())[:, -1]  # [B, V]
    step.done()
    return np.array(out.astype(mx.float32))


@pytest.fixture
def kernel_calls(monkeypatch):
    """The paged-attention kernel here (skips without one), with the model's attention hooked; returns the
    list that records the query shape of every fused attention a batched step runs."""
    if cpu.find_compiler() is None:
        pytest.skip("no C++ compiler here: the CPU kernels cannot be built")
    cpu.build_cpu_kernels(quiet=True)
    cpu.refresh()
    assert cpu.available(), cpu.why_not()
    return spy_paged_attention(monkeypatch, kv_batch)


def spy_paged_attention(monkeypatch, module) -> list:
    """The list that records the query shape of every `paged_attention` call `module` makes (kv.batch: the
    batched steps; kv.cache: a PagedKVCache's own decode and verify steps)."""
    calls = []
    real = module.paged_attention

    def spy(q, *args):
        calls.append(tuple(q.shape))
        return real(q, *args)

    monkeypatch.setattr(module, "paged_attention", spy)
    return calls


def twin_caches(model, prompts, block_size, evict=()):
    """{fused: caches} for fused True / False: the same requests over two pools of `model`, each prompt
    prefilled alone, then `evict` (request, logical tokens) dropped (holes: non-contiguous positions)."""
    out = {}
    for fused in (True, False):
        pool = make_pool(model, block_size=block_size)
        caches = [make_paged_cache(model, pool) for _ in prompts]
        for ids, c in zip(prompts, caches):
            mx.eval(model(mx.array(ids)[None], cache=c))
        for b, tokens in evict:
            caches[b][0].sequence.evict(tokens)
        out[fused] = caches
    return out


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_fused_attention_matches_the_gather(tiny_models, arch, kernel_calls):
    """Ragged requests (one with evicted tokens) decoded, then a verify width of 4 and a prefill chunk of 20
    for every request: logits of the fused steps equal the gathered ones within float32 rounding (gemma3:
    sliding-window layers of 8); the kernel runs at every width, every layer (past PAGED_MAX_QUERIES in blocks
    of that many positions)."""
    model = tiny_models[arch]
    install_attention_hook(model)
    prompts = [[5, 17, 260, 99, 3, 101, 42, 7, 255, 12, 64, 9, 30, 31], [200, 31, 8], list(range(40, 75))]
    caches = twin_caches(model, prompts, 4, evict=[(2, [1, 2, 3, 9, 10, 20])])
    last = [[p[-1]] for p in prompts]
    plan = [last] * 3 + [[[7, 8, 9, 10]] * 3, [list(range(100, 120))] * 3, last]
    layers = len(caches[True][0])
    for chunks in plan:
        before = len(kernel_calls)
        got = batched_forward(model, caches[True], chunks)
        want = batched_forward(model, caches[False], chunks, fused=False)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
        L = len(chunks[0])
        assert [(c[0], c[2]) for c in kernel_calls[before:]] == [(3, L)] * layers


@pytest.mark.parametrize("bits", [None, "8"])
def test_batched_prefill_chunk_equals_one_token_steps(engine, kernel_calls, monkeypatch, bits):
    """A batched forward of 20 new tokens per request (a prefill chunk: more than PAGED_MAX_QUERIES) over float
    or 8-bit blocks attends on the paged kernel (in blocks of PAGED_MAX_QUERIES positions), and its last
    logits equal, bit for bit, those of the same tokens fed as 20 one-token batched steps (each attention row
    computed as a decode step computes it; the products' rows do not depend on their count)."""
    model = engine.model
    install_attention_hook(model)
    quant_calls = []
    real = kv_batch.paged_quant_attention
    monkeypatch.setattr(kv_batch, "paged_quant_attention", lambda q, *a: quant_calls.append(q.shape[2]) or real(q, *a))
    prompts, chunks = [list(range(100, 130)), list(range(300, 309))], [list(range(500, 520)), list(range(600, 620))]
    assert min(map(len, chunks)) > PAGED_MAX_QUERIES
    logits = {}
    for one_by_one in (False, True):
        pool = make_pool(model, kv_quant(bits) if bits else None, block_size=8)
        caches = [make_paged_cache(model, pool) for _ in prompts]
        for ids, c in zip(prompts, caches):
            mx.eval(model(mx.array(ids)[None], cache=c))
        parts = [[[c[i]] for c in chunks] for i in range(len(chunks[0]))] if one_by_one else [chunks]
        for part in parts:
            logits[one_by_one] = batched_forward(model, caches, part)
    assert np.array_equal(logits[False], logits[True])
    calls = quant_calls if bits else [c[2] for c in kernel_calls]
    assert calls == [len(chunks[0])] * len(model.layers) + [1] * len(chunks[0]) * len(model.layers)


def test_default_model_fused_greedy_equals_the_gather(engine, kernel_calls):
    """The default model (quantized weights on the kernels), four requests of different lengths (one with
    evicted tokens) decoded greedily together for 24 steps: the same tokens with the kernel on and off, and
    the logits within float32 rounding at every step."""
    model = engine.model
    install_attention_hook(model)
    prompts = [engine.encode(p) for p in PROMPTS[:4]]
    caches = twin_caches(model, prompts, 16, evict=[(1, list(range(3, len(prompts[1]) - 4, 2)))])
    tokens = {f: [[p[-1]] for p in prompts] for f in (True, False)}
    for _ in range(24):
        logits = {f: batched_forward(model, caches[f], tokens[f], fused=f) for f in (True, False)}
        np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-5 * np.abs(logits[False]).max())
        for f in (True, False):
            tokens[f] = [[int(t)] for t in logits[f].argmax(-1)]
        assert tokens[True] == tokens[False]
    assert len(kernel_calls) == 24 * len(model.layers)


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_batched_logits_equal_each_alone(tiny_models, arch):
    """Three requests of different lengths prefilled together (two left-padded batched forwards: 6 tokens
    each, then the rest of the two longer ones), then decoded in one batched forward per step: each row's
    logits equal that request run alone on mlx-lm's dense cache (gemma3: 5 sliding-window layers of 8 with
    prompts longer than the window; block size 4 so requests span many blocks)."""
    model = tiny_models[arch]
    prompts = [[5, 17, 260, 99, 3, 101, 42, 7, 255, 12, 64], [200, 31, 8], [150, 11, 90, 2, 33, 70, 9, 1, 4, 6, 8, 10, 12, 14]]
    pool = make_pool(model, block_size=4)
    paged = [make_paged_cache(model, pool) for _ in prompts]
    dense = [make_prompt_cache(model) for _ in prompts]
    want = np.stack([np.array(model(mx.array(ids)[None], cache=d)[0, -1].astype(mx.float32)) for ids, d in zip(prompts, dense)])
    k, v = dense[0][0].keys, dense[0][0].values  # [1, n_kv, L, D]: the pool's layout (a BatchStep needs it)
    pool.configure(k.shape[1], k.shape[3], v.shape[3], k.dtype)
    first = batched_forward(model, paged, [p[:6] for p in prompts])
    rest = batched_forward(model, [paged[0], paged[2]], [prompts[0][6:], prompts[2][6:]])
    got = np.stack([rest[0], first[1], rest[1]])
    tol = 1e-5 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    last = [int(t) for t in want.argmax(-1)]
    for _ in range(6):
        got = batched_forward(model, paged, [[t] for t in last])
        want = np.stack([np.array(model(mx.array([[t]]), cache=d)[0, -1].astype(mx.float32)) for t, d in zip(last, dense)])
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
        last = [int(t) for t in want.argmax(-1)]
    assert [c[0].offset for c in paged] == [len(p) + 6 for p in prompts]
    assert pool.blocks_in_use == sum(-(-(len(p) + 6) // 4) for p in prompts)


def test_generate_batch_greedy_equals_generate(engine):
    """Different prompts, max_tokens and stop strings: every answer equals `generate` alone."""
    params = [SamplingParams(max_tokens=n, stop=stop) for n, stop in
              zip([24, 9, 30, 16, 5, 40], [(), (), ("\n",), (), (), ("five",)])]
    want = [engine.generate(p, q) for p, q in zip(PROMPTS, params)]
    got = engine.generate_batch(PROMPTS, params)
    for g, w in zip(got, want):
        assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, w.finish_reason)
        assert g.stats.generated_tokens == w.stats.generated_tokens
    assert {w.finish_reason for w in want} == {"stop", "length"}  # both endings are exercised


def test_generate_batch_sampled_with_seed_equals_generate(engine):
    """Seeded sampling draws from each request's own key: the same tokens as `generate` with that seed,
    whatever else is in the batch; a repetition penalty looks back over the request's own tokens."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=20) for s in (1, 2, 3)]
    params.append(SamplingParams(repetition_penalty=1.3, max_tokens=20))
    want = [engine.generate(p, q).token_ids for p, q in zip(PROMPTS, params)]
    got = [r.token_ids for r in engine.generate_batch(PROMPTS[:4], params)]
    assert got == want
    assert len({tuple(t) for t in want[:3]}) == 3


def test_requests_join_and_leave(engine):
    """max_batch 2 with six requests: never more than two decode together, each newcomer joins as one
    finishes, and every answer equals the request alone."""
    sched = engine.scheduler(max_batch=2)
    steps = [[] for _ in PROMPTS]
    lengths = [3, 12, 6, 9, 4, 7]
    for p, n, out in zip(PROMPTS, lengths, steps):
        sched.add(engine.batch_request(p, SamplingParams(max_tokens=n), emit=out.append))
    widths = []
    while sched.busy:
        sched.step()
        widths.append(len(sched.running))
    kv = engine._batch_kv()
    assert max(widths) == 2 and kv.pool.blocks_in_use == len(kv.prefix) == kv.prefix.idle_blocks  # only cached blocks
    for p, n, out in zip(PROMPTS, lengths, steps):
        assert [s.token for s in out if s.token is not None] == engine.generate(p, max_tokens=n).token_ids


def test_prefill_leaves_the_last_prompt_tokens_to_one_forward(engine, monkeypatch):
    """Newcomers' prompts but their last tokens go through batched forwards whose logits are never
    evaluated (no output head over the prompt); one forward of every newcomer's last prompt token gives the
    first tokens (a one-token prompt joins only that one); then one-token decode forwards. Each answer
    equals `generate` alone."""
    sched = engine.scheduler(prefix_cache=False)
    forwards, real = [], sched._forward

    def spy(reqs, chunks, inputs=None, tapped=False):
        forwards.append(None if inputs is not None else [list(c) for c in chunks])  # None: a decode forward
        return real(reqs, chunks, inputs, tapped)

    monkeypatch.setattr(sched, "_forward", spy)
    prompts = [engine.encode(PROMPTS[0]), engine.encode(PROMPTS[4]), engine.encode(PROMPTS[1])[:1]]
    outs = [[] for _ in prompts]
    for ids, out in zip(prompts, outs):
        sched.add(engine.batch_request(ids, SamplingParams(max_tokens=5), emit=out.append))
    while sched.busy:
        sched.step()
    assert len(prompts[0]) > 2 and len(prompts[1]) > 2 and len(prompts[2]) == 1
    assert forwards[0] == [prompts[0][:-1], prompts[1][:-1]]
    assert forwards[1] == [[p[-1]] for p in prompts]
    assert forwards[2:] == [None] * (len(forwards) - 2) and len(forwards) >= 5
    for ids, out in zip(prompts, outs):
        assert [s.token for s in out if s.token is not None] == engine.generate(ids, max_tokens=5).token_ids


def test_lone_request_runs_on_its_own_cache(engine, kernel_calls, monkeypatch):
    """A request running alone runs every forward on its own PagedKVCache (no batched step: its decode
    steps attend on the kernel through the cache's run path, one query row each, no row index built; a
    remainder of its prompt of at most PAGED_MAX_QUERIES tokens, the rest cached by earlier tests, too) and
    gives the tokens of `generate`."""
    sched = engine.scheduler()
    lone_calls = spy_paged_attention(monkeypatch, kv_cache)
    steps = []
    monkeypatch.setattr(kv_batch.BatchStep, "done", lambda self: steps.append(self.shape))
    out = []
    sched.add(engine.batch_request(PROMPTS[3], SamplingParams(max_tokens=12), emit=out.append))
    while sched.busy:
        sched.step()
    assert [s.token for s in out if s.token is not None] == engine.generate(PROMPTS[3], max_tokens=12).token_ids
    assert steps == [] and kernel_calls == []  # no BatchStep, no batched attention
    assert {c[0] for c in lone_calls} == {1} and all(c[2] <= PAGED_MAX_QUERIES for c in lone_calls)
    assert sum(c[2] == 1 for c in lone_calls) >= 10 * len(engine.model.layers)  # the decode steps


def test_kv_budget_admission(default_gguf):
    """A budget that can never hold a request refuses it before anything runs; one that holds a single
    request at a time runs them one after another, each finishing."""
    engine = mlx_infer.load(kv_cache="paged", kv_budget="10MB", block_size=16)
    with pytest.raises(KVBudgetError, match="raise kv_budget or lower max_tokens"):
        engine.generate_batch(["Hi", "Tell me a story"], max_tokens=2000)
    assert engine.kv_pool.blocks_in_use == 0
    sched = engine.scheduler()
    # a block is 30 layers x K, V x 3 heads x 64 x 16 tokens x 4 bytes: 10 MB holds 13, a request of ~160 tokens 10
    assert engine.kv_pool.max_blocks == 10_000_000 // engine.kv_pool.block_bytes == 13
    outs = [[], []]
    for p, out in zip(PROMPTS[:2], outs):
        sched.add(engine.batch_request(p, SamplingParams(max_tokens=120), emit=out.append))
    widths = []
    while sched.busy:
        sched.step()
        widths.append(len(sched.running))
    assert max(widths) == 1 and all(o[-1].finish_reason for o in outs)
    assert engine.kv_pool.peak_blocks <= engine.kv_pool.max_blocks


def test_runner_threads_and_cancel(engine):
    """Requests submitted from several threads at once give the answers of each alone; a cancelled one
    stops and its blocks go back to the pool while the others go on."""
    want = [engine.generate(p, max_tokens=16).token_ids for p in PROMPTS[:4]]
    got = [None] * 4
    with engine.batch_runner() as runner:
        def one(i):
            got[i] = runner.submit(engine.batch_request(PROMPTS[i], SamplingParams(max_tokens=16))).result().token_ids

        long = runner.submit(engine.batch_request(PROMPTS[5], SamplingParams(max_tokens=500)))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        it = iter(long)
        for _ in range(3):
            next(it)
        long.cancel()
        for t in threads:
            t.join()
        kv = engine._batch_kv()
        for _ in range(100):  # the runner frees the cancelled request's blocks at its next step
            if not runner.scheduler.busy:
                break
            threading.Event().wait(0.05)
        assert kv.pool.blocks_in_use == len(kv.prefix) == kv.prefix.idle_blocks  # only cached blocks are left
    assert list(long)[-1].finish_reason == "cancelled"
    assert got == want
    with pytest.raises(RunnerClosedError, match="closed"):
        runner.submit(engine.batch_request("Hi"))


def test_an_idle_runner_gives_its_kv_memory_back(engine):
    """After idle_release_s without a request the runner forgets its prefix cache and shrinks the pool to its
    initial capacity; a later request prefills in full (no cached tokens) and gives the same tokens."""
    prompts = [p + " Answer in detail." * 40 for p in PROMPTS]  # ~200 tokens each: more than the initial blocks
    want = [engine.generate(p, max_tokens=24).token_ids for p in prompts]
    with engine.batch_runner(idle_release_s=0.5) as runner:
        kv = engine._batch_kv()
        handles = [runner.submit(engine.batch_request(p, SamplingParams(max_tokens=24))) for p in prompts]
        assert [h.result().token_ids for h in handles] == want
        grown, initial = kv.pool.capacity, kv.pool.initial_blocks
        assert grown > initial and len(kv.prefix) > 0 and runner.releases == 0
        for _ in range(60):
            if runner.releases:
                break
            threading.Event().wait(0.1)
        assert runner.releases == 1
        assert kv.pool.capacity == initial and len(kv.prefix) == 0 and kv.pool.blocks_in_use == 0
        again = runner.submit(engine.batch_request(prompts[0], SamplingParams(max_tokens=24))).result()
        assert again.token_ids == want[0] and again.stats.cached_prompt_tokens == 0


def test_release_idle_waits_for_requests_to_leave(engine):
    """PagedKV.release_idle releases nothing while a request holds blocks."""
    kv = engine._batch_kv()
    cache = kv.new_cache()
    engine.model(mx.array([engine.encode(PROMPTS[1])]), cache=cache)
    held = kv.pool.blocks_in_use
    assert held > 0 and kv.release_idle() == 0 and kv.pool.blocks_in_use == held
    cache[0].sequence.release()
    assert kv.release_idle() >= 0 and kv.pool.blocks_in_use == 0


def test_runner_left_open_closes_at_exit(default_gguf, tmp_path):
    """A runner never closed is closed at interpreter exit (else MLX aborts the process: exit 134)."""
    script = tmp_path / "open_runner.py"
    script.write_text("import mlx_infer\nfrom mlx_infer import SamplingParams\ne = mlx_infer.load()\n"
                      "r = e.batch_runner()\nprint(r.submit(e.batch_request('Hi', SamplingParams(max_tokens=3))).result().text)\n")
    for _ in range(3):  # the abort was intermittent
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-2000:]


def test_generate_batch_bad_input(engine):
    with pytest.raises(MlxInferError, match="2 prompts but 3 params"):
        engine.generate_batch(["a", "b"], [SamplingParams()] * 3)
    with pytest.raises(MlxInferError, match="^prompt 1: the prompt is empty"):
        engine.generate_batch(["a", " "])
    with pytest.raises(MlxInferError, match="^prompt 1: the prompt must be a string.*got int"):
        engine.generate_batch(["a", 42])
    with pytest.raises(MlxInferError, match="^prompt 0: .*got bytes"):
        engine.generate_batch([b"Hi"])
    assert engine.generate_batch([]) == []
    with pytest.raises(MlxInferError, match="max_batch"):
        engine.generate_batch(["a"], max_batch=0)
    with pytest.raises(MlxInferError, match="a list of prompts"):
        engine.generate_batch("hello")
    with pytest.raises(MlxInferError, match="outside the model's vocabulary"):
        engine.generate_batch([[1, 2, 10 ** 8]])
    with engine.batch_runner() as runner:
        with pytest.raises(MlxInferError, match="takes a request built by engine.batch_request.*got str"):
            runner.submit("Hello there")  # type: ignore[arg-type]


COPY = ("Repeat this list exactly, twice: apples, bananas, cherries, dates, elderberries, figs, grapes, "
        "apples, bananas, cherries, dates, elderberries, figs, grapes.")


def test_lone_request_speculates_and_yields_to_a_newcomer(engine):
    """A request asking for lookup decoding speculates while it runs alone (rounds commit several tokens),
    goes back to the batch when a newcomer arrives, and both answers equal each request alone."""
    sched = engine.scheduler()
    first, second = [], []
    sched.add(engine.batch_request(COPY, SamplingParams(max_tokens=60), speculative="lookup", emit=first.append))
    while len([s for s in first if s.token is not None]) < 20:
        sched.step()
    assert sched._solo is not None  # speculating
    sched.add(engine.batch_request(PROMPTS[1], SamplingParams(max_tokens=12), speculative="lookup",
                                   emit=second.append))
    sched.step()
    assert sched._solo is None and len(sched.running) == 2  # the newcomer joined; the first went on batched
    while sched.busy:
        sched.step()
    assert [s.token for s in first if s.token is not None] == engine.generate(COPY, max_tokens=60).token_ids
    assert [s.token for s in second if s.token is not None] == engine.generate(PROMPTS[1], max_tokens=12).token_ids
    stats = first[-1].stats
    assert stats.spec_mode == "lookup" and stats.rounds > 0 and stats.tau > 1.0
    kv = engine._batch_kv()
    assert kv.pool.blocks_in_use == len(kv.prefix)
