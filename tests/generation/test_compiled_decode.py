"""Compiled decode steps (generation/compiled.py): plain decoding's one-token steps and speculative
decoding's verify forwards, the same logits and caches as the model's own forward bit for bit across a KV
buffer's growth, and the engine's and the speculative loop's tokens unchanged by them; a batched step's, the
same logits as the model's batched forward across a key bucket and a request leaving; all replayed without
running the model's Python."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.generation import compiled
from mlx_infer.defaults import MAX_VERIFY_WIDTH
from mlx_infer.generation.compiled import COMPILE_AFTER_STEPS, CompiledBatchStep, CompiledDecode
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.kernels import cpu
from mlx_infer.kv import make_paged_cache, make_pool
from mlx_infer.kv.attention_hook import install as install_attention_hook
from mlx_infer.kv.batch import BatchStep
from mlx_infer.kv.quant_cache import make_quant_cache
from mlx_infer.kv.quant_options import kv_quant
from mlx_infer.speculative.drafters.lookup import LookupDrafter
from mlx_infer.speculative.loop import SpecStats, speculative_tokens

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built here: " + (cpu.why_not() or ""))


class Counting:
    """A model that counts how often its Python forward runs."""

    def __init__(self, model):
        self.model, self.layers, self.calls = model, model.layers, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def greedy_steps(model, forward, prompt, steps):
    """Prefill `prompt` with the model, then `steps` greedy one-token forwards through `forward`: (the logits
    [1, 1, V] of each step, the caches)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)
    out = []
    for _ in range(steps):
        token = mx.argmax(logits[:, -1, :], axis=-1)[None]  # [1, 1]
        logits = forward(token, cache=cache)
        mx.eval(logits)
        out.append(logits)
    return out, cache


@pytest.mark.parametrize("fixture", ["default_engine_native", "default_engine", "tiny_engine"])
def test_same_logits_and_caches_as_the_model_across_buffer_growth(request, fixture):
    """From 250 tokens, 12 steps cross the KVCache's first 256-token buffer: the step at 256 runs the model
    (it grows the buffer), the next ones replay a second trace; every logit and every cached K/V row equals
    the model's own forward."""
    engine = request.getfixturevalue(fixture)
    model = engine.model
    prompt = [(7 * i) % (model.args.vocab_size - 20) + 10 for i in range(250)]
    counting = Counting(model)
    fast = CompiledDecode(counting)
    assert CompiledDecode.applies(model, make_prompt_cache(model))
    ours, our_cache = greedy_steps(model, fast, prompt, 12)
    theirs, their_cache = greedy_steps(model, model, prompt, 12)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert not mx.isnan(a).any().item() and mx.array_equal(a, b).item(), f"step {i}"
    for a, b in zip(our_cache, their_cache):
        assert a.offset == b.offset == 262
        assert mx.array_equal(a.state[0], b.state[0]).item() and mx.array_equal(a.state[1], b.state[1]).item()
    # two traces (capacities 256 and 512) and the one step that grew the buffer: the other 9 were replays
    assert counting.calls == 3


@pytest.mark.parametrize("fixture", ["default_engine_native", "default_engine"])
def test_verify_widths_replay_with_the_same_logits_and_caches(request, fixture):
    """A CompiledDecode of verify widths: forwards of 2, 5, 9 and 16 tokens over 240 cached ones (the 16-token
    one ends at the buffer's 256 slots), twice each with the same tokens, give the logits and K/V rows of the
    model's own forwards bit for bit; the model's Python runs once per width (its trace), then replays. A
    forward past the buffer (it must grow) and one of 17 tokens run the model."""
    model = request.getfixturevalue(fixture).model
    prompt = [(5 * i) % (model.args.vocab_size - 20) + 10 for i in range(240)]
    counting = Counting(model)
    fast = CompiledDecode(counting, MAX_VERIFY_WIDTH)
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=ours), model(mx.array(prompt)[None], cache=theirs))
    widths = (2, 5, 9, 16)
    for width in widths * 2:
        block = mx.array([(3 * j) % 500 + 7 for j in range(width)])[None]
        a, b = fast(block, cache=ours), model(block, cache=theirs)
        mx.eval(a, b)
        assert a.shape == (1, width, b.shape[-1]) and mx.array_equal(a, b).item(), width
        for x, y in zip(ours, theirs):
            assert x.offset == y.offset == 240 + width
            assert mx.array_equal(x.state[0], y.state[0]).item() and mx.array_equal(x.state[1], y.state[1]).item()
            x.trim(width)
            y.trim(width)
    assert counting.calls == len(widths)
    grow = mx.array([[9] * 17])
    assert mx.array_equal(fast(grow, cache=ours), model(grow, cache=theirs)).item()  # 17 tokens
    assert counting.calls == len(widths) + 1
    mx.eval(fast(mx.array([[9] * 16]), cache=ours), model(mx.array([[9] * 16]), cache=theirs))  # to 273: grows
    assert counting.calls == len(widths) + 2 and ours[0].keys.shape[2] > 256


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=4)])
def test_speculative_rounds_replay_and_keep_their_tokens(default_engine_native, params):
    """Prompt lookup with drafts of 4 on a repetitive prompt: with the compiled verify forwards the loop's
    tokens equal those of the model's own forwards (greedy, and seeded sampling), the rounds drafted, and
    after the first request (its traces: at most one per width) the next one runs no forward through the
    model's Python (the prefill does not go through it)."""
    model = default_engine_native.model
    prompt = default_engine_native.encode("one two three four five six, one two three four five six, one two")
    counting = Counting(model)
    fast = CompiledDecode(counting, MAX_VERIFY_WIDTH)

    def run(compiled):
        stats = SpecStats()
        tokens = list(speculative_tokens(model, prompt, params, 24, LookupDrafter(), 4, stats, compiled=compiled))
        return tokens, stats

    theirs, _ = run(None)
    ours, stats = run(fast)
    assert ours == theirs and stats.proposed and stats.rounds < 24
    assert 1 <= counting.calls <= 5  # traced: the rounds went through the compiled forwards
    traced = counting.calls
    assert run(fast)[0] == theirs and counting.calls == traced


def test_prefill_and_other_caches_run_the_model(default_engine_native):
    """Only one-token steps over mlx-lm's KVCache replay: a prefill chunk runs the model; a quantized KV
    cache or a paged one is not taken."""
    model = default_engine_native.model
    counting = Counting(model)
    fast = CompiledDecode(counting)
    cache = make_prompt_cache(model)
    prompt = mx.array([[5, 6, 7, 8]])
    assert mx.array_equal(fast(prompt, cache=cache), model(prompt, cache=make_prompt_cache(model))).item()
    assert counting.calls == 1
    assert not CompiledDecode.applies(model, make_quant_cache(model, kv_quant("8")))
    default_engine_native.configure_kv(kv_cache="paged")
    try:
        assert not CompiledDecode.applies(model, default_engine_native._store.new_cache())
    finally:
        default_engine_native.configure_kv()


def test_other_attention_is_not_taken(gemma_engine):
    """Gemma-3's attention (not a kernel twin of mlx-lm's llama / qwen2 attention) runs the model as it is."""
    model = gemma_engine.model
    assert not CompiledDecode.applies(model, make_prompt_cache(model))


@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "top_p": 0.9, "seed": 3, "repetition_penalty": 1.2}])
def test_engine_tokens_unchanged(default_engine_native, monkeypatch, params):
    """Greedy and seeded sampled generation give the same tokens with the compiled step as without it."""
    engine = default_engine_native
    engine.reset()
    fast = engine.generate("Write a haiku about autumn leaves.", max_tokens=40, **params).token_ids
    monkeypatch.setattr(compiled.CompiledDecode, "applies", staticmethod(lambda model, cache: False))
    engine.reset()
    plain = engine.generate("Write a haiku about autumn leaves.", max_tokens=40, **params).token_ids
    assert fast == plain and len(fast) > 5


def batched_run(model, forward, prompts, steps, leave_at):
    """Each prompt prefilled alone on its own paged cache over one pool, then `steps` greedy batched
    one-token steps through `forward(step, tokens) -> logits [B, 1, V]`; the last request leaves after step
    `leave_at`. Returns every step's logits."""
    pool = make_pool(model, block_size=16)
    caches = [make_paged_cache(model, pool) for _ in prompts]
    tokens = []
    for ids, c in zip(prompts, caches):
        tokens.append(int(mx.argmax(model(mx.array(ids)[None], cache=c)[0, -1]).item()))
    out = []
    for i in range(steps):
        if i == leave_at:
            caches, tokens = caches[:-1], tokens[:-1]
        step = BatchStep([c[0].sequence for c in caches], [1] * len(caches))
        logits = forward(step, mx.array(tokens, dtype=mx.uint32)[:, None])
        mx.eval(logits)
        out.append(logits)
        tokens = [int(t) for t in mx.argmax(logits[:, -1], axis=-1).tolist()]
    return out


def test_batched_step_equals_the_model_and_replays(default_engine_native):
    """Three requests of 55-61 prompt tokens, 12 batched steps: their keys cross BATCH_KEYS_BUCKET (64), and
    one request leaves after 8. Every step's logits equal the model's own batched forward bit for bit, and
    the model's Python runs only for the three traces (64 and 128 keys for three requests, 128 for two)."""
    model = default_engine_native.model
    install_attention_hook(model)
    prompts = [[(11 * i + j) % 3000 + 50 for i in range(n)] for j, n in enumerate((55, 58, 61))]

    def plain(step, tokens):
        logits = model(tokens, cache=step.caches())
        step.done()
        return logits

    counting = Counting(model)
    fast = CompiledBatchStep(counting)

    def compiled_step(step, tokens):
        assert CompiledBatchStep.applies(model, step.pool, step)
        return fast(step, tokens)

    ours = batched_run(model, compiled_step, prompts, 12, leave_at=8)
    theirs = batched_run(model, plain, prompts, 12, leave_at=8)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and mx.array_equal(a, b).item(), f"step {i}"
    assert counting.calls == 3


def test_a_batched_shape_is_traced_after_a_few_steps(default_engine_native):
    """CompiledBatchStep.ready: a shape (requests, key bucket, pool rows) runs the model's Python for its
    first COMPILE_AFTER_STEPS - 1 steps, then the compiled graph; another number of requests starts over."""
    model = default_engine_native.model
    install_attention_hook(model)
    pool = make_pool(model, block_size=16)
    caches = [make_paged_cache(model, pool) for _ in range(3)]
    for c in caches:
        mx.eval(model(mx.array([[5, 6, 7]]), cache=c))
    batched = CompiledBatchStep(model)

    def asks(requests):
        step = BatchStep([c[0].sequence for c in requests], [1] * len(requests))
        ready = batched.ready(step)
        mx.eval(model(step.inputs([[9]] * len(requests)), cache=step.caches()))
        step.done()
        return ready

    assert [asks(caches) for _ in range(COMPILE_AFTER_STEPS + 1)] == [False] * (COMPILE_AFTER_STEPS - 1) + [True, True]
    assert not asks(caches[:2])


def test_engine_keeps_its_steps_until_a_module_is_swapped(tiny_engine):
    """Engine.compiled_steps is one object across requests (its traces serve them all) and a new one once a
    leaf module of the model was replaced (a trace would not see the new module)."""
    steps = tiny_engine.compiled_steps()
    assert tiny_engine.compiled_steps() is steps
    layer = tiny_engine.model.layers[0]
    norm = layer.input_layernorm
    layer.input_layernorm = nn.RMSNorm(norm.weight.shape[0])
    try:
        assert tiny_engine.compiled_steps() is not steps
    finally:
        layer.input_layernorm = norm
