"""SwiGLU's gate, silu(gate) * up, and GeGLU's, gelu_approx(gate) * up (arXiv 2002.05202), each as one
operation on the CPU kernel, and the MLP modules that use them.

    y = swiglu(gate, up)     # gate, up [..., F] float32 -> [..., F]
    y = geglu(gate, up)      # Gemma-2 / Gemma-3's MLP gate (GELU's tanh approximation)

mlx-lm's `swiglu` is mx.compile'd; on MLX's CPU device the compiled kernel evaluates e^x one value at a
time: 37 us for the default model's 1536 values of one token and 230 us for 9 tokens (measured on
an AMD EPYC Zen 4), a decode step calling it 30 times. The CPU kernel (cpu_kernels/swiglu.cpp) computes
gate * (1 / (1 + e^-gate)) * up in float32 with the vector e^x of the attention kernels (within 2 ulp of
e^x); elsewhere, and for float16 / bfloat16, mlx-lm's `swiglu` runs. Likewise mlx's `gelu_approx` (tanh
one value at a time: 42 us a call beyond the product for Gemma-3-270M's 2048 values of one token, 405 us for
9 tokens) against the kernel's gate * sigmoid(2 sqrt(2 / pi) (gate + 0.044715 gate^3)) * up, the same
function (0.5 (1 + tanh(t)) = sigmoid(2t)) through the same vector e^x.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from . import cpu
from .fused import FusedLinear
from .quantized import linear_add

__all__ = ["GATED_MLPS", "KernelGatedMLP", "gated_packed", "geglu", "swiglu", "swiglu_backend"]

#: mlx-lm MLP classes whose forward is exactly down_proj(GATE(gate_proj(x), up_proj(x))), by their GATE:
#: "swiglu" (mlx-lm's swiglu, silu(gate) * up) or "geglu" (nn.gelu_approx(gate) * up).
GATED_MLPS = {llama.MLP: "swiglu", qwen2.MLP: "swiglu", qwen3.MLP: "swiglu",
              gemma2.MLP: "geglu", gemma3_text.MLP: "geglu"}


def swiglu_backend() -> str:
    """Which implementation `swiglu` runs here for float32: 'cpu-<isa>' (the kernel, on MLX's CPU device)
    or 'reference' (mlx-lm's swiglu)."""
    return cpu.cpu_backend()


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, gate and up of one shape [..., F]: on the CPU kernel for float32 where it runs,
    else mlx-lm's `swiglu` (which broadcasts and promotes as MLX's operations do)."""
    if (swiglu_backend() == "reference" or gate.dtype != mx.float32 or up.dtype != mx.float32
            or gate.shape != up.shape):
        return mlx_lm_swiglu(gate, up)
    return cpu.cpu_swiglu(gate, up)


def gated_packed(gu: mx.array, kind: str) -> mx.array:
    """`swiglu` (kind "swiglu") or `geglu` (kind "geglu") of one packed gate / up product gu [..., 2F] (gate in
    features [0, F), up in [F, 2F)) -> [..., F]: one operation on the CPU kernel for float32 where it runs,
    else the split and the gate. Raises ValueError for another kind."""
    if kind not in ("swiglu", "geglu"):
        raise ValueError(f"gated_packed: kind must be 'swiglu' or 'geglu', got {kind!r}")
    if swiglu_backend() != "reference" and gu.dtype == mx.float32:
        return cpu.cpu_swiglu_packed(gu) if kind == "swiglu" else cpu.cpu_geglu_packed(gu)
    gate, up = mx.split(gu, 2, axis=-1)  # [..., F] each
    return swiglu(gate, up) if kind == "swiglu" else geglu(gate, up)


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    """gelu_approx(gate) * up, gate and up of one shape [..., F]: on the CPU kernel for float32 where it runs,
    else mlx's `nn.gelu_approx(gate) * up`."""
    if (swiglu_backend() == "reference" or gate.dtype != mx.float32 or up.dtype != mx.float32
            or gate.shape != up.shape):
        return nn.gelu_approx(gate) * up
    return cpu.cpu_geglu(gate, up)


class KernelGatedMLP(nn.Module):
    """An mlx-lm gated MLP, one of GATED_MLPS (SwiGLU: llama / qwen2 / qwen3; GeGLU: Gemma-2 / Gemma-3), whose
    gate runs through `swiglu` or `geglu`: x [..., D] -> [..., D]. Holds the same gate_proj / up_proj /
    down_proj modules (same parameter names). With `gate_up` (a FusedLinear of its gate_proj and up_proj)
    the two run as one product while it still covers them, its output gated as it is (`gated_packed`). With
    `residual` [..., D] the result is residual + the MLP's output, the add in down_proj's product where
    `linear_add` can put it there (a decoder block's residual connection, kernels/block.py)."""

    def __init__(self, mlp: nn.Module, gate_up: Optional[FusedLinear] = None):
        """Wrap `mlp`'s three projections without copying them. Raises ValueError when `mlp` is not one of
        GATED_MLPS."""
        if type(mlp) not in GATED_MLPS:
            raise ValueError(f"not a SwiGLU / GeGLU MLP of mlx-lm: {type(mlp).__name__}")
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.gate_up = gate_up  # (not a Module: its arrays are the projections')
        self.kind = GATED_MLPS[type(mlp)]  # "swiglu" or "geglu"

    def __call__(self, x: mx.array, residual: Optional[mx.array] = None) -> mx.array:
        if self.gate_up is not None and self.gate_up.covers(self.gate_proj, self.up_proj):
            h = gated_packed(self.gate_up.packed(x), self.kind)  # [..., 2F] -> [..., F]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # [..., F] each
            h = swiglu(gate, up) if self.kind == "swiglu" else geglu(gate, up)
        return self.down_proj(h) if residual is None else linear_add(self.down_proj, h, residual)
