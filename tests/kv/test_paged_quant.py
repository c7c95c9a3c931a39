"""Quantized blocks in the paged pool (BlockPool(quant=...)): what a block holds and costs, rows read back as
MLX's own round trip of each token row, growth / shrinking / repacking moving codes, scales and biases
together (attention unchanged, blocks really freed), trim; on the default model: a paged quantized request
gives the dense QuantKVCache's greedy tokens, batched requests give each one's tokens alone, the prefix cache
and speculative decoding over quantized blocks, the refusals."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_infer
from mlx_infer.errors import MlxInferError
from mlx_infer.kernels.paged_attention import paged_quant_attention, reference_paged_quant_attention
from mlx_infer.kernels.qmm import QMM_MAX_ROWS
from mlx_infer.kv import BlockPool, make_paged_cache, make_pool
from mlx_infer.kv import batch as kv_batch
from mlx_infer.kv.quant_options import kv_quant
from mlx_infer.kv.repack import commit, plan_repack
from quant_oracle import round_trip

#: Plain-text prompts of at most 4 tokens (see test_batched_on_quantized_blocks_equals_each_alone).
SHORT_PROMPTS = ["The capital of France", "A haiku about", "Three colors:", "A CPU is"]
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
           "Explain what a CPU does in one sentence."]


def random_kv(n_kv, L, dim, seed):
    k = mx.random.normal((n_kv, L, dim), key=mx.random.key(seed)) * (1 + mx.arange(dim) % 5)
    return k, mx.random.normal((n_kv, L, dim), key=mx.random.key(seed + 1))


def test_block_bytes_and_the_budget():
    """A token slot of the default model's layout (3 KV heads of 64) holds, per layer, 3 x (64 + 64 code bytes
    + 4 float16 scales / biases x 2 bytes) = 408 bytes at 8 bits, 3 x (32 + 32 + 8) = 216 at 4, 3 x (64 + 32
    + 8) = 312 with k8v4, against 3 x 128 x 2 = 768 in float16: a 64 MiB budget over 30 layers, block 16,
    holds 182 / 342 / 647 / 448 blocks (float16 / 8 / 4 / k8v4): 1.88x / 3.55x / 2.46x the tokens."""
    budget = 64 << 20
    got = {}
    for bits, per_token in ((None, 768), ("8", 408), ("4", 216), ("k8v4", 312)):
        pool = BlockPool(30, block_size=16, budget_bytes=budget, quant=kv_quant(bits))
        pool.configure(3, 64, 64, mx.float16)
        assert pool.token_bytes == per_token and pool.block_bytes == 30 * 16 * per_token
        got[bits] = pool.max_blocks
    assert got == {None: 182, "8": 342, "4": 647, "k8v4": 448}
    pool = BlockPool(30, block_size=16, budget_bytes=budget, quant=kv_quant("8"))
    pool.configure(3, 64, 64, mx.float16)
    pool.allocate(3)
    assert pool.bytes_in_use == 3 * 16 * 30 * 408
    assert pool.nbytes == pool.capacity * 16 * 30 * 408  # the allocated planes: codes, scales, biases


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
def test_rows_read_back_as_mlx_round_trip(rotate):
    """Writes quantize each token row (rotated: in the Hadamard basis); read / read_range return MLX's round
    trip of the rows, in the pool's dtype and the model's basis; growth (past the first capacity) and
    shrinking keep them."""
    pool = BlockPool(2, block_size=4, initial_blocks=2, quant=kv_quant("k8v4", kv_rotate=rotate))
    pool.configure(2, 64, 64, mx.float32)
    blocks = pool.allocate(6)  # grows past initial_blocks
    slots = np.concatenate([np.arange(b * 4, b * 4 + 4) for b in blocks])  # [24]
    k, v = random_kv(2, 24, 64, seed=1)
    for layer in range(2):
        pool.write(layer, pool.rows(slots), k * (layer + 1), v)
    want_k, want_v = round_trip(k * 2, 8, rotated=rotate), round_trip(v, 4, rotated=rotate)
    got_k, got_v = pool.read(1, pool.rows(slots))
    assert got_k.dtype == mx.float32 and got_k.shape == (2, 24, 64)
    np.testing.assert_array_equal(np.array(got_k), np.array(want_k))
    np.testing.assert_array_equal(np.array(got_v), np.array(want_v))
    assert blocks[0] == 0 and pool.capacity == 6
    for b in blocks[1:]:
        pool.release(b)
    assert pool.shrink() and pool.capacity == 2  # a copy of the used prefix, every plane
    rk, rv = pool.read_range(1, 0, 4)  # block 0's slots, contiguous, with a request's batch axis
    assert rk.shape == (1, 2, 4, 64)
    np.testing.assert_array_equal(np.array(rk), np.array(want_k[None, :, :4]))
    np.testing.assert_array_equal(np.array(rv), np.array(want_v[None, :, :4]))


def test_pool_layout_checks():
    pool = BlockPool(1, quant=kv_quant("8", kv_group_size=64))
    with pytest.raises(MlxInferError, match="key head dim that is a multiple of 32 and of the group size .64.; "
                                            "this model's is 96: try kv_group_size=32 or float KV"):
        pool.configure(2, 96, 64, mx.float32)
    with pytest.raises(MlxInferError, match="this model's is 64: try kv_group_size=32 or 64 or float KV"):
        BlockPool(1, quant=kv_quant("8", kv_group_size=128)).configure(2, 64, 64, mx.float32)
    with pytest.raises(MlxInferError, match="kivi.*does not fit the paged cache's token blocks"):
        BlockPool(1, quant=kv_quant("4", "kivi"))
    with pytest.raises(MlxInferError, match="kv_quant_start=8 .*needs the dense KV cache"):
        BlockPool(1, quant=kv_quant("8", kv_quant_start=8))


def attention_of(sequence, q):
    """paged_quant_attention (kernel) and its reference of queries q [1, n_q, 1, D] over layer 0 of the
    request's live tokens (positions from its table)."""
    pool, table = sequence.pool, sequence.table
    tokens = table.live_tokens()
    index = mx.array(np.array(pool.rows(table.slots(tokens))).reshape(1, pool.layout[0], -1))
    ops = (index, mx.array([tokens.size], mx.int32), mx.array([[table.length]], mx.int32),
           mx.array(tokens[None].astype(np.int32)))
    keys, values = pool.layer_kv(0)
    return (np.array(paged_quant_attention(q, keys, values, *ops, 0.125, pool.quant.group_size)),
            np.array(reference_paged_quant_attention(q, keys, values, *ops, 0.125, pool.quant.group_size)))


def test_repacking_moves_packed_rows_and_frees_blocks(default_model):
    """A prompt prefilled into 8-bit blocks, scattered tokens evicted: repacking frees blocks, and the packed
    rows (codes, scales, biases) move with their tokens: the live rows read back bit-identical and attention
    over them (kernel and reference) is unchanged."""
    pool = make_pool(default_model, kv_quant("8"), block_size=8)
    cache = make_paged_cache(default_model, pool)
    mx.eval(default_model(mx.array([list(range(100, 180))]), cache=cache))  # 80 tokens: 10 blocks
    seq = cache[0].sequence
    seq.evict(np.arange(1, 80, 2))  # every other token: 40 live in 10 half-full blocks
    before_kv = [np.array(a) for a in seq.live(0)]
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(4))
    before = attention_of(seq, q)
    plan = plan_repack(seq.table, pool)
    assert plan is not None and plan.saved == 5
    mx.eval(commit(seq, plan))
    seq.table.check()
    assert pool.blocks_in_use == len(seq.table.blocks) == 5
    for got, want in zip(seq.live(0), before_kv):
        np.testing.assert_array_equal(np.array(got), want)
    after = attention_of(seq, q)
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    np.testing.assert_allclose(after[0], after[1], rtol=0, atol=1e-5 * np.abs(after[1]).max())


@pytest.fixture(scope="module")
def engine(default_gguf):
    """The default model as users load it (quantized weights on the kernels), its own engine."""
    return mlx_infer.load()


@pytest.mark.parametrize("bits", ["8", "k8v4", "4"])
def test_paged_quantized_equals_the_dense_quantized_cache(engine, bits):
    """The same rows quantized the same way give the same dequantized values, and a paged request attends
    through the same quant_attention on its packed rows (gathered, or a view): greedy tokens identical to the
    dense QuantKVCache with the same bits; kv_bytes_per_token the same packed size."""
    prompt = "Explain in two sentences why the sky is blue."
    engine.configure_kv(kv_bits=bits)
    try:
        dense = engine.generate(prompt, max_tokens=24)
        engine.configure_kv(kv_cache="paged", kv_bits=bits, block_size=8)
        paged = engine.generate(prompt, max_tokens=24)
    finally:
        engine.configure_kv()
    assert paged.token_ids == dense.token_ids
    assert paged.stats.kv_bits == bits and paged.stats.kv_bytes_per_token == dense.stats.kv_bytes_per_token
    assert paged.stats.kv["peak_kv_bytes"] == paged.stats.kv["retained_blocks_max"] * 8 * paged.stats.kv_bytes_per_token


def test_batched_on_quantized_blocks_equals_each_alone(engine, monkeypatch):
    """N requests with different prompts and lengths decoding together on 8-bit blocks (the quantized
    paged-attention kernel) give the greedy tokens each gives alone on the same paged quantized cache.

    The prompts are raw text of at most 4 tokens, so the batch's prefill (4 rows of at most 4) attends on
    the decode kernels, which compute each row alone (as the quantized matmul kernel does at every row
    count). A lone request's prefill chunk of PREFILL_MIN_QUERIES positions or more runs the tiled prefill
    attention (a batch's runs the decode kernel in blocks), whose rounding of a row depends on the chunk: a
    difference in the last bits that 8-bit KV can turn into another token where two are nearly tied."""
    prompts = [engine.encode(p, chat_template=False) for p in SHORT_PROMPTS]
    assert sum(max(map(len, prompts)) for _ in prompts) <= QMM_MAX_ROWS
    calls = []
    real = kv_batch.paged_quant_attention
    monkeypatch.setattr(kv_batch, "paged_quant_attention", lambda q, *a: calls.append(q.shape) or real(q, *a))
    engine.configure_kv(kv_cache="paged", kv_bits="8")
    try:
        lengths = [24, 9, 30, 16]
        alone = [engine.generate(p, max_tokens=n).token_ids for p, n in zip(prompts, lengths)]
        together = engine.generate_batch(prompts, [mlx_infer.SamplingParams(max_tokens=n) for n in lengths])
    finally:
        engine.configure_kv()
    assert [r.token_ids for r in together] == alone
    assert calls and max(s[0] for s in calls) == len(prompts)  # batched steps ran on the quantized kernel
    assert {r.stats.kv_bits for r in together} == {"8"} and together[0].stats.kv_bytes_per_token == 12240


def test_prefix_cache_and_speculation_on_quantized_blocks(engine):
    """A repeated prompt starts from the cached quantized blocks with the same answer; a lone batched
    request speculating (lookup) over 8-bit blocks gives plain decoding's greedy tokens."""
    engine.configure_kv(kv_cache="paged", kv_bits="8")
    try:
        prompt = ("Copy this text exactly, twice: The quick brown fox jumps over the lazy dog while the cat "
                  "sleeps on the warm red mat.")
        first, = engine.generate_batch([prompt], max_tokens=24)
        again, = engine.generate_batch([prompt], max_tokens=24)
        assert again.stats.cached_prompt_tokens > 0 and again.token_ids == first.token_ids
        engine.reset()
        spec, = engine.generate_batch([prompt], max_tokens=24, speculative="lookup")
        assert spec.token_ids == first.token_ids and spec.stats.rounds < len(spec.token_ids)
    finally:
        engine.configure_kv()


def test_a_dense_quantized_engine_batches_on_quantized_blocks(engine):
    """generate_batch on an engine with the dense 4-bit cache runs on a private pool of 4-bit blocks."""
    engine.configure_kv(kv_bits="4")
    try:
        got = engine.generate_batch(PROMPTS[:2], max_tokens=6)
    finally:
        engine.configure_kv()
    assert {r.stats.kv_bits for r in got} == {"4"} and got[0].stats.kv_bytes_per_token == 6480
