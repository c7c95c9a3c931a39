"""RMSNorm (arXiv 1910.07467) as one operation on the CPU kernel.

    y = rms_norm(x, weight, eps)      # x [..., D], weight [D] -> [..., D]

On MLX's CPU device `mx.fast.rms_norm` has no fused implementation: it runs as 11 operations (square,
sum, rsqrt, broadcasts, multiplies), about 27 us a call on the default model's shapes, and a decode step
of a 30-layer model calls it 61 times. The CPU kernel (cpu_kernels/rms_norm.cpp) is one operation that
computes what MLX's fallback computes (the mean of squares in float32, the normalized row rounded to the
output dtype, then the weight's product in that dtype); only the order of the float32 sum of squares
differs. Elsewhere `mx.fast.rms_norm` runs (fused on Metal and CUDA).
"""

import mlx.core as mx
import mlx.nn as nn

from . import cpu

__all__ = ["KernelRMSNorm", "rms_norm", "rms_norm_backend"]


def rms_norm_backend() -> str:
    """Which implementation `rms_norm` runs here: 'cpu-<isa>' (the kernel, on MLX's CPU device) or
    'reference' (mx.fast.rms_norm)."""
    return cpu.cpu_backend()


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """x [..., D] / sqrt(mean(x^2, -1) + eps) * weight [D], in promote_types(x.dtype, weight.dtype); on the
    CPU kernel where it runs, else mx.fast.rms_norm. Raises ValueError on shapes or dtypes neither takes."""
    if rms_norm_backend() == "reference":
        return mx.fast.rms_norm(x, weight, eps)
    return cpu.cpu_rms_norm(x, weight, eps)


class KernelRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose product is `rms_norm` (the same weight array, the same parameter name)."""

    def __init__(self, layer: nn.RMSNorm):
        """Wrap `layer`'s weight [D] and eps without copying them."""
        nn.Module.__init__(self)  # not RMSNorm's: it would make a new weight
        self.weight = layer["weight"]
        self.eps = layer.eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)
