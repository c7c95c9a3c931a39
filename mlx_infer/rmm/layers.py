"""The reduced twins of mlx.nn's linear layers (RMM, arXiv 2608.13426): y = x[:, I] W[:, I]^T where each row
of x keeps its own index set I, chosen by |x| (the paper's activation column norm of a one-row A).

- Quantized weights keep whole quantization groups (scores summed per group), so only the kept groups'
  packed words, scales and biases are read: kernels.rmm.rmm_qmm.
- Float weights keep single indices (no group structure to respect); computed as x with its dropped
  entries zeroed, times W (no bytes saved: the float path is the accuracy reference).

Both hold the original layer's arrays (no copy, same parameter names) and a fixed retention ratio.
"""

import math

import mlx.core as mx
import mlx.nn as nn

from ..kernels.linear import KernelQuantizedLinear
from ..kernels.rmm import group_keep, rmm_qmm

__all__ = ["RmmLinear", "RmmQuantizedLinear", "index_mask"]


def index_mask(x: mx.array, keep: int) -> mx.array:
    """x [..., K] -> bool [..., K]: the `keep` entries of largest |x| in each row."""
    k = x.shape[-1]
    order = mx.argpartition(-mx.abs(x.astype(mx.float32)), kth=keep - 1, axis=-1)[..., :keep]  # [..., keep]
    return mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), order, mx.array(True), axis=-1) if keep < k \
        else mx.ones(x.shape, dtype=mx.bool_)


class RmmQuantizedLinear(KernelQuantizedLinear):
    """KernelQuantizedLinear computing x [..., K] -> [..., N] over the `keep` quantization groups each row of
    x keeps (kernels.rmm.rmm_qmm), + bias [N].

    Args:
        layer: an affine QuantizedLinear the kernels take (kernels.linear.supports), or a kernel twin; its
            arrays are held without a copy.
        retention: rho in (0, 1]; keep = ceil(rho * K / group_size) groups.

    Raises:
        ValueError: a layer the kernels do not take.
    """

    def __init__(self, layer: nn.QuantizedLinear, retention: float):
        super().__init__(layer)
        k = self.weight.shape[1] * 32 // self.bits
        self.retention = retention
        self.keep = group_keep(k, self.group_size, retention)
        self.groups = k // self.group_size

    def _extra_repr(self) -> str:
        return f"{super()._extra_repr()}, keep={self.keep}/{self.groups} groups"

    def __call__(self, x: mx.array) -> mx.array:
        y = rmm_qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self.keep)
        if "bias" in self:
            y = y + self["bias"]
        return y


class RmmLinear(nn.Linear):
    """nn.Linear computing x [..., K] -> [..., N] over the ceil(rho * K) entries of largest |x| in each row.

    Args:
        layer: the float layer (weight [N, K], optional bias [N]).
        retention: rho in (0, 1].
    """

    def __init__(self, layer: nn.Linear, retention: float):
        nn.Module.__init__(self)
        self.weight = layer["weight"]
        if "bias" in layer:
            self.bias = layer["bias"]
        self.retention = retention
        self.keep = max(1, math.ceil(retention * self.weight.shape[1] - 1e-9))
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        xr = mx.where(index_mask(x, self.keep), x, mx.zeros_like(x))  # [..., K]
        return super().__call__(xr)
