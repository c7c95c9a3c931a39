"""GGUF tensor data -> MLX arrays, type by type."""

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants

from gguf_factory import random_k_quant_blocks
from mlx_infer.errors import UnsupportedModelError
from mlx_infer.loading.gguf_tensors import REQUANT_BITS, permute_rows_for_rope, tensor_to_mlx

ROWS, COLS = 24, 512


@pytest.fixture(scope="module")
def dense():
    rng = np.random.default_rng(7)
    w = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero group
    w[1, :32] = 3.0  # a constant group
    return w


def _write_and_read(path, tensors):
    """Write {name: (array, raw_dtype or None)} to a GGUF and read it back with GGUFReader."""
    w = GGUFWriter(str(path), "llama")
    for name, (a, raw_dtype) in tensors.items():
        w.add_tensor(name, a, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {t.name: t for t in GGUFReader(str(path)).tensors}


def _dequant(arrays, bits):
    return np.array(
        mx.dequantize(arrays["weight"], arrays["scales"], arrays["biases"], group_size=32, bits=bits).astype(mx.float32)
    )


@pytest.mark.parametrize("qtype,bits", [(Q.Q8_0, 8), (Q.Q4_0, 4), (Q.Q4_1, 4)])
def test_native_types_repacked_exactly_as_mx_load(qtype, bits, dense, tmp_path):
    """Q8_0 / Q4_0 / Q4_1 become the very arrays MLX's own GGUF reader produces."""
    blocks = quants.quantize(dense, qtype)
    path = tmp_path / f"{qtype.name}.gguf"
    t = _write_and_read(path, {"blk.0.attn_q.weight": (blocks, qtype)})["blk.0.attn_q.weight"]
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    ours = tensor_to_mlx(t.data, t.tensor_type, shape, t.name)
    theirs = mx.load(str(path))
    for key in ("weight", "scales", "biases"):
        a, b = ours[key], theirs[f"blk.0.attn_q.{key}"]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        assert mx.array_equal(a, b).item(), key
    assert ours["weight"].shape == (ROWS, COLS * bits // 32)
    # and it dequantizes to exactly what gguf's own dequantizer gives
    want = quants.dequantize(blocks, qtype).reshape(ROWS, COLS)
    np.testing.assert_allclose(_dequant(ours, bits), want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_float_types(dense, tmp_path):
    bf16 = quants.quantize(dense, Q.BF16)
    tensors = _write_and_read(
        tmp_path / "f.gguf",
        {"a.weight": (dense, None), "b.weight": (dense.astype(np.float16), None), "c.weight": (bf16, Q.BF16)},
    )
    f32 = tensor_to_mlx(tensors["a.weight"].data, Q.F32, (ROWS, COLS), "a")["weight"]
    f16 = tensor_to_mlx(tensors["b.weight"].data, Q.F16, (ROWS, COLS), "b")["weight"]
    b16 = tensor_to_mlx(tensors["c.weight"].data, Q.BF16, (ROWS, COLS), "c")["weight"]
    assert (f32.dtype, f16.dtype, b16.dtype) == (mx.float32, mx.float16, mx.bfloat16)
    np.testing.assert_array_equal(np.array(f32), dense)
    np.testing.assert_array_equal(np.array(f16), dense.astype(np.float16))
    want_bf16 = quants.dequantize(bf16, Q.BF16).reshape(ROWS, COLS)
    np.testing.assert_array_equal(np.array(b16.astype(mx.float32)), want_bf16)


def _blocks(qtype, dense):
    if qtype in (Q.Q5_0, Q.Q5_1):
        return quants.quantize(dense, qtype)
    return random_k_quant_blocks(qtype, ROWS, COLS, seed=int(qtype))


@pytest.mark.parametrize("qtype,bits", [(Q.Q5_0, 5), (Q.Q5_1, 5), (Q.Q4_K, 4), (Q.Q5_K, 5)])
def test_affine32_types_repacked_with_same_integers(qtype, bits, dense):
    """Types affine per 32 values keep their integers: only float16 rounding of scale/offset differs."""
    blocks = _blocks(qtype, dense)
    want = quants.dequantize(blocks, qtype).reshape(ROWS, COLS)
    arrays = tensor_to_mlx(blocks, qtype, (ROWS, COLS), "t")
    assert arrays["weight"].shape == (ROWS, COLS * bits // 32)
    assert arrays["scales"].shape == arrays["biases"].shape == (ROWS, COLS // 32)
    got = _dequant(arrays, bits)
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max()


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q6_K])
def test_other_k_quants_requantized_close(qtype, dense):
    """Types with 16-value sub-blocks are re-quantized with at least the source's bits; each value
    stays within about one quantization step of the group it falls in."""
    blocks = _blocks(qtype, dense)
    want = quants.dequantize(blocks, qtype).reshape(ROWS, COLS)
    arrays = tensor_to_mlx(blocks, qtype, (ROWS, COLS), "t")
    bits = REQUANT_BITS[qtype]
    assert bits >= {Q.Q2_K: 3, Q.Q3_K: 4, Q.Q6_K: 6}[qtype]
    assert arrays["weight"].shape == (ROWS, COLS * bits // 32)
    got = _dequant(arrays, bits)
    groups = want.reshape(ROWS, -1, 32)
    step = (groups.max(-1) - groups.min(-1)) / (2**bits - 1)
    err = np.abs(got - want).reshape(ROWS, -1, 32).max(-1)
    assert (err <= 1.2 * step + 1e-3 * np.abs(want).max()).all()
    rms = np.sqrt(((got - want) ** 2).mean()) / want.std()
    assert rms < {Q.Q2_K: 0.15, Q.Q3_K: 0.1, Q.Q6_K: 0.01}[qtype]


def test_unsupported_tensor_type_named():
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_up.weight.*TQ1_0"):
        tensor_to_mlx(np.zeros((4, 54), np.uint8), Q.TQ1_0, (4, 256), "blk.0.ffn_up.weight")


def test_permute_rows_for_rope_applies_to_every_array():
    """Quantized Q/K: weight, scales and biases rows move together."""
    rng = np.random.default_rng(0)
    heads, hd = 2, 8
    w = rng.standard_normal((heads * hd, 64)).astype(np.float32)
    q, s, b = mx.quantize(mx.array(w), group_size=32, bits=8)
    from gguf_factory import llama_cpp_permute, llama_cpp_unpermute

    perm = {k: mx.array(llama_cpp_permute(np.array(a), heads)) for k, a in (("weight", q), ("scales", s), ("biases", b))}
    back = permute_rows_for_rope(perm, heads)
    for key, a in (("weight", q), ("scales", s), ("biases", b)):
        assert mx.array_equal(back[key], a).item()
    bias = np.arange(heads * hd, dtype=np.float32)
    out = permute_rows_for_rope({"bias": mx.array(llama_cpp_permute(bias, heads))}, heads)
    np.testing.assert_array_equal(np.array(out["bias"]), bias)
    np.testing.assert_array_equal(llama_cpp_unpermute(llama_cpp_permute(w, heads), heads), w)
