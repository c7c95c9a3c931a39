"""Quantized projections of one input run as one product: attention's q / k / v, an MLP's gate / up.

    qkv = FusedLinear([q_proj, k_proj, v_proj])   # quantized layers of one K, bits, group size and dtypes
    q, k, v = qkv(x)                               # x [..., K] -> [..., N_q], [..., N_k], [..., N_v]

Every `qmm` call costs a few microseconds besides its weight bytes (MLX's scheduling, the kernel's thread
pool, the ramp of the weight stream's prefetch): on the default model's shapes (K = 576, 4 bits, one row, the
Zen 4 CPU kernels) a 192-row product (k, v) took 12.5 us, the 576-row q 14.4 us, the three together as one
960-row product 21.1 us. The layers' weight rows are concatenated once; each layer's arrays then become row
slices of the fused arrays (views of the same memory: nothing is kept twice), so a layer still runs alone
with the very same arrays (RMM's swapped layers, the reference path). Each output column is the same sum in
the same order as in the layer's own product, so the outputs are bit-identical to the layers'.
"""

from typing import List, Sequence

import mlx.core as mx
import mlx.nn as nn

from .qmm import qmm

__all__ = ["FusedLinear", "fusable"]


def _keys(layer: nn.Module) -> tuple:
    return ("weight", "scales", "biases") + (("bias",) if "bias" in layer else ())


def fusable(layers: Sequence[nn.Module]) -> bool:
    """Whether `layers` (two or more) can run as one FusedLinear: all nn.QuantizedLinear of the affine mode
    with one bit width, group size, input size and dtypes, all with an additive bias or none."""
    if len(layers) < 2 or not all(isinstance(layer, nn.QuantizedLinear) for layer in layers):
        return False
    first = layers[0]
    keys = _keys(first)
    return all(layer.mode == "affine" and layer.bits == first.bits and layer.group_size == first.group_size
               and _keys(layer) == keys and layer.get("biases") is not None
               and all(layer[k].dtype == first[k].dtype and layer[k].shape[1:] == first[k].shape[1:] for k in keys)
               for layer in layers)


class FusedLinear:
    """Quantized linear layers of one input as one `qmm` (see the module docstring). Not an nn.Module: its
    arrays are the layers' own memory, so the model's parameters do not count them twice.

    Args:
        layers: quantized layers that `fusable` accepts (weight uint32 [N_i, K * bits / 32], scales /
            biases [N_i, K / group_size], optional bias [N_i]); their arrays are replaced by row slices of
            the fused ones (evaluated here).

    Raises:
        ValueError: layers that `fusable` refuses.
    """

    def __init__(self, layers: Sequence[nn.QuantizedLinear]):
        if not fusable(layers):
            raise ValueError("FusedLinear: the layers must be two or more affine QuantizedLinear of one bit width, "
                             "group size, input size and dtypes, with a bias on all or none")
        keys = _keys(layers[0])
        self.arrays = {k: mx.concatenate([layer[k] for layer in layers]) for k in keys}  # [sum N_i, ...]
        mx.eval(self.arrays)
        bounds = [0]
        for layer in layers:
            bounds.append(bounds[-1] + layer["scales"].shape[0])
        for layer, lo, hi in zip(layers, bounds, bounds[1:]):
            for k in keys:
                layer[k] = self.arrays[k][lo:hi]  # a view of the fused rows
        self.layers = tuple(layers)
        self.views = tuple(tuple(layer[k] for k in keys) for layer in layers)
        mx.eval(self.views)
        self.splits = bounds[1:-1]
        self.widths = tuple(hi - lo for lo, hi in zip(bounds, bounds[1:]))  # each layer's N_i
        self.group_size, self.bits = layers[0].group_size, layers[0].bits

    def covers(self, *layers: nn.Module) -> bool:
        """Whether `layers` are exactly the fused layers, in order, still holding the fused arrays (False once
        one was swapped for another module, such as an RMM layer, or given other arrays)."""
        return (len(layers) == len(self.layers)
                and all(a is b for a, b in zip(layers, self.layers))
                and all(all(layer[k] is v for k, v in zip(_keys(layer), views))
                        for layer, views in zip(layers, self.views)))

    def packed(self, x: mx.array) -> mx.array:
        """x [..., K] -> the layers' outputs side by side, [..., sum N_i] (one product, no split)."""
        a = self.arrays
        y = qmm(x, a["weight"], a["scales"], a["biases"], self.group_size, self.bits)  # [..., sum N_i]
        return y + a["bias"] if "bias" in a else y

    def __call__(self, x: mx.array) -> List[mx.array]:
        """x [..., K] -> each layer's output [..., N_i] (views of one product's columns)."""
        return mx.split(self.packed(x), self.splits, axis=-1)
