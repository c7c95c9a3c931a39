"""RMSNorm and RoPE on the CPU kernel (cpu_kernels/rms_norm.cpp, rope.cpp; kernels/rms_norm.py, rope.py)
against float64 NumPy oracles, next to MLX's own mx.fast ops (which MLX's CPU backend runs as 11 and 29
separate operations): every dtype, strided inputs, partial rotation, per-request offsets, frequencies;
one operation each in the graph; bad arguments rejected. rope_heads (attention's heads split and rotated
in one operation) against the same oracle and against rope over mlx-lm's reshaped heads."""

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import ops_in_graph

from mlx_lm.models import gemma3_text

from mlx_infer.kernels.rms_norm import KernelOffsetRMSNorm, rms_norm
import mlx.nn as nn

from mlx_infer.kernels.rope import KernelRoPE, rope, rope_heads, rope_heads_packed

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
#: Relative precision of each dtype (the spacing of numbers near 1).
EPS = {mx.float32: 2.0 ** -23, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}


def f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def rms_oracle(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["float32", "same"])
def test_rms_norm_equals_the_oracle(cpu_kernels, dtype, weight_dtype):
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((3, 5, 576)) * 3).astype(dtype)
    w = mx.array(rng.standard_normal(576) * 0.2 + 1).astype(mx.float32 if weight_dtype == "float32" else dtype)
    got, ref = rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)
    assert got.dtype == ref.dtype == (dtype if w.dtype == dtype else mx.float32)
    want = rms_oracle(f64(x), f64(w), 1e-5)
    # two roundings in the output dtype (the normalized row, then the weight's product), on top of a
    # float32 mean
    tol = 2.5 * EPS[got.dtype] * np.abs(want) + 1e-6
    assert np.all(np.abs(f64(got) - want) <= tol)
    assert np.all(np.abs(f64(ref) - want) <= 2 * tol)  # MLX's own op: within twice that


def test_rms_norm_reads_strided_inputs(cpu_kernels):
    rng = np.random.default_rng(1)
    base = mx.array(rng.standard_normal((4, 6, 2 * 64)).astype(np.float32))
    w = mx.array(rng.standard_normal(64).astype(np.float32))
    for x in (base[..., :64].transpose(1, 0, 2), base[..., ::2], base[1:3, ::-1, 64:]):
        want = rms_oracle(f64(x), f64(w), 1e-6)
        got = rms_norm(x, w, 1e-6)
        assert got.shape == x.shape
        np.testing.assert_allclose(f64(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_norm_equals_the_oracle(cpu_kernels, dtype):
    """Gemma's RMSNorm (weight + 1) on the kernel: within the kernel's rounding of the float64 oracle, as
    close as mlx-lm's own module; one weight array, the module's; other classes rejected."""
    rng = np.random.default_rng(2)
    layer = gemma3_text.RMSNorm(256, eps=1e-6)
    layer.weight = mx.array(rng.standard_normal(256) * 0.3).astype(dtype)
    x = mx.array(rng.standard_normal((2, 4, 3, 256)) * 3).astype(dtype)
    twin = KernelOffsetRMSNorm(layer)
    assert twin["weight"] is layer["weight"]
    got, ref = twin(x), layer(x)
    assert got.dtype == ref.dtype == dtype
    want = rms_oracle(f64(x), f64(1.0 + layer.weight), 1e-6)  # 1 + weight rounded in its dtype, as mlx-lm
    tol = 2.5 * EPS[dtype] * np.abs(want) + 1e-6
    assert np.all(np.abs(f64(got) - want) <= tol)
    assert np.all(np.abs(f64(ref) - want) <= 2 * tol)
    with pytest.raises(ValueError, match="Gemma"):
        KernelOffsetRMSNorm(nn.RMSNorm(256))


def rope_oracle(x: np.ndarray, dims: int, traditional: bool, inv_freq: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """x [B, N, T, D] float64; positions [B, T]; inv_freq [dims / 2]."""
    theta = positions[:, None, :, None] * inv_freq  # [B, 1, T, dims / 2]
    c, s = np.cos(theta), np.sin(theta)
    out = x.copy()
    half = dims // 2
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
        out[..., :half], out[..., half:dims] = x1 * c - x2 * s, x1 * s + x2 * c
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
@pytest.mark.parametrize("offset", [0, 37, 4000, "per-request"])
def test_rope_as_accurate_as_mlx(cpu_kernels, dtype, traditional, dims, offset):
    rng = np.random.default_rng(2)
    B, N, T, D = 2, 3, 9, 64
    x = mx.array(rng.standard_normal((B, T, N, D))).astype(dtype).transpose(0, 2, 1, 3)  # as attention makes it
    offsets = np.array([5, 300]) if offset == "per-request" else np.array([offset, offset])
    off = mx.array(offsets.astype(np.int32)) if offset == "per-request" else offset
    scale, base = 0.5, 10000.0
    got = rope(x, dims, traditional, base, scale, off)
    ref = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=off)
    assert got.dtype == dtype and got.shape == x.shape
    half = dims // 2
    positions = (np.arange(T)[None, :] + offsets[:, None]) * scale
    want = rope_oracle(f64(x), dims, traditional, base ** (-np.arange(half) / half), positions)
    err_got, err_ref = np.abs(f64(got) - want), np.abs(f64(ref) - want)
    # both round the angle to float32 (an error growing with the position) and each product to the dtype
    assert err_got.max() <= 1.25 * err_ref.max() + 4 * EPS[dtype]
    np.testing.assert_array_equal(np.array(got[..., dims:].astype(mx.float32)), np.array(x[..., dims:].astype(mx.float32)))


def test_rope_with_frequencies(cpu_kernels):
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((1, 4, 5, 64)).astype(np.float32))
    freqs = mx.array(rng.uniform(1, 1000, 32).astype(np.float32))
    got = rope(x, 64, False, None, 1.0, 11, freqs=freqs)
    want = rope_oracle(f64(x), 64, False, 1 / f64(freqs), np.arange(11, 16, dtype=np.float64)[None, :])
    np.testing.assert_allclose(f64(got), want, rtol=0, atol=2e-5)


def test_each_is_one_operation(cpu_kernels):
    x = mx.random.normal((1, 9, 1, 64))
    w = mx.ones((64,))
    mx.eval(x, w)
    assert ops_in_graph(rms_norm(x, w, 1e-5)) == ["MlxInferRmsNorm"]
    assert ops_in_graph(rope(x, 64, False, 10000.0, 1.0, 12)) == ["MlxInferRope"]
    assert len(ops_in_graph(mx.fast.rms_norm(x, w, 1e-5))) > 5  # what MLX's CPU backend runs instead
    assert len(ops_in_graph(mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=12))) > 10


def test_bad_arguments_are_rejected(cpu_kernels):
    x = mx.zeros((1, 2, 3, 64))
    with pytest.raises(ValueError, match="dims"):
        rope(x, 63, False, 10000.0, 1.0, 0)
    with pytest.raises(ValueError, match="dims"):
        rope(x, 128, False, 10000.0, 1.0, 0)
    with pytest.raises(ValueError, match="offset"):
        rope(x, 64, False, 10000.0, 1.0, mx.array([1, 2, 3], dtype=mx.int32))
    with pytest.raises(ValueError, match="ndim"):
        rope(mx.zeros((3, 64)), 64, False, 10000.0, 1.0, 0)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, mx.ones((32,)), 1e-5)
    with pytest.raises(ValueError, match="float"):
        rms_norm(mx.zeros((2, 64), dtype=mx.int32), mx.ones((64,)), 1e-5)


def heads(x: mx.array, n: int) -> mx.array:
    """[B, T, n * D] -> [B, n, T, D], as mlx-lm's attention splits a projection."""
    B, T, _ = x.shape
    return x.reshape(B, T, n, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [64, 32])
@pytest.mark.parametrize("offset", [0, 4000, "per-request"])
@pytest.mark.parametrize("layout", ["projections", "slices of one"])
def test_rope_heads_rotate_as_rope(cpu_kernels, dtype, traditional, dims, offset, layout):
    rng = np.random.default_rng(4)
    B, T, n_q, n_kv, D, Dv = 2, 5, 6, 2, 64, 32
    widths = [n_q * D, n_kv * D, n_kv * Dv]
    if layout == "projections":
        q, k, v = (mx.array(rng.standard_normal((B, T, w))).astype(dtype) for w in widths)
    else:  # one fused projection's output, cut into three strided views
        qkv = mx.array(rng.standard_normal((B, T, sum(widths)))).astype(dtype)
        q, k, v = qkv[..., :widths[0]], qkv[..., widths[0]:-widths[2]], qkv[..., -widths[2]:]
    offsets = np.array([5, 300]) if offset == "per-request" else np.array([offset, offset])
    off = mx.array(offsets.astype(np.int32)) if offset == "per-request" else offset
    layer = KernelRoPE(nn.RoPE(dims, traditional=traditional, base=10000.0, scale=0.5))
    got_q, got_k, got_v = rope_heads(q, k, v, n_q, n_kv, layer, off)
    assert [a.shape for a in (got_q, got_k, got_v)] == [(B, n_q, T, D), (B, n_kv, T, D), (B, n_kv, T, Dv)]
    assert {a.dtype for a in (got_q, got_k, got_v)} == {dtype}
    # the same values as rope over the heads mlx-lm's attention builds, bit for bit
    assert mx.array_equal(got_q, rope(heads(q, n_q), dims, traditional, 10000.0, 0.5, off)).item()
    assert mx.array_equal(got_k, rope(heads(k, n_kv), dims, traditional, 10000.0, 0.5, off)).item()
    assert mx.array_equal(got_v, heads(v, n_kv)).item()
    # and within twice MLX's own error of the float64 oracle (both round the angle to float32, an error
    # growing with the position, then take cos / sin of it: the C library's here, MLX's own there)
    half = dims // 2
    positions = (np.arange(T)[None, :] + offsets[:, None]) * 0.5
    for got, x in ((got_q, heads(q, n_q)), (got_k, heads(k, n_kv))):
        want = rope_oracle(f64(x), dims, traditional, 10000.0 ** (-np.arange(half) / half), positions)
        ref = mx.fast.rope(x, dims, traditional=traditional, base=10000.0, scale=0.5, offset=off)
        assert np.abs(f64(got) - want).max() <= 2 * np.abs(f64(ref) - want).max() + 4 * EPS[dtype]


def test_rope_heads_is_one_operation_and_checks_its_arguments(cpu_kernels):
    q, k, v = mx.random.normal((1, 1, 9 * 64)), mx.random.normal((1, 1, 3 * 64)), mx.random.normal((1, 1, 3 * 64))
    mx.eval(q, k, v)
    layer = KernelRoPE(nn.RoPE(64, base=10000.0))
    out = rope_heads(q, k, v, 9, 3, layer, 12)
    assert ops_in_graph(out[0]) == ["MlxInferRopeHeads"]
    assert out[0].shape == (1, 9, 1, 64) and out[2].shape == (1, 3, 1, 64)
    with pytest.raises(ValueError, match="heads"):
        rope_heads(q, k, v, 4, 3, layer, 0)  # 9 * 64 features are not 4 heads of k's 64
    with pytest.raises(ValueError, match="dims"):
        rope_heads(q, k, v, 9, 3, KernelRoPE(nn.RoPE(66)), 0)
    with pytest.raises(ValueError, match="offset"):
        rope_heads(q, k, v, 9, 3, layer, mx.array([1, 2], dtype=mx.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [7, "per-request"])
def test_packed_heads_equal_the_three_projections(cpu_kernels, dtype, offset):
    """rope_heads_packed of one fused q / k / v product equals rope_heads of its three column ranges bit for
    bit, as one operation; with v's heads narrower than q's it splits and runs rope_heads."""
    B, T, n_q, n_kv, D = 2, 3, 6, 2, 64
    qkv = mx.random.normal((B, T, (n_q + 2 * n_kv) * D), key=mx.random.key(5)).astype(dtype)
    mx.eval(qkv)
    off = mx.array([5, 300], dtype=mx.int32) if offset == "per-request" else offset
    layer = KernelRoPE(nn.RoPE(32, base=10000.0))
    widths = (n_q * D, n_kv * D, n_kv * D)
    got = rope_heads_packed(qkv, widths, n_q, n_kv, layer, off)
    assert ops_in_graph(got[0]) == ["MlxInferRopeHeads"]
    q, k, v = mx.split(qkv, [widths[0], widths[0] + widths[1]], axis=-1)
    for a, b in zip(got, rope_heads(q, k, v, n_q, n_kv, layer, off)):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    narrow = qkv[..., : (n_q + n_kv) * D + n_kv * 32]  # v heads of 32 features
    widths = (n_q * D, n_kv * D, n_kv * 32)
    got = rope_heads_packed(narrow, widths, n_q, n_kv, layer, off)
    assert got[2].shape == (B, n_kv, T, 32)
    q, k, v = mx.split(narrow, [widths[0], widths[0] + widths[1]], axis=-1)
    for a, b in zip(got, rope_heads(q, k, v, n_q, n_kv, layer, off)):
        assert mx.array_equal(a, b).item()
    with pytest.raises(ValueError, match="heads"):
        cpu_kernels.cpu_rope_heads_packed(qkv[..., :-1], n_q, n_kv, 32, False, 10000.0, 1.0, 0)
