"""SwiGLU's gate on the CPU kernel (cpu_kernels/swiglu.cpp; kernels/swiglu.py) against a float64 NumPy
oracle: the tail of a row that is not a whole vector, strided inputs, large |gate|, every instruction-set
variant; one operation in the graph; its gradient; float16 and mismatched inputs fall back to mlx-lm's
swiglu or are refused; use_kernels swaps mlx-lm's SwiGLU MLPs."""

import textwrap

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu
from qmm_helpers import ops_in_graph, run_in_variant

from mlx_infer.kernels.linear import use_kernels
from mlx_infer.kernels.swiglu import KernelGatedMLP, swiglu

#: |y - oracle| <= ULPS * eps(float32) * |oracle| + FLOOR: e^x within 2 ulp, then an add, a division and
#: two products rounded once each; FLOOR covers gates below -87, where e^-gate leaves float32's range.
ULPS = 8
FLOOR = 1e-30


def oracle(gate: mx.array, up: mx.array) -> np.ndarray:
    g, u = np.array(gate).astype(np.float64), np.array(up).astype(np.float64)
    return g / (1.0 + np.exp(-g)) * u


def assert_close(got: mx.array, gate: mx.array, up: mx.array) -> None:
    want = oracle(gate, up)
    err = np.abs(np.array(got).astype(np.float64) - want)
    bound = ULPS * 2.0 ** -23 * np.abs(want) + FLOOR
    assert (err <= bound).all(), f"worst excess {np.max(err - bound):.3g}"


def test_equals_the_oracle(cpu_kernels):
    rng = np.random.default_rng(0)
    for shape in [(1, 1, 1536), (1, 9, 1536), (3, 7, 33), (5,)]:  # 33 and 5: a partial last vector
        gate = mx.array((rng.standard_normal(shape) * 6).astype(np.float32))
        up = mx.array(rng.standard_normal(shape).astype(np.float32))
        got = swiglu(gate, up)
        assert got.shape == shape and got.dtype == mx.float32
        assert_close(got, gate, up)


def test_large_gates_and_strided_inputs(cpu_kernels):
    gate = mx.array(np.linspace(-120, 120, 960, dtype=np.float32).reshape(24, 40))
    up = mx.array(np.linspace(-2, 3, 960, dtype=np.float32).reshape(40, 24))
    got = swiglu(gate.T, up)  # a transposed (strided) gate
    assert_close(got, gate.T, up)
    assert mx.all(mx.isfinite(got)).item()


def test_one_operation_and_fallbacks(cpu_kernels):
    gate, up = mx.random.normal((2, 64)), mx.random.normal((2, 64))
    mx.eval(gate, up)
    assert ops_in_graph(swiglu(gate, up)) == ["MlxInferSwiGlu"]
    half = swiglu(gate.astype(mx.float16), up.astype(mx.float16))  # mlx-lm's, as before
    assert mx.array_equal(half, mlx_lm_swiglu(gate.astype(mx.float16), up.astype(mx.float16))).item()
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.cpu_swiglu(gate.astype(mx.float16), up)
    with pytest.raises(ValueError, match="one shape"):
        cpu_kernels.cpu_swiglu(gate, up[:1])


def test_gradient_equals_mlx_lm_swiglus(cpu_kernels):
    """The operation's vjp (drafter training differentiates through it) against mlx-lm's swiglu's."""
    gate = mx.random.normal((3, 40), key=mx.random.key(2)) * 3
    up = mx.random.normal((3, 40), key=mx.random.key(3))
    weight = mx.random.normal((3, 40), key=mx.random.key(4))
    got = mx.grad(lambda g, u: (swiglu(g, u) * weight).sum(), argnums=(0, 1))(gate, up)
    want = mx.grad(lambda g, u: (mlx_lm_swiglu(g, u) * weight).sum(), argnums=(0, 1))(gate, up)
    for g, w in zip(got, want):
        assert mx.allclose(g, w, rtol=1e-5, atol=1e-6).item()
    only_up = mx.grad(lambda u: (swiglu(gate, u) * weight).sum())(up)
    assert mx.allclose(only_up, want[1], rtol=1e-5, atol=1e-6).item()


def test_use_kernels_swaps_swiglu_mlps(cpu_kernels):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=100)
    mx.random.seed(1)
    model = llama.Model(args)
    ids = mx.array([[3, 14, 15, 92, 65]])
    ref = model(ids)
    mlp_weight = model.model.layers[0].mlp.gate_proj.weight
    assert use_kernels(model) == 2 + 2 * 4 + 1  # an MLP, 2 norms, a RoPE, an attention per layer; the final norm
    assert all(isinstance(layer.mlp, KernelGatedMLP) for layer in model.model.layers)
    assert model.model.layers[0].mlp.gate_proj.weight is mlp_weight  # the same arrays
    assert "model.layers.0.mlp.gate_proj.weight" in dict(nn.utils.tree_flatten(model.parameters()))
    got = model(ids)
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-5).item()
    with pytest.raises(ValueError, match="SwiGLU / GeGLU"):
        KernelGatedMLP(nn.Linear(2, 2))


#: In a fresh process with MLX_INFER_KERNEL_ISA set: the bounds of assert_close here and in
#: test_cpu_geglu.py (SwiGLU's and GeGLU's gates) on a row with a partial last vector and gates up to |120|.
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
