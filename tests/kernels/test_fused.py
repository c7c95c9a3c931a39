"""FusedLinear (kernels/fused.py): projections of one input as one product give each layer's own output bit
for bit, keep no weight twice (the layers' arrays become views of the fused memory), and step aside once a
layer is swapped (RMM) or given other arrays; use_kernels fuses the default model's q / k / v and gate / up."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlx_infer
from mlx_infer.kernels.fused import FusedLinear, fusable
from mlx_infer.kernels.linear import KernelQuantizedLinear, fuse_projections, use_kernels
from mlx_infer.rmm.apply import reduce_model
from mlx_infer.rmm.options import parse_rmm
from test_linear import tiny_llama


def quantized(n_in: int, n_out: int, bits: int = 4, group_size: int = 32, bias: bool = False, seed: int = 0):
    layer = nn.QuantizedLinear(n_in, n_out, bias=bias, group_size=group_size, bits=bits)
    w = mx.random.normal((n_out, n_in), key=mx.random.key(seed))
    layer.weight, layer.scales, layer.biases = mx.quantize(w, group_size=group_size, bits=bits)
    if bias:
        layer.bias = mx.random.normal((n_out,), key=mx.random.key(seed + 100))
    mx.eval(layer.parameters())
    return KernelQuantizedLinear(layer)


def address(a: mx.array) -> int:
    """Where a's first element is in memory (its buffer's address plus its offset)."""
    return np.asarray(a).__array_interface__["data"][0]


@pytest.mark.parametrize("bits,group_size,bias", [(4, 32, False), (4, 64, True), (8, 128, False)])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_outputs_bit_identical_to_each_layer(cpu_kernels, bits, group_size, bias, rows):
    layers = [quantized(256, n, bits, group_size, bias, seed) for seed, n in enumerate((128, 64, 64))]
    x = mx.random.normal((2, rows, 256), key=mx.random.key(9))
    want = [layer(x) for layer in layers]  # each layer's own product, before fusing
    mx.eval(want)
    fused = FusedLinear(layers)
    got = fused(x)
    assert [g.shape for g in got] == [(2, rows, 128), (2, rows, 64), (2, rows, 64)]
    for g, w, layer in zip(got, want, layers):
        assert mx.array_equal(g, w).item()
        assert mx.array_equal(layer(x), w).item()  # the layer alone, on its views


def test_layers_hold_views_of_the_fused_memory(cpu_kernels):
    layers = [quantized(128, n, seed=n) for n in (96, 32, 32)]
    before = [{k: np.array(layer[k]) for k in ("weight", "scales", "biases")} for layer in layers]
    fused = FusedLinear(layers)
    row = 0
    for layer, values in zip(layers, before):
        for k, v in values.items():
            assert np.array_equal(np.asarray(layer[k]), v)  # the same values
            big = fused.arrays[k]
            assert address(layer[k]) == address(big) + row * big.shape[1] * big.itemsize  # in the fused rows
        row += layer["scales"].shape[0]
    assert row == fused.arrays["weight"].shape[0]
    assert fused.covers(*layers)


def test_fusable_refuses_mixed_layers():
    assert fusable([quantized(64, 32), quantized(64, 16)])
    assert not fusable([quantized(64, 32)])  # one layer: nothing to fuse
    assert not fusable([quantized(64, 32, bits=4), quantized(64, 32, bits=8)])
    assert not fusable([quantized(64, 32, group_size=32), quantized(64, 32, group_size=64)])
    assert not fusable([quantized(64, 32, bias=True), quantized(64, 32)])
    assert not fusable([quantized(64, 32), quantized(128, 32)])  # another input size
    assert not fusable([quantized(64, 32), nn.Linear(64, 32)])
    with pytest.raises(ValueError, match="FusedLinear"):
        FusedLinear([quantized(64, 32, bits=4), quantized(64, 32, bits=8)])
    assert fuse_projections(quantized(64, 32), nn.Linear(64, 32)) is None


def test_covers_only_the_fused_layers_and_arrays():
    layers = [quantized(64, 32, seed=1), quantized(64, 16, seed=2)]
    fused = FusedLinear(layers)
    assert fused.covers(*layers)
    assert not fused.covers(layers[1], layers[0])
    assert not fused.covers(layers[0], quantized(64, 16, seed=2))
    layers[1].weight = mx.array(layers[1]["weight"])  # other arrays with the same values
    assert not fused.covers(*layers)


def test_use_kernels_fuses_and_the_model_is_unchanged(cpu_kernels):
    """A tiny quantized llama: every attention's q / k / v and every MLP's gate / up fused, the parameters'
    bytes and every logit unchanged against the same model on the kernels with the fused products taken
    out; after RMM swaps the projections, the blocks run those (the fused product no longer covers them),
    as that model reduced the same way."""
    model, plain = tiny_llama(4, 32), tiny_llama(4, 32)
    size = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    use_kernels(model)
    use_kernels(plain)
    for layer in plain.layers:  # each projection its own product
        layer.self_attn.qkv = layer.mlp.gate_up = None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.qkv.covers(attn.q_proj, attn.k_proj, attn.v_proj)
        assert mlp.gate_up.covers(mlp.gate_proj, mlp.up_proj)
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == size
    ids = mx.array([[5, 17, 250, 3, 99, 42, 7, 1, 0, 311]])
    for n in (1, 3, 10):
        assert mx.array_equal(model(ids[:, :n]), plain(ids[:, :n])).item()

    retention = parse_rmm("attn=0.5,mlp=0.5")
    assert reduce_model(model, retention) == reduce_model(plain, retention) == 2 * 7
    assert not model.layers[0].self_attn.qkv.covers(*(model.layers[0].self_attn[k] for k in ("q_proj", "k_proj", "v_proj")))
    for n in (1, 10):
        assert mx.array_equal(model(ids[:, :n]), plain(ids[:, :n])).item()


def test_default_model_runs_fused(cpu_kernels):
    engine = mlx_infer.load(weights="native")
    layers = engine.model.model.layers
    assert len(layers) == 30
    assert all(layer.self_attn.qkv is not None and layer.mlp.gate_up is not None for layer in layers)
    assert layers[0].self_attn.qkv.arrays["weight"].shape[0] == 576 + 192 + 192
    assert layers[0].mlp.gate_up.arrays["weight"].shape[0] == 2 * 1536
