"""GeGLU's gate, gelu_approx(gate) * up, on the CPU kernel (cpu_kernels/swiglu.cpp; kernels/swiglu.py)
against a float64 NumPy oracle: partial vectors, strided inputs, gates up to |120| (every instruction-set
variant: test_cpu_swiglu.py's VARIANT_CHECK); one operation in the graph; its gradient against mlx's; float16 falls back to mlx's gelu_approx;
use_kernels swaps a Gemma-3 MLP (gate / up fused) with the logits unchanged but for rounding."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gemma3_text
from qmm_helpers import ops_in_graph

from mlx_infer.kernels.linear import use_kernels
from mlx_infer.kernels.swiglu import KernelGatedMLP, geglu

#: |y - oracle| <= ULPS * eps(float32) * |oracle| * (1 + |a|) + FLOOR, a = 2 sqrt(2 / pi) (g + 0.044715 g^3)
#: the sigmoid's argument: rounding a to float32 moves e^-a by up to |a| eps relative (measured: 1.17 at
#: most over 100,003 gates in [-120, 120]; mlx's own 0.5 g (1 + tanh(a / 2)) cancels for negative gates and
#: is off by up to 4e5 of these units there).
ULPS = 4
FLOOR = 1e-30


def oracle(gate, up) -> tuple:
    """(gelu_approx(gate) * up in float64, the sigmoid's argument a), as g * u / (1 + e^-a): the same function
    as 0.5 g (1 + tanh(a / 2)) without its cancellation."""
    g, u = np.array(gate).astype(np.float64), np.array(up).astype(np.float64)
    a = 2.0 * np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)
    with np.errstate(over="ignore"):
        return g * u / (1.0 + np.exp(-a)), a


def assert_close(got: mx.array, gate, up) -> None:
    want, a = oracle(gate, up)
    err = np.abs(np.array(got).astype(np.float64) - want)
    bound = ULPS * 2.0 ** -23 * np.abs(want) * (1.0 + np.abs(a)) + FLOOR
    assert (err <= bound).all(), f"worst excess {np.max(err - bound):.3g}"


def test_equals_the_oracle(cpu_kernels):
    rng = np.random.default_rng(0)
    for shape in [(1, 1, 2048), (1, 9, 2048), (3, 7, 33), (5,)]:  # 33 and 5: a partial last vector
        gate = mx.array((rng.standard_normal(shape) * 4).astype(np.float32))
        up = mx.array(rng.standard_normal(shape).astype(np.float32))
        got = geglu(gate, up)
        assert got.shape == shape and got.dtype == mx.float32
        assert_close(got, gate, up)
        # and mlx's own float32 gelu_approx where it does not cancel (gates above -3)
        keep = np.array(gate) > -3
        ref = np.array(nn.gelu_approx(gate) * up)
        assert np.allclose(np.array(got)[keep], ref[keep], rtol=1e-5, atol=1e-6)


def test_large_gates_and_strided_inputs(cpu_kernels):
    gate = mx.array(np.linspace(-120, 120, 960, dtype=np.float32).reshape(24, 40))
    up = mx.array(np.linspace(-2, 3, 960, dtype=np.float32).reshape(40, 24))
    got = geglu(gate.T, up)  # a transposed (strided) gate
    assert_close(got, gate.T, up)
    assert mx.all(mx.isfinite(got)).item()


def test_one_operation_and_fallbacks(cpu_kernels):
    gate, up = mx.random.normal((2, 64)), mx.random.normal((2, 64))
    mx.eval(gate, up)
    assert ops_in_graph(geglu(gate, up)) == ["MlxInferGeGlu"]
    half = geglu(gate.astype(mx.float16), up.astype(mx.float16))  # mlx's, as before
    assert mx.array_equal(half, nn.gelu_approx(gate.astype(mx.float16)) * up.astype(mx.float16)).item()
    with pytest.raises(ValueError, match=r"\[geglu\].*float32"):
        cpu_kernels.cpu_geglu(gate.astype(mx.float16), up)
    with pytest.raises(ValueError, match="one shape"):
        cpu_kernels.cpu_geglu(gate, up[:1])


def test_gradient_equals_mlx_gelu_approx(cpu_kernels):
    gate = mx.random.normal((3, 40), key=mx.random.key(2)) * 2
    up = mx.random.normal((3, 40), key=mx.random.key(3))
    weight = mx.random.normal((3, 40), key=mx.random.key(4))
    got = mx.grad(lambda g, u: (geglu(g, u) * weight).sum(), argnums=(0, 1))(gate, up)
    want = mx.grad(lambda g, u: (nn.gelu_approx(g) * u * weight).sum(), argnums=(0, 1))(gate, up)
    for g, w in zip(got, want):
        assert mx.allclose(g, w, rtol=1e-4, atol=1e-5).item()


def tiny_gemma3(quantized: bool) -> nn.Module:
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2,
                                 intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                 vocab_size=100, sliding_window=16, sliding_window_pattern=2)
    mx.random.seed(5)
    model = gemma3_text.Model(args)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("quantized", [False, True])
def test_use_kernels_swaps_gemma3_mlps(cpu_kernels, quantized):
    model = tiny_gemma3(quantized)
    ids = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    ref = model(ids)
    use_kernels(model)
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(mlp, KernelGatedMLP) for mlp in mlps)
    assert all((mlp.gate_up is not None) == quantized for mlp in mlps)  # fused where the kernels run them
    got = model(ids)
    assert mx.allclose(got, ref, rtol=1e-4, atol=1e-4 * mx.max(mx.abs(ref)).item()).item()
    assert mx.array_equal(got.argmax(-1), ref.argmax(-1)).item()
    with pytest.raises(ValueError, match="SwiGLU / GeGLU"):
        KernelGatedMLP(nn.Linear(2, 2))
