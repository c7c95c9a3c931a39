"""Rotary position embedding (RoPE, arXiv 2104.09864) as one operation on the CPU kernel.

    y = rope(x, dims, traditional, base, scale, offset)   # x [B, n_heads, T, D] -> the same shape

On MLX's CPU device `mx.fast.rope` has no fused implementation: it runs as 29 operations (arange, exp,
cos, sin, broadcasts, slices, multiplies, a concatenate), about 70 us a call on the default model's
shapes, twice per layer per step. The CPU kernel (cpu_kernels/rope.cpp) is one operation computing what
MLX's fallback computes (angles in float32, cos / sin rounded to x's dtype, each product and sum rounded
in x's dtype), with the C library's cos / sin and the inverse frequencies computed once per call on the
host. Elsewhere `mx.fast.rope` runs (fused on Metal and CUDA).
"""

from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn

from . import cpu

__all__ = ["KernelRoPE", "rope", "rope_backend"]


def rope_backend() -> str:
    """Which implementation `rope` runs here: 'cpu-<isa>' (the kernel, on MLX's CPU device) or
    'reference' (mx.fast.rope)."""
    return cpu.cpu_backend()


def rope(x: mx.array, dims: int, traditional: bool, base: Optional[float], scale: float,
         offset: Union[int, mx.array], freqs: Optional[mx.array] = None) -> mx.array:
    """mx.fast.rope: x [B, ..., T, D] with its first `dims` features rotated for positions
    (t + offset) * scale (offset an int, or an integer array scalar or [B]); on the CPU kernel where it
    runs, else mx.fast.rope. Raises ValueError on arguments neither takes."""
    if rope_backend() == "reference":
        return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
    return cpu.cpu_rope(x, dims, traditional, base, scale, offset, freqs)


class KernelRoPE(nn.RoPE):
    """nn.RoPE whose rotation is `rope` (same dims, traditional, base and scale)."""

    def __init__(self, layer: nn.RoPE):
        """Copy `layer`'s settings (it holds no arrays)."""
        nn.Module.__init__(self)  # RoPE's own would do the same; this keeps the two constructors apart
        self.dims, self.traditional, self.base, self.scale = layer.dims, layer.traditional, layer.base, layer.scale

    def __call__(self, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
        return rope(x, self.dims, self.traditional, self.base, self.scale, offset)
