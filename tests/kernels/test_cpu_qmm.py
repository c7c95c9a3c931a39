"""The CPU kernel (mlx_infer.kernels.cpu.cpu_qmm) against the float32 oracle: every bits / group size /
dtype, M = 1..16, odd N, the default model's shapes, strided x, mixed dtypes, bad operands.

Tolerance: the kernel and the oracle both dequantize in float32 and accumulate in float32, in different
orders, so an output may differ by a few float32 roundings of the terms' total size:
|y - ref| <= FLOAT32_TOL * (|x| @ |W|.T). float16 / bfloat16 outputs add one rounding of y to that type:
<= eps(dtype) * |ref| on top. On the bit widths the instruction set runs with int8 activations
(cpu.int8_bits(): 4 and 8 on avx512vnni, 4 on avx2int8; only when MLX_INFER_KERNEL_ISA asks for them) the kernel must equal numpy's int8 product
(int8_oracle) within that tolerance, and the float32 oracle within the rounding bound of x (int8_bound).
"""

import textwrap

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import int8_bound, int8_oracle, magnitude, ops_in_graph, oracle, quantized, run_in_variant

from mlx_infer.blas import cpu_flags
from mlx_infer.kernels import cpu
from mlx_infer.kernels.qmm import qmm

FLOAT32_TOL = 1e-5
EPS = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def assert_close(y, x, w, scales, biases, group_size, bits):
    ref = oracle(x, w, scales, biases, group_size, bits)
    size = magnitude(x, w, scales, biases, group_size, bits)
    bound = FLOAT32_TOL * size + EPS[y.dtype] * mx.abs(ref)
    if bits in cpu.int8_bits():
        exact = int8_oracle(x, w, scales, biases, group_size, bits)
        err = mx.abs(y.astype(mx.float32) - exact)
        worst = mx.max(err - bound).item()
        assert worst <= 0, f"int8 product: over the bound by {worst:.3g} (max error {mx.max(err).item():.3g})"
        bound = bound + int8_bound(x, w, scales, biases, group_size, bits)
    err = mx.abs(y.astype(mx.float32) - ref)
    worst = mx.max(err - bound).item()
    assert worst <= 0, f"max error over the bound by {worst:.3g} (max error {mx.max(err).item():.3g})"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
def test_every_row_count_matches_the_oracle(cpu_kernels, bits, group_size, dtype):
    n, k = 37, 256  # odd N: the last row block is partial
    w, scales, biases = quantized(n, k, group_size, bits, dtype, seed=bits * group_size)
    for m in range(1, 17):
        x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
        y = cpu_kernels.cpu_qmm(x, w, scales, biases, group_size, bits)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_close(y, x, w, scales, biases, group_size, bits)


@pytest.mark.parametrize("k", [32, 96, 160, 224])
@pytest.mark.parametrize("bits", [4, 8])
def test_contractions_that_end_in_a_partial_step(cpu_kernels, k, bits):
    """K of 1, 3, 5 and 7 chunks of 32: the int8 path's last step holds fewer chunks than its vectors (4 on
    AVX-512, 2 on AVX2), read through masked or narrower loads; each row also equals that row alone."""
    w, scales, biases = quantized(21, k, 32, bits, mx.float16, seed=k + bits)
    x = mx.random.normal((16, k), key=mx.random.key(k))
    alone = mx.concatenate([cpu_kernels.cpu_qmm(x[i:i + 1], w, scales, biases, 32, bits) for i in range(16)])
    for m in (1, 3, 9, 16):
        y = cpu_kernels.cpu_qmm(x[:m], w, scales, biases, 32, bits)
        assert_close(y, x[:m], w, scales, biases, 32, bits)
        assert mx.array_equal(y, alone[:m]).item(), m


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_the_row_count(cpu_kernels, bits):
    """Each row of an M-row product is bit-identical to that row computed alone, for M = 1..16 (the
    register paths for few rows, the wider fused path and the scratch path): a verify forward must
    reproduce plain decoding's logits exactly for speculative decoding to be lossless."""
    n, k = 37, 576
    w, scales, biases = quantized(n, k, 32, bits, mx.float16, seed=11 + bits)
    x = mx.random.normal((16, k), key=mx.random.key(5))
    alone = mx.concatenate([cpu_kernels.cpu_qmm(x[i:i + 1], w, scales, biases, 32, bits) for i in range(16)])
    for m in range(1, 17):
        y = cpu_kernels.cpu_qmm(x[:m], w, scales, biases, 32, bits)
        assert mx.array_equal(y, alone[:m]).item(), f"{m} rows differ from the rows computed alone"


@pytest.mark.parametrize("rows", [100, 90, 93])
def test_many_rows_pass_over_the_weight_in_parts(cpu_kernels, rows):
    """A short prompt's prefill: rows of K = 1536 run in passes of 42 rows (x's rows of a pass fit 256 KiB);
    every row matches the oracle and equals that row computed alone, bit for bit. The last pass holds 16,
    6 or 9 rows: the scratch path, or the register path for 5-11 rows, which reads its x blocked."""
    w, scales, biases = quantized(37, 1536, 32, 4, mx.float16, seed=21)
    x = mx.random.normal((rows, 1536), key=mx.random.key(8))
    y = cpu_kernels.cpu_qmm(x, w, scales, biases, 32, 4)
    assert_close(y, x, w, scales, biases, 32, 4)
    for i in (0, 41, 42, 83, 84, rows - 1):  # the first and last rows of each pass
        assert mx.array_equal(y[i:i + 1], cpu_kernels.cpu_qmm(x[i:i + 1], w, scales, biases, 32, 4)).item(), i


@pytest.mark.parametrize("k,n,bits", [(576, 576, 4), (576, 192, 4), (576, 1536, 4), (1536, 576, 4),
                                      (576, 49152, 8), (576, 49152, 4)])
def test_default_model_shapes(cpu_kernels, k, n, bits):
    w, scales, biases = quantized(n, k, 32, bits, mx.float16, seed=k + n)  # float16 scales, as the GGUF model
    for m in (1, 2, 5, 9, 16):
        x = mx.random.normal((m, k), key=mx.random.key(100 + m))
        y = cpu_kernels.cpu_qmm(x, w, scales, biases, 32, bits)
        assert y.dtype == mx.float32  # float32 x with float16 scales: float32, as mx.quantized_matmul
        assert_close(y, x, w, scales, biases, 32, bits)


def test_matches_mlx_quantized_matmul(cpu_kernels):
    """Against MLX's own op (the model's reference path) as well as the float32 oracle."""
    w, scales, biases = quantized(301, 576, 32, 4, mx.float32, seed=7)
    x = mx.random.normal((9, 576), key=mx.random.key(3))
    y = cpu_kernels.cpu_qmm(x, w, scales, biases, 32, 4)
    ref = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=32, bits=4)
    bound = FLOAT32_TOL * magnitude(x, w, scales, biases, 32, 4)
    if 4 in cpu.int8_bits():
        bound = bound + int8_bound(x, w, scales, biases, 32, 4)
    assert mx.all(mx.abs(y - ref) <= bound).item()


def test_strided_and_broadcast_x(cpu_kernels):
    w, scales, biases = quantized(64, 128, 32, 4, mx.float32, seed=1)
    base = mx.random.normal((128, 6), key=mx.random.key(2))
    x = base.T  # [6, 128], column-major view
    y = cpu_kernels.cpu_qmm(x, w, scales, biases, 32, 4)
    assert_close(y, x, w, scales, biases, 32, 4)
    row = mx.random.normal((1, 128), key=mx.random.key(4))
    xb = mx.broadcast_to(row, (3, 128))  # stride 0 over rows
    yb = cpu_kernels.cpu_qmm(xb, w, scales, biases, 32, 4)
    assert_close(yb, xb, w, scales, biases, 32, 4)
    assert mx.array_equal(yb[0], yb[2]).item()


def test_leading_axes_are_rows(cpu_kernels):
    """x [B, L, K], contiguous or a transposed view, gives [B, L, N]: each row exactly the 2-D product's."""
    w, scales, biases = quantized(64, 128, 32, 4, mx.float32, seed=3)
    x = mx.random.normal((2, 3, 128), key=mx.random.key(8))
    flat = cpu_kernels.cpu_qmm(x.reshape(6, 128), w, scales, biases, 32, 4)
    for view, rows in ((x, flat.reshape(2, 3, 64)), (x.transpose(1, 0, 2), flat.reshape(2, 3, 64).transpose(1, 0, 2))):
        y = cpu_kernels.cpu_qmm(view, w, scales, biases, 32, 4)
        assert y.shape == (*view.shape[:-1], 64)
        assert mx.array_equal(y, rows).item()


def test_sliced_weight_rows(cpu_kernels):
    """A lazy slice of the weight rows (a fused layer's view, an RMM layer's rows) is made contiguous first."""
    w, scales, biases = quantized(100, 128, 64, 8, mx.float32, seed=5)
    x = mx.random.normal((4, 128), key=mx.random.key(6))
    y = cpu_kernels.cpu_qmm(x, w[10:50], scales[10:50], biases[10:50], 64, 8)
    assert_close(y, x, w[10:50], scales[10:50], biases[10:50], 64, 8)


def test_bad_operands_are_refused(cpu_kernels):
    w, scales, biases = quantized(16, 64, 32, 4)
    x = mx.zeros((2, 64))
    with pytest.raises(ValueError, match="bits"):
        cpu_kernels.cpu_qmm(x, w, scales, biases, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        cpu_kernels.cpu_qmm(x, w, scales, biases, 16, 4)
    with pytest.raises(ValueError, match="x must be"):
        cpu_kernels.cpu_qmm(mx.zeros((2, 32)), w, scales, biases, 32, 4)
    with pytest.raises(ValueError, match="scales"):
        cpu_kernels.cpu_qmm(x, w, scales[:, :1], biases, 32, 4)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        cpu_kernels.cpu_qmm(x.astype(mx.int32), w, scales, biases, 32, 4)


def test_instruction_set_and_threads(cpu_kernels):
    flags = cpu_flags()
    expected = ("avx512" if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags
                else "avx2" if {"avx2", "fma"} <= flags else None)
    if expected:
        assert cpu_kernels.isa() == expected
    assert cpu_kernels.int8_bits() == ()  # the int8 products run only when asked for
    assert cpu_kernels.num_threads() >= 1


#: Run in a fresh process with MLX_INFER_KERNEL_ISA set (the variant is chosen once per process): every
#: bits / group size / dtype and rows 1..16 against the float32 oracle, with the bound of assert_close;
#: then each row of 1..16-row products, and of a 300-row product through qmm (a prefill's, in passes), bit-identical
#: to the row alone.
VARIANT_CHECK = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    from mlx_infer.kernels import cpu
    from mlx_infer.kernels.qmm import qmm
    sys.path.insert(0, sys.argv[1])
    from qmm_helpers import int8_bound, magnitude, oracle, quantized, run_in_variant
    assert cpu.isa() == sys.argv[2], cpu.isa()
    eps = {mx.float32: 0.0, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}
    worst = -1.0
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for dt in (mx.float32, mx.float16, mx.bfloat16):
                w, s, b = quantized(37, 256, gs, bits, dt, seed=gs + bits)
                for m in range(1, 17):
                    x = mx.random.normal((m, 256), key=mx.random.key(m)).astype(dt)
                    y = cpu.cpu_qmm(x, w, s, b, gs, bits)
                    ref = oracle(x, w, s, b, gs, bits)
                    bound = 1e-5 * magnitude(x, w, s, b, gs, bits) + eps[dt] * mx.abs(ref)
                    if bits in cpu.int8_bits():
                        bound = bound + int8_bound(x, w, s, b, gs, bits)
                    worst = max(worst, mx.max(mx.abs(y.astype(mx.float32) - ref) - bound).item())
    print(worst)
    assert worst <= 0, worst
    w, s, b = quantized(37, 576, 32, 4, mx.float16, seed=3)
    x = mx.random.normal((16, 576), key=mx.random.key(5))
    alone = mx.concatenate([cpu.cpu_qmm(x[i:i + 1], w, s, b, 32, 4) for i in range(16)])
    for m in range(1, 17):
        assert mx.array_equal(cpu.cpu_qmm(x[:m], w, s, b, 32, 4), alone[:m]).item(), m
    x = mx.random.normal((300, 576), key=mx.random.key(7))  # qmm sends every row count to the kernel
    wide = qmm(x, w, s, b, 32, 4)
    for i in (0, 100, 299):  # a prefill's rows equal decoding's
        assert mx.array_equal(wide[i:i + 1], qmm(x[i:i + 1], w, s, b, 32, 4)).item(), i
""")


#: In a fresh process with MLX_INFER_KERNEL_ISA naming no variant: the kernels pick what they pick unasked
#: (BEST, this process's variant), with one warning.
UNKNOWN_ISA = textwrap.dedent("""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import mlx_infer
        from mlx_infer.kernels import cpu
        isa = cpu.isa()
    assert isa == "BEST", isa
    assert [str(w.message).split(" names")[0] for w in caught if "names no kernel variant" in str(w.message)] == \
        ["MLX_INFER_KERNEL_ISA=VALUE"], [str(w.message) for w in caught]
""")


@pytest.mark.parametrize("value", ["bogus", "avx512_vnni"])
def test_unknown_instruction_set_runs_the_best_one(cpu_kernels, value, tmp_path):
    run_in_variant(UNKNOWN_ISA.replace("BEST", cpu_kernels.isa()).replace("VALUE", value), value, tmp_path)


def test_instruction_set_names_ignore_case(cpu_kernels, tmp_path):
    if "avx512_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI")
    script = "import mlx_infer\nfrom mlx_infer.kernels import cpu\nassert cpu.isa() == 'avx512vnni', cpu.isa()\n"
    run_in_variant(script, "AVX512VNNI", tmp_path)


@pytest.mark.parametrize("variant", ["avx512vnni", "avx2int8", "avx512", "avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    """The int8-activation variants (against numpy's int8 product's bound), the AVX-512, AVX2 and portable
    variants (which this machine may not pick) against the oracle; rows independent of the row count."""
    run_in_variant(VARIANT_CHECK, variant, tmp_path)


@pytest.mark.parametrize("rows", [1, 3, 9, 40, 300])
def test_residual_is_added_in_the_product(cpu_kernels, rows):
    """qmm(..., residual=r) equals r + qmm(...) bit for bit, as one operation at every row count, and a
    residual of the wrong shape or dtype is refused."""
    w, scales, biases = quantized(160, 96, 32, 4, dtype=mx.float16)
    x = mx.random.normal((1, rows, 96), key=mx.random.key(2))
    r = mx.random.normal((1, rows, 160), key=mx.random.key(3))
    strided = mx.random.normal((1, 160, rows), key=mx.random.key(4)).transpose(0, 2, 1)  # not row-contiguous
    mx.eval(x, r, strided)
    for res in (r, strided):
        got = qmm(x, w, scales, biases, 32, 4, residual=res)
        assert mx.array_equal(got, res + qmm(x, w, scales, biases, 32, 4)).item()
    assert ops_in_graph(qmm(x, w, scales, biases, 32, 4, residual=r)) == ["MlxInferQmm"]
    with pytest.raises(ValueError, match="residual"):
        cpu.cpu_qmm(x, w, scales, biases, 32, 4, r[..., :80])
    with pytest.raises(ValueError, match="residual .* float16"):
        cpu.cpu_qmm(x, w, scales, biases, 32, 4, r.astype(mx.float16))
