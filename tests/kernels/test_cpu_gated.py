"""SwiGLU's gate, silu(gate) * up, and GeGLU's, gelu_approx(gate) * up, on the CPU kernel
(cpu_kernels/swiglu.cpp; kernels/swiglu.py) against a float64 NumPy oracle: the tail of a row that is not a
whole vector, strided inputs, large |gate|, every instruction-set variant; one operation in the graph; its
gradient; float16 and mismatched inputs fall back to mlx-lm's / mlx's functions or are refused; use_kernels
swaps mlx-lm's SwiGLU (llama) and GeGLU (Gemma-3) MLPs, gate / up fused where quantized."""

import math
import textwrap
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from qmm_helpers import ops_in_graph, run_in_variant

from mlx_infer.kernels.linear import use_kernels
from mlx_infer.kernels.swiglu import KernelGatedMLP, gated_packed, geglu, swiglu

#: |y - oracle| <= ulps * eps(float32) * |oracle| (* (1 + |a|) for GeGLU) + FLOOR, a the sigmoid's argument.
#: FLOOR covers arguments below -87, where e^-a leaves float32's range.
FLOOR = 1e-30


@dataclass(frozen=True)
class Gate:
    name: str  # the kernel operation's name in errors ("[swiglu] ...")
    fn: Callable  # kernels/swiglu.py's function
    reference: Callable  # what runs without the kernel (float16)
    op: str  # the graph operation
    width: int  # a row of the model it serves (the default model's 1536, Gemma-3-270M's 2048)
    spread: float  # the random gates' standard deviation
    ulps: float
    grad_tol: tuple  # (rtol, atol) of the gradient against the reference's

    def argument(self, g: np.ndarray) -> np.ndarray:
        """The sigmoid's argument a (float64): y = g * u / (1 + e^-a)."""
        return g if self.name == "swiglu" else 2.0 * math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)


#: SwiGLU: e^x within 2 ulp, then an add, a division and two products rounded once each: 8 ulp.
#: GeGLU: as SwiGLU, and rounding a to float32 moves e^-a by up to |a| eps relative: 4 (1 + |a|) ulp
#: (measured: 1.17 at most over 100,003 gates in [-120, 120]; mlx's own 0.5 g (1 + tanh(a / 2)) cancels for
#: negative gates and is off by up to 4e5 of these units there).
GATES = [Gate("swiglu", swiglu, mlx_lm_swiglu, "MlxInferSwiGlu", 1536, 6.0, 8, (1e-5, 1e-6)),
         Gate("geglu", geglu, lambda g, u: nn.gelu_approx(g) * u, "MlxInferGeGlu", 2048, 4.0, 4, (1e-4, 1e-5))]


def assert_close(gate: Gate, got: mx.array, g: mx.array, u: mx.array) -> None:
    g64, u64 = np.array(g).astype(np.float64), np.array(u).astype(np.float64)
    a = gate.argument(g64)
    with np.errstate(over="ignore"):
        want = g64 * u64 / (1.0 + np.exp(-a))  # (GeGLU: 0.5 g (1 + tanh(a / 2)) without its cancellation)
    err = np.abs(np.array(got).astype(np.float64) - want)
    bound = gate.ulps * 2.0 ** -23 * np.abs(want) * (1.0 if gate.name == "swiglu" else 1.0 + np.abs(a)) + FLOOR
    assert (err <= bound).all(), f"worst excess {np.max(err - bound):.3g}"


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
def test_equals_the_oracle(cpu_kernels, gate):
    rng = np.random.default_rng(0)
    for shape in [(1, 1, gate.width), (1, 9, gate.width), (3, 7, 33), (5,)]:  # 33 and 5: a partial last vector
        g = mx.array((rng.standard_normal(shape) * gate.spread).astype(np.float32))
        u = mx.array(rng.standard_normal(shape).astype(np.float32))
        got = gate.fn(g, u)
        assert got.shape == shape and got.dtype == mx.float32
        assert_close(gate, got, g, u)
        # and the float32 reference where it does not cancel (gates above -3)
        keep = np.array(g) > -3
        assert np.allclose(np.array(got)[keep], np.array(gate.reference(g, u))[keep], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
def test_large_gates_and_strided_inputs(cpu_kernels, gate):
    g = mx.array(np.linspace(-120, 120, 960, dtype=np.float32).reshape(24, 40))
    u = mx.array(np.linspace(-2, 3, 960, dtype=np.float32).reshape(40, 24))
    got = gate.fn(g.T, u)  # a transposed (strided) gate
    assert_close(gate, got, g.T, u)
    assert mx.all(mx.isfinite(got)).item()


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
def test_one_operation_and_fallbacks(cpu_kernels, gate):
    g, u = mx.random.normal((2, 64)), mx.random.normal((2, 64))
    mx.eval(g, u)
    assert ops_in_graph(gate.fn(g, u)) == [gate.op]
    half = gate.fn(g.astype(mx.float16), u.astype(mx.float16))  # the reference, as before
    assert mx.array_equal(half, gate.reference(g.astype(mx.float16), u.astype(mx.float16))).item()
    kernel = getattr(cpu_kernels, f"cpu_{gate.name}")
    with pytest.raises(ValueError, match=rf"\[{gate.name}\].*float32"):
        kernel(g.astype(mx.float16), u)
    with pytest.raises(ValueError, match="one shape"):
        kernel(g, u[:1])


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
def test_gradient_equals_the_references(cpu_kernels, gate):
    """The operation's vjp (drafter training differentiates through it) against the reference's."""
    g = mx.random.normal((3, 40), key=mx.random.key(2)) * (3 if gate.name == "swiglu" else 2)
    u = mx.random.normal((3, 40), key=mx.random.key(3))
    weight = mx.random.normal((3, 40), key=mx.random.key(4))
    rtol, atol = gate.grad_tol
    got = mx.grad(lambda a, b: (gate.fn(a, b) * weight).sum(), argnums=(0, 1))(g, u)
    want = mx.grad(lambda a, b: (gate.reference(a, b) * weight).sum(), argnums=(0, 1))(g, u)
    for x, w in zip(got, want):
        assert mx.allclose(x, w, rtol=rtol, atol=atol).item()
    only_up = mx.grad(lambda b: (gate.fn(g, b) * weight).sum())(u)
    assert mx.allclose(only_up, want[1], rtol=rtol, atol=atol).item()


@pytest.mark.parametrize("gate", GATES, ids=lambda g: g.name)
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_packed_gate_up_equals_the_two_halves(cpu_kernels, gate, rows):
    """gated_packed of one fused gate / up product [..., 2F] equals the gate of its two halves bit for bit,
    as one operation (strided input too), and its gradient is the halves' gradients side by side."""
    gu = mx.random.normal((rows, 2 * gate.width), key=mx.random.key(6)) * gate.spread
    mx.eval(gu)
    g, u = mx.split(gu, 2, axis=-1)
    got = gated_packed(gu, gate.name)
    assert ops_in_graph(got) == [gate.op]
    assert mx.array_equal(got, gate.fn(g, u)).item()
    strided = mx.concatenate([g.T, u.T]).T  # [rows, 2F], not row-contiguous
    assert mx.array_equal(gated_packed(strided, gate.name), gate.fn(g, u)).item()
    weight = mx.random.normal((rows, gate.width), key=mx.random.key(7))
    got = mx.grad(lambda a: (gated_packed(a, gate.name) * weight).sum())(gu)
    want = mx.grad(lambda a, b: (gate.fn(a, b) * weight).sum(), argnums=(0, 1))(g, u)
    assert mx.array_equal(got, mx.concatenate(want, axis=-1)).item()
    half = gated_packed(gu.astype(mx.float16), gate.name)  # the split and the reference
    assert half.dtype == mx.float16 and half.shape == (rows, gate.width)
    with pytest.raises(ValueError, match="2F"):
        cpu_kernels.cpu_swiglu_packed(gu[:, :-1])
    with pytest.raises(ValueError, match="kind"):
        gated_packed(gu, "relu")


def test_use_kernels_swaps_swiglu_mlps(cpu_kernels):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    mx.random.seed(1)
    model = llama.Model(args)
    ids = mx.array([[3, 14, 15, 92, 65]])
    ref = model(ids)
    mlp_weight = model.model.layers[0].mlp.gate_proj.weight
    assert use_kernels(model) == 2 + 2 * 5 + 1  # an MLP, 2 norms, a RoPE, an attention, the block per layer; the final norm
    assert all(isinstance(layer.mlp, KernelGatedMLP) for layer in model.model.layers)
    assert model.model.layers[0].mlp.gate_proj.weight is mlp_weight  # the same arrays
    assert "model.layers.0.mlp.gate_proj.weight" in dict(nn.utils.tree_flatten(model.parameters()))
    got = model(ids)
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-5).item()
    with pytest.raises(ValueError, match="SwiGLU / GeGLU"):
        KernelGatedMLP(nn.Linear(2, 2))


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


#: In a fresh process with MLX_INFER_KERNEL_ISA set: assert_close's bounds for both gates on a row with a
#: partial last vector and gates up to |120|.
VARIANT_CHECK = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    import numpy as np
    from mlx_infer.kernels import cpu
    assert cpu.isa() == sys.argv[2], cpu.isa()
    g = np.linspace(-120, 120, 1539, dtype=np.float32)
    u = np.cos(np.arange(1539, dtype=np.float32))
    g64 = g.astype(np.float64)
    y = np.array(cpu.cpu_swiglu(mx.array(g), mx.array(u))).astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * u
    excess = np.abs(y - want) - (8 * 2.0 ** -23 * np.abs(want) + 1e-30)
    assert (excess <= 0).all(), ("swiglu", excess.max())
    y = np.array(cpu.cpu_geglu(mx.array(g), mx.array(u))).astype(np.float64)
    a = 2.0 * np.sqrt(2.0 / np.pi) * (g64 + 0.044715 * g64 ** 3)
    with np.errstate(over="ignore"):
        want = g64 * u / (1.0 + np.exp(-a))
    excess = np.abs(y - want) - (4 * 2.0 ** -23 * np.abs(want) * (1 + np.abs(a)) + 1e-30)
    assert (excess <= 0).all(), ("geglu", excess.max())
""")


@pytest.mark.parametrize("variant", ["avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    run_in_variant(VARIANT_CHECK, variant, tmp_path)
