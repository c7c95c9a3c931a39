"""The quantized KV cache (kv/quant_cache.py): its options, what it stores and returns (affine, KIVI, the
quantization threshold, trim), the fused attention against mlx-lm's attention on the same packed K/V for
every architecture, and the engine paths (speculative decoding, kept caches, stats, refusals, recall)."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import mlx_infer
from gguf_factory import MODEL_TYPES, TinySpec, random_weights, write_gguf
from quant_oracle import round_trip, sylvester
from mlx_infer.errors import MlxInferError
from mlx_infer.kv import attention_hook, quant_cache, rotation
from mlx_infer.kv.quant_cache import QuantKVCache, make_quant_cache
from mlx_infer.kv.quant_options import KVQuant, kv_quant, parse_kv_bits


@pytest.fixture(scope="module")
def models64(tmp_path_factory):
    """arch -> a tiny random model with head_dim 64 (what the kernels tile), GQA 4:2; gemma3: 6 layers,
    five of them sliding windows of 8 tokens (float rotating caches)."""
    out = {}
    for arch in MODEL_TYPES:
        kw = {"layers": 6, "sliding_window": 8} if arch == "gemma3" else {}
        spec = TinySpec(arch, hidden=256, ffn=256, **kw)  # 4 heads of 64 (qwen2 derives head_dim)
        path = write_gguf(tmp_path_factory.mktemp("q") / f"{arch}.gguf", spec, random_weights(spec, seed=5), Q.F32)
        out[arch] = mlx_infer.load(str(path), weights="native").model
    return out


def kv(length, seed, n_kv=2, dim=64):
    """Random keys and values [1, n_kv, length, dim] with a few large channels (as real keys have)."""
    scale = 1 + (mx.arange(dim) % 5) * 2
    k = mx.random.normal((1, n_kv, length, dim), key=mx.random.key(seed)) * scale
    v = mx.random.normal((1, n_kv, length, dim), key=mx.random.key(seed + 1))
    return k, v


def per_channel(x, bits, gs):
    """KIVI's keys: each channel quantized over chunks of gs tokens. x [1, H, T, D] (T a multiple of gs)."""
    _, H, T, D = x.shape
    xt = x[0].reshape(H, T // gs, gs, D).transpose(0, 3, 1, 2)  # [H, D, chunks, gs]
    return round_trip(xt, bits, gs).transpose(0, 2, 3, 1).reshape(1, H, T, D)


def test_options():
    assert parse_kv_bits("8") == (8, 8) and parse_kv_bits(4) == (4, 4) and parse_kv_bits("k8v4") == (8, 4)
    assert parse_kv_bits(None) is None and parse_kv_bits("none") is None
    assert kv_quant("k4v8", "kivi", "100") == KVQuant(4, 8, "kivi", 64, 100, 64)
    assert str(kv_quant("k8v4")) == "k8v4" and str(kv_quant("4", "kivi")) == "kivi-4"
    rotated = lambda q: (q.rotate_k, q.rotate_v)  # noqa: E731
    assert rotated(kv_quant("4")) == (True, True) and rotated(kv_quant("8")) == (False, False)  # 4-bit stores
    assert rotated(kv_quant("k8v4")) == (False, True) and rotated(kv_quant("4", "kivi")) == (False, False)
    assert rotated(kv_quant("8", kv_rotate=True)) == (True, True) and rotated(kv_quant("4", kv_rotate=False)) == (False, False)
    assert [str(kv_quant(b, kv_rotate=r)) for b, r in (("4", True), ("4", False), ("8", True), ("k8v4", None))] == \
        ["4", "4@norot", "8@rot", "k8v4"]
    assert kv_quant(None) is None
    for bad, msg in [(("3",), "kv_bits must be"), (("\uff18",), "kv_bits must be"), (("k8v2",), "kv_bits must be"), (("8", "nf4"), "kv_scheme"),
                     (("8", "affine", "-1"), "kv_quant_start"), ((None, "kivi"), "give kv_bits"),
                     (("8", "affine", "\u00b2"), "kv_quant_start must be an integer"),
                     (("8", "affine", 0, 48), "kv_group_size"), (("8", "kivi", 0, 64, 40), "multiple of"),
                     (("8", "affine", 0, 64, 64, "yes"), "kv_rotate must be True or False"),
                     ((None, "affine", 0, 64, 64, True), "kv_rotate and kv_group_size apply to a quantized KV cache"),
                     ((None, "affine", 0, 32), "kv_group_size apply to a quantized KV cache"),
                     (("8", "kivi", 0, 64, 64, True), "kv_rotate applies to kv_scheme='affine'")]:
        with pytest.raises(MlxInferError, match=msg):
            kv_quant(*bad)


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (8, 4)])
def test_affine_cache_returns_each_token_round_tripped(bits, rotate):
    """Chunks of 100, 1 and 37 tokens: the K/V returned are every token's own round trip (per token, so
    chunking does not matter; rotated: in the Hadamard basis, then back), the offset counts them, and the
    packed rows grow past QUANT_STEP."""
    cache = QuantKVCache(KVQuant(*bits, rotate_k=rotate, rotate_v=rotate))
    k, v = kv(300, 0)
    chunks = ((0, 100), (100, 101), (101, 138), (138, 300))
    for a, b in chunks:
        keys, values = cache.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
    assert cache.offset == 300 and cache.n_quantized == 300
    for got, x, b in ((keys, k, bits[0]), (values, v, bits[1])):
        want = round_trip(x, b, rotated=rotate)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=1e-5)


def test_rotation_is_orthogonal_and_spreads_an_outlier_channel():
    """rotate multiplies by the Sylvester matrix H, and H H = I (rotate is its own inverse); with one key channel
    40x the others, 4-bit scores q k^T through the rotated cache are closer to the float scores than
    through plain per-token groups, where the outlier sets every group's scale."""
    for n in (32, 64, 128, 256):
        h = np.array(rotation.rotate(mx.eye(n), n))  # the rows of the identity, rotated: H itself
        np.testing.assert_allclose(h, np.array(sylvester(n)), rtol=0, atol=1e-7)
        np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-6)
    x = mx.random.normal((3, 50, 128), key=mx.random.key(2))
    np.testing.assert_allclose(np.array(rotation.rotate(rotation.rotate(x, 64), 64)), np.array(x), atol=1e-5)
    k = mx.random.normal((1, 2, 200, 64), key=mx.random.key(7)) * mx.where(mx.arange(64) == 5, 40.0, 1.0)
    q = mx.random.normal((1, 2, 4, 64), key=mx.random.key(3))
    exact = np.array(q @ k.swapaxes(-1, -2))
    err = {}
    for rotate in (False, True):
        cache = QuantKVCache(KVQuant(4, 4, rotate_k=rotate, rotate_v=rotate))
        keys, _ = cache.update_and_fetch(k, k)
        err[rotate] = np.abs(np.array(q @ keys.swapaxes(-1, -2)) - exact).mean()
    assert err[True] < 0.5 * err[False], err


def test_rotation_of_a_row_does_not_depend_on_the_rows_beside_it():
    """A token's rotated float32 key is bit-identical whether it is rotated alone (a decode step: n_kv rows)
    or with the other tokens of a verify forward (n_kv x L rows), and so are query rows: speculative
    decoding over 4-bit rotated KV must write and read the same codes as plain decoding. (A float32 matmul
    by the 64 x 64 Hadamard matrix failed this under OpenBLAS from L = 2.)"""
    for shape in ((3, 12, 64), (1, 3, 12, 128)):
        x = mx.random.normal(shape, key=mx.random.key(11)) * 3.0
        whole = np.array(rotation.rotate(x, 64))
        for i in range(12):
            alone = rotation.rotate(x[..., i:i + 1, :], 64)
            np.testing.assert_array_equal(np.array(alone), whole[..., i:i + 1, :])
    np.testing.assert_allclose(whole, np.array(x) @ np.kron(np.eye(2), np.array(sylvester(64))), atol=1e-5)


def test_kivi_quantizes_keys_per_channel_and_keeps_the_recent_tokens_in_float():
    """Residual 64, groups of 32: after 150 tokens the oldest 64 (two whole chunks) are packed (keys per
    channel, values per token) and the last 86 are exactly the float inputs."""
    cache = QuantKVCache(kv_quant("4", "kivi", kv_group_size=32, kv_residual=64))
    k, v = kv(150, 1)
    for a in range(0, 150, 10):
        keys, values = cache.update_and_fetch(k[:, :, a:a + 10], v[:, :, a:a + 10])
    assert cache.n_quantized == 64
    np.testing.assert_array_equal(np.array(keys[:, :, 64:]), np.array(k[:, :, 64:]))
    np.testing.assert_array_equal(np.array(values[:, :, 64:]), np.array(v[:, :, 64:]))
    np.testing.assert_array_equal(np.array(keys[:, :, :64]), np.array(per_channel(k[:, :, :64], 4, 32)))
    np.testing.assert_array_equal(np.array(values[:, :, :64]), np.array(round_trip(v[:, :, :64], 4, 32)))


def test_threshold_converts_the_whole_float_context():
    """kv_quant_start 100: 60 tokens stay float; the forward that crosses 100 quantizes all 120 (the
    prefilled context is kept, as its round trip)."""
    cache = QuantKVCache(kv_quant("8", kv_quant_start=100, kv_rotate=True))
    k, v = kv(120, 2)
    keys, _ = cache.update_and_fetch(k[:, :, :60], v[:, :, :60])
    assert cache.n_quantized == 0 and cache.bytes_per_token() == 2 * (64 + 64) * 4  # float32, 2 KV heads
    np.testing.assert_array_equal(np.array(keys), np.array(k[:, :, :60]))
    keys, values = cache.update_and_fetch(k[:, :, 60:], v[:, :, 60:])
    assert cache.n_quantized == 120 and cache.bytes_per_token() == 2 * (64 + 64 + 2 * 2 * 2)  # 2 groups x scale, bias x 2 bytes
    np.testing.assert_allclose(np.array(keys), np.array(round_trip(k, 8, rotated=True)), rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.array(values), np.array(round_trip(v, 8, rotated=True)), rtol=0, atol=1e-4)


@pytest.mark.parametrize("quant", [kv_quant("8"), kv_quant("4", "kivi", kv_group_size=32, kv_residual=32),
                                   kv_quant("k8v4", kv_quant_start=50)], ids=str)
def test_trim_drops_the_last_tokens_and_keeps_the_rest(quant):
    """Trimming (speculative rollback, a kept cache cut to a common prefix) leaves the first tokens as they
    were returned before, even when it reaches into KIVI's packed chunks; appending then goes on."""
    cache = QuantKVCache(quant)
    k, v = kv(130, 3)
    for a in range(0, 130, 13):
        keys, values = cache.update_and_fetch(k[:, :, a:a + 13], v[:, :, a:a + 13])
    before_k, before_v = np.array(keys), np.array(values)
    for n in (3, 40):
        assert cache.trim(n) == n
    assert cache.offset == 87
    k2, v2 = kv(1, 9)
    keys, values = cache.update_and_fetch(k2, v2)
    assert cache.offset == 88
    np.testing.assert_array_equal(np.array(keys[:, :, :87]), before_k[:, :, :87])
    np.testing.assert_array_equal(np.array(values[:, :, :87]), before_v[:, :, :87])
    assert cache.trim(1000) == 88 and cache.offset == 0


def test_exact_prefix_gives_back_what_a_fresh_prefill_holds():
    """A kept cache trimmed to exact_prefix(n, length) and then given the rest of `length` tokens holds the
    very K/V of a fresh cache given those tokens: KIVI (groups of 32, residual 32) after 130 tokens packs
    96, where a fresh prefill of 110 packs 64, so the trim goes back to 64 (to 100, as before, it would
    hold 32 tokens of dequantized keys where the fresh cache holds floats). The affine scheme with a float
    prefix (start 100) gives back nothing for a request that stays under it."""
    kivi = kv_quant("4", "kivi", kv_group_size=32, kv_residual=32)
    k, v = kv(130, 5)
    kept = QuantKVCache(kivi)
    for a in range(0, 130, 13):
        kept.update_and_fetch(k[:, :, a:a + 13], v[:, :, a:a + 13])
    assert kept.n_quantized == 96
    assert (kept.exact_prefix(120, 200), kept.exact_prefix(120, 100), kept.exact_prefix(50, 200)) == (120, 64, 32)
    n = kept.exact_prefix(100, 110)
    assert n == 64
    kept.trim(130 - n)
    got = kept.update_and_fetch(k[:, :, n:110], v[:, :, n:110])
    fresh = QuantKVCache(kivi)
    fresh.update_and_fetch(k[:, :, :55], v[:, :, :55])
    want = fresh.update_and_fetch(k[:, :, 55:110], v[:, :, 55:110])
    assert kept.n_quantized == fresh.n_quantized == 64
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    late = QuantKVCache(kv_quant("8", kv_quant_start=100))
    late.update_and_fetch(k[:, :, :120], v[:, :, :120])
    assert late.n_quantized == 120 and late.exact_prefix(60, 90) == 0 and late.exact_prefix(60, 150) == 60


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
@pytest.mark.parametrize("quant", [kv_quant("8", kv_rotate=False), kv_quant("k8v4", kv_rotate=False),
                                   kv_quant("4", "kivi", kv_group_size=32, kv_residual=32)],
                         ids=str)
def test_fused_attention_equals_mlx_lm_attention_on_the_same_cache(models64, monkeypatch, arch, quant):
    """Prefill of 90 tokens, 4 decode steps and a verify forward of 4 tokens: logits with the fused kernel
    over the packed K/V (KIVI: its packed tokens merged with its float window) equal those of mlx-lm's
    attention over the dequantized K/V the cache returns, up to float32 rounding and what it does to the
    cache: each run fills its own cache, so a later layer's K / V differ by rounding between the runs and a
    value at a quantization step's boundary can round to the next 8-bit code in one of them. The prefill
    runs the tiled prefill attention, as close to float64 as mlx-lm's
    (tests/kernels/test_cpu_prefill_attention.py). Measured: up to 2.1e-5 of the largest logit on AVX2,
    6.3e-5 (qwen2, 8-bit) with the AVX-512 kernels, 1.3e-4 (llama, 8-bit, in the verify rows) once the
    SwiGLU kernel changed the MLP's rounding. Bound: 1e-3 of the largest logit; a wrong key, value or scale
    moves logits by far more."""
    model = models64[arch]
    prompt = [(37 * i) % 250 + 3 for i in range(90)]

    def run():
        cache = make_quant_cache(model, quant)
        outs = [model(mx.array([prompt]), cache=cache)[0, -1]]
        for t in (9, 1, 4, 6):
            outs.append(model(mx.array([[t]]), cache=cache)[0, -1])
        outs.append(model(mx.array([[8, 10, 12, 14]]), cache=cache)[0])
        return np.concatenate([np.array(o.astype(mx.float32)).reshape(-1) for o in outs])

    assert attention_hook.install(model) == len(model.layers)
    calls = []
    for name in ("quant_attention", "channel_keys_attention"):
        real = getattr(quant_cache, name)
        monkeypatch.setattr(quant_cache, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    fused = run()
    assert len(calls) >= 5 * sum(type(c).__name__ == "QuantKVCache" for c in make_quant_cache(model, quant))
    for layer in model.layers:  # the project's attention layers, attending through mlx-lm's own function
        monkeypatch.setattr(layer.self_attn, "attend", attention_hook.mlx_lm_attention)
    plain = run()
    np.testing.assert_allclose(fused, plain, rtol=0, atol=1e-3 * np.abs(plain).max())


@pytest.mark.parametrize("quant", [kv_quant("8", kv_rotate=True), kv_quant("4"), kv_quant("k8v4", kv_group_size=32)],
                         ids=str)
def test_rotated_fused_attention_equals_attention_over_the_returned_kv(quant):
    """One layer, GQA 4:2: the fused attention of a rotated cache (queries moved into the keys' stored basis,
    the output out of the values'; k8v4: only V rotated) equals MLX's attention over the K/V the same cache returns (dequantized and
    rotated back), for a 90-token causal prefill chunk, a decode step and a 4-token verify, to 3e-5 (float32
    rounding of the two rotations)."""
    cache = QuantKVCache(quant)
    k, v = kv(95, 11)
    scale = 64 ** -0.5
    for a, b, mask in ((0, 90, "causal"), (90, 91, None), (91, 95, "causal")):
        keys, values = cache.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
        q = mx.random.normal((1, 4, b - a, 64), key=mx.random.key(b))
        got = cache.fused_attention(q, scale, mask)
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        assert got is not None and got.shape == (1, 4, b - a, 64)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=0, atol=3e-5)


def test_sliding_window_layers_keep_mlx_lm_caches(models64):
    cache = make_quant_cache(models64["gemma3"], kv_quant("8"))
    kinds = [type(c).__name__ for c in cache]
    assert kinds.count("QuantKVCache") == 1 and kinds.count("RotatingKVCache") == 5


def test_head_dim_the_kernels_cannot_take_is_a_clear_error(tmp_path):
    spec = TinySpec("llama")  # head_dim 16
    model = mlx_infer.load(str(write_gguf(tmp_path / "m.gguf", spec, random_weights(spec), Q.F32)), weights="native").model
    with pytest.raises(MlxInferError, match="head dim that is a multiple of 32"):
        model(mx.array([[1, 2, 3]]), cache=make_quant_cache(model, kv_quant("8")))


def test_group_size_fits_the_head_dim_when_not_chosen(tmp_path):
    """A head dim of 96 (4 heads of 96, GQA 4:2): the default groups of 64 do not divide it, so configure_kv
    picks groups of 32 and generation runs on the packed K/V; an explicit kv_group_size=64 is refused at
    configure_kv, naming the size that fits, and the previous setting stays."""
    spec = TinySpec("llama", hidden=384, heads=4, kv_heads=2)  # head_dim 96
    engine = mlx_infer.load(str(write_gguf(tmp_path / "m.gguf", spec, random_weights(spec), Q.F32)), weights="native")
    engine.configure_kv(kv_bits="4")
    assert engine._quant.group_size == 32
    out = engine.generate([5, 6, 7, 8], max_tokens=3, chat_template=False)
    assert len(out.token_ids) == 3 and out.stats.kv_bits == "4"
    assert out.stats.kv_bytes_per_token == 2 * 2 * 2 * (96 / 2 + 3 * 2 * 2)  # 2 layers x K, V x 2 heads
    with pytest.raises(MlxInferError, match="this model's is 96: try kv_group_size=32 or float KV"):
        engine.configure_kv(kv_bits="4", kv_group_size=64)
    assert engine._quant.group_size == 32


@pytest.fixture(scope="module")
def engine(default_gguf):
    return mlx_infer.load()


def test_engine_stats_and_lossless_speculation(engine):
    """8-bit KV: kv_bytes_per_token is 30 layers x 3 KV heads x (64 + 64 bytes of codes + 2 x 2 float16
    scale/bias pairs) = 12240 (0.53x float16's 23040); speculative decoding over the quantized target is
    lossless (greedy: the same tokens as plain decoding on it)."""
    engine.configure_kv(kv_bits="8")
    try:
        prompt = ("Copy this text exactly, twice: The quick brown fox jumps over the lazy dog while the cat "
                  "sleeps on the warm red mat.")
        plain = engine.generate(prompt, max_tokens=32)
        assert plain.stats.kv_bits == "8" and plain.stats.kv_bytes_per_token == 30 * 3 * (64 + 64 + 2 * 2 * 2)
        engine.reset()
        spec = engine.generate(prompt, max_tokens=32, speculative="lookup", max_draft=4)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.rounds < len(spec.token_ids)  # it did speculate
    finally:
        engine.configure_kv()
    assert engine.generate("Hi", max_tokens=2).stats.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4  # float32 KV


@pytest.mark.parametrize("options", [{"kv_bits": "8"}, {"kv_bits": "4", "kv_scheme": "kivi"}], ids=str)
def test_kept_cache_continues_a_chat(engine, options):
    """A next turn prefills only its new tokens on the kept quantized cache and answers as a fresh run."""
    engine.configure_kv(**options)
    try:
        first = [{"role": "user", "content": "Name a fruit that is red."}]
        r1 = engine.generate(first, max_tokens=12)
        turn = first + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And a yellow one?"}]
        r2 = engine.generate(turn, max_tokens=12)
        assert r2.stats.cached_prompt_tokens > 0
        engine.reset()
        fresh = engine.generate(turn, max_tokens=12)
        assert fresh.stats.cached_prompt_tokens == 0 and fresh.token_ids == r2.token_ids
    finally:
        engine.configure_kv()


def test_kivi_request_after_a_longer_one_answers_as_a_fresh_one(engine):
    """The same 89-token prompt again: the kept KIVI cache (64 tokens packed after the first answer) is not
    trimmed into its packed chunks, where a fresh prefill keeps floats; the tokens are the fresh run's (the
    kept cache trimmed to 88 tokens answered differently from token 19 on)."""
    prompt = ("Fix the spelling mistakes in this text and return the whole corrected text:\n\nThe comittee met on "
              "tuesday to discus the new budjet. Every member agreed that the libary needs more funding, and the "
              "chairman promised to adress the isue at the next meeting.")
    engine.configure_kv(kv_bits="4", kv_scheme="kivi")
    try:
        engine.reset()
        fresh = engine.generate(prompt, max_tokens=48).token_ids
        again = engine.generate(prompt, max_tokens=48)
        spec = engine.generate(prompt, max_tokens=48, speculative="lookup", max_draft=2)
        assert again.token_ids == fresh and spec.token_ids == fresh
    finally:
        engine.configure_kv()


def test_refusals(engine):
    """The paged cache's blocks hold the affine scheme from the first token: KIVI and a float prefix are one
    MlxInferError line each (with the paged cache, and for batched decoding on a dense engine)."""
    with pytest.raises(MlxInferError, match="kivi.*does not fit the paged cache's token blocks.*kv_scheme='affine'"):
        engine.configure_kv(kv_cache="paged", kv_bits="4", kv_scheme="kivi")
    with pytest.raises(MlxInferError, match="kv_quant_start=64 .*needs the dense KV cache"):
        engine.configure_kv(kv_cache="paged", kv_bits="8", kv_quant_start=64)
    engine.configure_kv(kv_bits="4", kv_scheme="kivi")
    try:
        with pytest.raises(MlxInferError, match="batched decoding runs on the paged KV pool: kv_scheme='kivi'"):
            engine.generate_batch(["Hi", "Yo"], max_batch=2)
    finally:
        engine.configure_kv()


def test_recall_of_an_early_fact(engine, wikitext):
    """A fact stated at the start of a ~700-token prompt and asked at the end: 8-bit KV (from token 0, and
    converted at a threshold in the middle of the prompt) answers as float KV does."""
    filler = engine.tokenizer.decode(engine.tokenizer.encode(wikitext[:6000])[:600])
    prompt = (f"Remember this: the secret password is BLUE-HORSE-42.\n\n{filler}\n\n"
              "What is the secret password mentioned at the start? Answer with the password only.")
    want = engine.generate(prompt, max_tokens=10).token_ids
    for options in ({"kv_bits": "8"}, {"kv_bits": "8", "kv_quant_start": 300}):
        engine.configure_kv(**options)
        try:
            assert engine.generate(prompt, max_tokens=10).token_ids == want, options
        finally:
            engine.configure_kv()
