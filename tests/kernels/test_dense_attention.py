"""Decode / verify attention over mlx-lm's dense KVCache on the paged kernel (kernels/dense_attention.py),
reading the cache's buffer in place, against a float64 numpy oracle; the attention hook's routing to it; and
a PagedKVCache over float blocks giving the same logits as the dense cache on that path."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_infer.kv.attention_hook as hook
from mlx_infer.kernels.dense_attention import dense_attention, dense_fits
from mlx_infer.kv.cache import make_paged_cache, make_pool


def oracle(q, k, v, scale):
    """float64 causal attention: the L queries are the last L of the S keys' positions; GQA by head."""
    q, k, v = (np.asarray(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    L, S, rep = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = scale * q @ k.transpose(0, 1, 3, 2)  # [B, n_q, L, S]
    s = np.where(np.arange(S)[None, :] <= (S - L + np.arange(L))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("B, n_q, n_kv, L, prefix, D", [
    (1, 9, 3, 1, 700, 64), (1, 9, 3, 9, 300, 64), (2, 4, 2, 1, 40, 128), (1, 8, 1, 16, 1000, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["f32", "f16"])
def test_dense_attention_over_a_kv_cache_buffer(cpu_kernels, B, n_q, n_kv, L, prefix, D, dtype):
    """A KVCache filled in two writes (its buffer grows in steps of 256, so capacity > offset) and the
    attention of the last write's queries over it."""
    keys = mx.random.split(mx.random.key(prefix + L), 5)
    cache = KVCache()
    cache.update_and_fetch(mx.random.normal((B, n_kv, prefix, D), key=keys[0]).astype(dtype),
                           mx.random.normal((B, n_kv, prefix, D), key=keys[1]).astype(dtype))
    k, v = cache.update_and_fetch(mx.random.normal((B, n_kv, L, D), key=keys[2]).astype(dtype),
                                  mx.random.normal((B, n_kv, L, D), key=keys[3]).astype(dtype))
    q = mx.random.normal((B, n_q, L, D), key=keys[4]).astype(dtype)
    assert cache.keys.shape[2] > cache.offset and dense_fits(L, D, D)
    got = dense_attention(q, cache.keys, cache.values, cache.offset, D ** -0.5)
    assert got.shape == (B, n_q, L, D) and got.dtype == dtype
    tol = 1e-5 if dtype == mx.float32 else 2e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), oracle(q, k, v, D ** -0.5), rtol=tol, atol=tol)


def test_dense_attention_refuses_a_length_outside_the_buffer(cpu_kernels):
    buf = mx.zeros((1, 2, 32, 64))
    with pytest.raises(ValueError, match="buffer of 32"):
        dense_attention(mx.zeros((1, 4, 1, 64)), buf, buf, 33, 0.1)
    with pytest.raises(ValueError, match="2 queries"):
        dense_attention(mx.zeros((1, 4, 2, 64)), buf, buf, 1, 0.1)


def test_dense_fits_only_decode_and_verify_widths(cpu_kernels):
    assert dense_fits(1, 64, 64) and dense_fits(16, 128, 128)
    assert not dense_fits(17, 64, 64)  # prefill chunks: the tiled prefill path
    assert not dense_fits(1, 40, 40)  # head dims the kernel does not take


def test_the_hook_decodes_a_dense_cache_on_the_kernel(cpu_kernels, default_engine, monkeypatch):
    """Decode steps over the default model's dense caches run dense_attention, and give the logits of
    mlx-lm's own attention to float32 rounding (the same greedy token)."""
    model = default_engine.model
    ids = default_engine.encode("Paged kernels read a dense buffer in place.")

    def decode_logits():
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-3])[None], cache=cache)
        return [model(mx.array([[t]]), cache=cache)[0, -1].astype(mx.float32) for t in ids[-3:]]  # 3 x [V]

    calls = []
    real = hook.dense_attention
    monkeypatch.setattr(hook, "dense_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    kernel = decode_logits()
    mx.eval(kernel)
    assert len(calls) == 3 * len(model.layers) and all(shape[2] == 1 for shape in calls)
    monkeypatch.setattr(hook, "_dense_decode", lambda *a: False)
    plain = decode_logits()
    for a, b in zip(kernel, plain):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-3, rtol=0)
        assert int(mx.argmax(a)) == int(mx.argmax(b))


@pytest.mark.parametrize("interleaved", [False, True], ids=["run", "lookup"])
def test_paged_float_decode_equals_the_dense_cache(cpu_kernels, default_engine, interleaved):
    """The same tokens through a dense KVCache and a PagedKVCache over float blocks of 4 tokens: identical
    logits at every decode and verify step, whether the request's blocks follow one another (attention
    reads one range of the pool, TokenTable.run) or another request's blocks sit between them (attention
    reads through the token table's lookup)."""
    model = default_engine.model
    ids = default_engine.encode("The token table maps logical tokens to slots of the block pool. " * 3)
    pool = make_pool(model, block_size=4)
    dense, paged = make_prompt_cache(model), make_paged_cache(model, pool)
    other = make_paged_cache(model, pool)  # another request, taking the block after each of ours
    steps = [ids[:20], ids[20:21], ids[21:30], ids[30:31]]  # prefill, decode, a 9-token verify, decode
    for i, chunk in enumerate(steps):
        a = model(mx.array(chunk)[None], cache=dense)
        b = model(mx.array(chunk)[None], cache=paged)
        assert np.array_equal(np.array(a), np.array(b)), f"logits differ after {len(chunk)} tokens"
        assert (paged[0].sequence.table.run is None) == (interleaved and i > 0)
        if interleaved:
            model(mx.array(ids[:4])[None], cache=other)


@pytest.fixture(scope="module")
def kernel_engine(default_gguf):
    """The default model with its weights quantized on the CPU kernels (weights="auto")."""
    import mlx_infer

    engine = mlx_infer.load()
    assert engine.source.weights != "float32"
    return engine


def test_the_widest_verify_stays_on_the_decode_kernels():
    """defaults.MAX_VERIFY_WIDTH is a literal (defaults.py imports nothing): it must stay within the paged /
    dense decode kernels' positions and under the prefill path's threshold, or verify rows leave the
    row-by-row computation that makes greedy speculation exact."""
    from mlx_infer.defaults import MAX_VERIFY_WIDTH
    from mlx_infer.kernels.paged_attention import PAGED_MAX_QUERIES
    from mlx_infer.kernels.prefill_attention import PREFILL_MIN_QUERIES

    assert MAX_VERIFY_WIDTH <= PAGED_MAX_QUERIES and MAX_VERIFY_WIDTH < PREFILL_MIN_QUERIES


@pytest.mark.parametrize("kind", ["dense", "8-bit", "4-bit", "paged"])
def test_verify_rows_equal_decode_steps(cpu_kernels, kernel_engine, kind):
    """On the kernel path a verify forward's rows are bit-identical to decoding the same tokens one by one
    (what makes speculative decoding exactly lossless), up to the widest verify the loop runs
    (MAX_VERIFY_WIDTH): the attention kernels split the sequence at fixed multiples of 256 keys and keep
    each key's place in their sums, the quantized matmul computes each row alone, and so does the Hadamard
    rotation of 4-bit K/V. Over 700 cached tokens (three splits)."""
    from mlx_infer.defaults import MAX_VERIFY_WIDTH
    from mlx_infer.kv.quant_cache import make_quant_cache
    from mlx_infer.kv.quant_options import kv_quant

    model = kernel_engine.model
    W = MAX_VERIFY_WIDTH
    ids = kernel_engine.encode("A verify forward must see what decoding sees. " * 100)[:700 + W]
    assert len(ids) == 700 + W
    make = {"dense": lambda: make_prompt_cache(model),
            "8-bit": lambda: make_quant_cache(model, kv_quant("8")),
            "4-bit": lambda: make_quant_cache(model, kv_quant("4")),
            "paged": lambda: make_paged_cache(model, make_pool(model, block_size=16))}[kind]
    stepped, verified = make(), make()
    for cache in (stepped, verified):
        model(mx.array(ids[:700])[None], cache=cache)
    steps = [model(mx.array([[t]]), cache=stepped)[0, -1] for t in ids[700:]]  # W x [V]
    verify = model(mx.array([ids[700:]]), cache=verified)[0]  # [W, V]
    for i, row in enumerate(steps):
        assert np.array_equal(np.array(row), np.array(verify[i])), f"row {i} differs ({kind})"
