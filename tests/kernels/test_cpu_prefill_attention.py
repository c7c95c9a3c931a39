"""The CPU kernel's causal softmax (cpu_kernels/attn_body.h, softmax_rows, and its vector e^x) and the tiled
prefill attention around it (kernels/prefill_attention.py) against float64 numpy oracles; the attention
hook hands causal prefill chunks to it."""

import textwrap

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import run_in_variant

from mlx_infer.kernels import prefill_attention as pa

#: (rows per matrix, keys, period, q0, window): a GQA group of 3 x 64 queries, a tile shorter than a vector
#: (tails), a row past the last key, a sliding window, one key.
SOFTMAX_CASES = [
    (192, 300, 64, 236, 0),
    (5, 13, 5, 3, 0),
    (8, 40, 8, 36, 0),
    (96, 500, 32, 400, 64),
    (4, 1, 4, 0, 0),
    (6, 20, 6, 30, 5),
]


def softmax_oracle(x, scale, period, q0, window):
    """float64 numpy: softmax of scale * x over the keys each row sees, 0 elsewhere."""
    x = np.asarray(x, dtype=np.float64)
    R, S = x.shape[-2:]
    pos = q0 + np.arange(R) % period
    keys = np.arange(S)
    seen = keys[None, :] <= pos[:, None]
    if window:
        seen &= keys[None, :] > pos[:, None] - window
    s = np.where(seen, scale * x, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.where(seen, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: "-".join(map(str, c)))
def test_causal_softmax_matches_the_oracle(cpu_kernels, case):
    R, S, period, q0, window = case
    x = mx.random.normal((2, R, S), key=mx.random.key(R + S)) * 8  # wide spread: e^x over many octaves
    got = cpu_kernels.cpu_causal_softmax(x, 0.125, period, q0, window)
    want = softmax_oracle(np.array(x), 0.125, period, q0, window)
    assert got.shape == x.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), want, rtol=2e-6, atol=1e-7)


def test_causal_softmax_zeros_what_a_row_does_not_see(cpu_kernels):
    """Masked keys get exactly 0 (not e^-87), a row past every key is all zeros, and rows sum to 1."""
    x = mx.random.normal((1, 6, 20), key=mx.random.key(3)) * 4
    got = np.array(cpu_kernels.cpu_causal_softmax(x, 1.0, 6, 15, 4))  # positions 15..20; keys 0..19
    for r in range(6):
        pos = 15 + r
        seen = [j for j in range(20) if pos - 4 < j <= pos]
        assert set(np.nonzero(got[0, r])[0]) <= set(seen)
        assert np.all(got[0, r][[j for j in range(20) if j not in seen]] == 0.0)
        assert abs(got[0, r].sum() - 1.0) < 1e-6
    # a position whose window lies past the last key (position 30, window 5: keys 26..30 of 0..19)
    far = np.array(cpu_kernels.cpu_causal_softmax(x, 1.0, 6, 30, 5))
    assert np.all(far == 0.0)


def test_vector_exp_over_its_range(cpu_kernels):
    """e^x over [-87, 0] (what a softmax feeds it) within 3e-7 relative: a row [0, d] gives e^d / (1 + e^d)."""
    d = np.linspace(-87.0, 0.0, 4001, dtype=np.float32)
    x = mx.array(np.stack([np.zeros_like(d), d], axis=1)[:, None, :])  # [N, 1, 2]
    got = np.array(cpu_kernels.cpu_causal_softmax(x, 1.0, 1, 1))[:, 0, 1]
    want = np.exp(d.astype(np.float64)) / (1.0 + np.exp(d.astype(np.float64)))
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)


def test_causal_softmax_refuses_bad_arguments(cpu_kernels):
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.cpu_causal_softmax(mx.zeros((4, 4), dtype=mx.float16), 1.0, 4, 0)
    with pytest.raises(ValueError, match="period"):
        cpu_kernels.cpu_causal_softmax(mx.zeros((4, 4)), 1.0, 0, 0)
    with pytest.raises(ValueError, match="scale"):
        cpu_kernels.cpu_causal_softmax(mx.zeros((4, 4)), 0.0, 4, 0)


def attention_oracle(q, k, v, scale):
    """float64 numpy causal attention, queries the last L of S positions, GQA by head // n_rep."""
    q, k, v = (np.asarray(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    B, n_q, L, _ = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    k, v = np.repeat(k, n_q // n_kv, axis=1), np.repeat(v, n_q // n_kv, axis=1)
    s = scale * q @ k.transpose(0, 1, 3, 2)  # [B, n_q, L, S]
    seen = np.arange(S)[None, :] <= (S - L + np.arange(L))[:, None]
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


#: (B, n_q, n_kv, L, S, D, Dv): the default model's GQA (9 / 3) over several tiles with a cached prefix, a
#: chunk that is the whole sequence, a tile remainder, MHA, head_dim 256, a batch.
PREFILL_CASES = [
    (1, 9, 3, 600, 900, 64, 64),
    (1, 4, 1, 300, 300, 128, 128),
    (1, 2, 2, 257, 270, 256, 256),
    (2, 8, 2, 40, 100, 64, 64),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_prefill_attention_matches_the_oracle(cpu_kernels, case, dtype):
    B, n_q, n_kv, L, S, D, Dv = case
    keys = mx.random.split(mx.random.key(L), 3)
    q = mx.random.normal((B, n_q, L, D), key=keys[0]).astype(dtype)
    k = (mx.random.normal((B, n_kv, S, D), key=keys[1]) * 2).astype(dtype)
    v = mx.random.normal((B, n_kv, S, Dv), key=keys[2]).astype(dtype)
    assert pa.prefill_attention_backend().startswith("cpu-")
    got = pa.prefill_attention(q, k, v, D ** -0.5)
    want = attention_oracle(q, k, v, D ** -0.5)
    assert got.shape == (B, n_q, L, Dv) and got.dtype == dtype
    tol = 2e-5 if dtype == mx.float32 else 2.0 ** -7
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol)
    ref = pa.reference_prefill_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                                         D ** -0.5)
    np.testing.assert_allclose(np.array(ref), want, rtol=2e-5, atol=2e-5)


def test_prefill_attention_refuses_shapes_that_do_not_fit(cpu_kernels):
    with pytest.raises(ValueError, match="does not fit"):
        pa.prefill_attention(mx.zeros((1, 4, 10, 64)), mx.zeros((1, 3, 10, 64)), mx.zeros((1, 3, 10, 64)), 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        pa.prefill_attention(mx.zeros((1, 4, 20, 64)), mx.zeros((1, 2, 10, 64)), mx.zeros((1, 2, 10, 64)), 0.1)


def test_prefill_fits_only_causal_chunks(cpu_kernels):
    q, k = mx.zeros((1, 4, pa.PREFILL_MIN_QUERIES, 64)), mx.zeros((1, 2, 64, 64))
    assert pa.prefill_fits(q, k, "causal")
    assert not pa.prefill_fits(q[:, :, :pa.PREFILL_MIN_QUERIES - 1], k, "causal")  # decode / verify widths
    assert not pa.prefill_fits(q, k, None)
    assert not pa.prefill_fits(q, k, mx.zeros((pa.PREFILL_MIN_QUERIES, 64), dtype=mx.bool_))  # array masks
    assert not pa.prefill_fits(q, (k, k, k), "causal")  # mlx-lm's quantized (w, scales, biases) keys


def test_the_hook_prefills_on_the_tiled_path(cpu_kernels, default_engine, monkeypatch):
    """A prompt of several tiles: the model's prefill runs prefill_attention, and its logits equal (to
    float32 rounding) those of mlx-lm's own attention on the same model."""
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_infer.kv.attention_hook as hook

    model = default_engine.model
    ids = mx.array(default_engine.encode("The tiled prefill attention. " * 80)[:600])[None]
    n = ids.shape[1]
    assert n > pa.PREFILL_TILE  # several tiles

    def logits():
        return model(ids, cache=make_prompt_cache(model))[0, -50:].astype(mx.float32)  # [50, V]

    calls = []
    real = hook.prefill_attention
    monkeypatch.setattr(hook, "prefill_attention", lambda *a: calls.append(a[0].shape) or real(*a))
    tiled = logits()
    mx.eval(tiled)
    assert calls and all(shape[2] == n for shape in calls)
    monkeypatch.setattr(hook, "prefill_fits", lambda *a: False)
    plain = logits()
    np.testing.assert_allclose(np.array(tiled), np.array(plain), atol=2e-3, rtol=0)
    assert np.array_equal(np.argmax(np.array(tiled), -1), np.argmax(np.array(plain), -1))


VARIANT_CHECK = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    import numpy as np
    from mlx_infer.kernels import cpu
    sys.path.insert(0, sys.argv[1])
    from test_cpu_prefill_attention import SOFTMAX_CASES, softmax_oracle
    assert cpu.isa() == sys.argv[2], cpu.isa()
    for R, S, period, q0, window in SOFTMAX_CASES:
        x = mx.random.normal((2, R, S), key=mx.random.key(R + S)) * 8
        got = cpu.cpu_causal_softmax(x, 0.125, period, q0, window)
        np.testing.assert_allclose(np.array(got), softmax_oracle(np.array(x), 0.125, period, q0, window),
                                   rtol=2e-6, atol=1e-7)
    print("ok")
""")


@pytest.mark.parametrize("variant", ["avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    """The AVX2 and portable variants of the softmax (which this machine may not pick)."""
    run_in_variant(VARIANT_CHECK, variant, tmp_path)
