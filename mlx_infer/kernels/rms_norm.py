"""RMSNorm (arXiv 1910.07467) as one operation on the CPU kernel.

    y = rms_norm(x, weight, eps)      # x [..., D], weight [D] -> [..., D]

On MLX's CPU device `mx.fast.rms_norm` has no fused implementation: it runs as 11 operations (square,
sum, rsqrt, broadcasts, multiplies), about 27 us a call on the default model's shapes, and a decode step
of a 30-layer model calls it 61 times. The CPU kernel (cpu_kernels/rms_norm.cpp) is one operation that
computes what MLX's fallback computes (the mean of squares in float32, the normalized row rounded to the
output dtype, then the weight's product in that dtype); only the order of the float32 sum of squares
differs. Elsewhere `mx.fast.rms_norm` runs (fused on Metal and CUDA).

Gemma's RMSNorm (mlx-lm's gemma / gemma2 / gemma3_text modules: `mx.fast.rms_norm(x, 1.0 + weight, eps)`,
six per layer in Gemma 3, q_norm and k_norm included) gets the same kernel through `KernelOffsetRMSNorm`,
which adds the 1 to the weight as mlx-lm does (one operation, in the weight's dtype) and calls `rms_norm`.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma, gemma2, gemma3_text

from . import cpu

__all__ = ["OFFSET_RMS_NORMS", "KernelOffsetRMSNorm", "KernelRMSNorm", "rms_norm", "rms_norm_backend"]

#: mlx-lm norm classes whose forward is exactly mx.fast.rms_norm(x, 1.0 + weight, eps) (Gemma's).
OFFSET_RMS_NORMS = (gemma.RMSNorm, gemma2.RMSNorm, gemma3_text.RMSNorm)


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


class KernelOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm (one of OFFSET_RMS_NORMS: y = rms_norm(x, 1 + weight, eps)) on `rms_norm`: the same
    weight array [D] and parameter name, x [..., D] -> [..., D]."""

    def __init__(self, layer: nn.Module):
        """Wrap `layer`'s weight [D] and eps without copying them. Raises ValueError for another class."""
        if type(layer) not in OFFSET_RMS_NORMS:
            raise ValueError(f"not one of mlx-lm's Gemma RMSNorms: {type(layer).__name__}")
        super().__init__()
        self.weight = layer["weight"]
        self.eps = layer.eps

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, 1.0 + self["weight"], self.eps)
