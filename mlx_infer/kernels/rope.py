"""Rotary position embedding (RoPE, arXiv 2104.09864) as one operation on the CPU kernel, and the
attention block that splits its heads and rotates them in one operation.

    y = rope(x, dims, traditional, base, scale, offset)   # x [B, n_heads, T, D] -> the same shape
    q, k, v = rope_heads(q, k, v, n_q, n_kv, rope, offset) # [B, T, heads * D] -> [B, heads, T, D]

On MLX's CPU device `mx.fast.rope` has no fused implementation: it runs as 29 operations (arange, exp,
cos, sin, broadcasts, slices, multiplies, a concatenate), about 70 us a call on the default model's
shapes, twice per layer per step. The CPU kernel (cpu_kernels/rope.cpp) is one operation computing what
MLX's fallback computes (angles in float32, cos / sin rounded to x's dtype, each product and sum rounded
in x's dtype), with the C library's cos / sin and the inverse frequencies computed once per call on the
host. Elsewhere `mx.fast.rope` runs (fused on Metal and CUDA).

mlx-lm's llama / qwen2 attention then reshapes and transposes each projection into heads: with RoPE, 8
operations per layer, each costing MLX's CPU backend a few microseconds to schedule. `rope_heads` does all
of it as one operation on the kernel, and `KernelRoPEAttention` is that attention block calling it.
"""

from typing import Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import scaled_dot_product_attention

from . import cpu
from .fused import FusedLinear
from .quantized import linear_add

__all__ = ["KernelRoPE", "KernelRoPEAttention", "ROPE_ATTENTIONS", "rope", "rope_backend", "rope_heads",
           "rope_heads_packed"]

#: mlx-lm attention classes whose forward is exactly: q / k / v projections, heads, RoPE at the cache's
#: offset, the cache's update, `scaled_dot_product_attention`, o_proj.
ROPE_ATTENTIONS = (llama.Attention, qwen2.Attention)


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


def rope_heads(q: mx.array, k: mx.array, v: mx.array, n_q: int, n_kv: int, rope_layer: nn.Module,
               offset: Union[int, mx.array]) -> tuple:
    """Attention's heads, q and k rotated by `rope_layer` at positions t + offset, as mlx-lm's attention
    computes them: q [B, T, n_q * D], k [B, T, n_kv * D], v [B, T, n_kv * Dv] -> (q [B, n_q, T, D],
    k [B, n_kv, T, D], v [B, n_kv, T, Dv]). One operation on the CPU kernel where it runs (a KernelRoPE, one
    dtype), else reshapes, transposes and rope_layer(q), then rope_layer(k) (another rope module, such as the
    query tap of kv/observe.py, sees the calls mlx-lm's attention makes). Raises ValueError on shapes that do
    not split into the heads."""
    B, T, _ = q.shape
    if rope_backend() == "reference" or not isinstance(rope_layer, KernelRoPE) or not q.dtype == k.dtype == v.dtype:
        q = q.reshape(B, T, n_q, -1).transpose(0, 2, 1, 3)  # [B, n_q, T, D]
        k = k.reshape(B, T, n_kv, -1).transpose(0, 2, 1, 3)  # [B, n_kv, T, D]
        v = v.reshape(B, T, n_kv, -1).transpose(0, 2, 1, 3)  # [B, n_kv, T, Dv]
        return rope_layer(q, offset=offset), rope_layer(k, offset=offset), v
    return cpu.cpu_rope_heads(q, k, v, n_q, n_kv, rope_layer.dims, rope_layer.traditional, rope_layer.base,
                              rope_layer.scale, offset)


def rope_heads_packed(qkv: mx.array, widths: tuple, n_q: int, n_kv: int, rope_layer: nn.Module,
                      offset: Union[int, mx.array]) -> tuple:
    """`rope_heads` of one packed projection qkv [B, T, N_q + N_k + N_v] (q's, k's and v's columns side by
    side, of widths `widths`, as a fused q / k / v product gives them): one operation on the CPU kernel where
    `rope_heads` would run there and v's heads are as wide as q's and k's, else the split and `rope_heads`."""
    D = qkv.shape[-1] // (n_q + 2 * n_kv)
    if (rope_backend() != "reference" and isinstance(rope_layer, KernelRoPE)
            and tuple(widths) == (n_q * D, n_kv * D, n_kv * D)):
        return cpu.cpu_rope_heads_packed(qkv, n_q, n_kv, rope_layer.dims, rope_layer.traditional, rope_layer.base,
                                         rope_layer.scale, offset)
    q, k, v = mx.split(qkv, [widths[0], widths[0] + widths[1]], axis=-1)  # [B, T, heads * D] each
    return rope_heads(q, k, v, n_q, n_kv, rope_layer, offset)


class KernelRoPEAttention(nn.Module):
    """An mlx-lm attention block (one of ROPE_ATTENTIONS, its RoPE a KernelRoPE) whose heads are split and
    rotated by `rope_heads`: x [B, L, D] -> [B, L, D], the same computation. Holds the same q_proj / k_proj /
    v_proj / o_proj and rope modules (same parameter names) and calls `attend` (mlx-lm's
    scaled_dot_product_attention, or the one the project's layers call, kv/attention_hook.attention, given by
    kv/attention_hook.install). With `qkv` (a FusedLinear of its q_proj, k_proj and v_proj) the three
    projections run as one product while it still covers them, its output split into heads as it is
    (`rope_heads_packed`). With `residual` [B, L, D] the result is residual + the block's output, the add in
    o_proj's product where `linear_add` can put it there (a decoder block's residual connection,
    kernels/block.py)."""

    def __init__(self, attn: nn.Module, qkv: Optional[FusedLinear] = None,
                 attend: Callable = scaled_dot_product_attention):
        """Wrap `attn`'s modules without copying them (`attn` a KernelRoPEAttention too: its modules and its
        `qkv` when none is given, calling `attend` instead). `attend` takes mlx-lm's scaled_dot_product_attention
        arguments: (queries [B, n_q, L, D], keys, values [B, n_kv, S, D], cache=, scale=, mask=) -> [B, n_q, L, Dv].
        Raises ValueError when `attn` is not one of ROPE_ATTENTIONS or its rope is not a KernelRoPE."""
        if type(attn) not in ROPE_ATTENTIONS + (KernelRoPEAttention,) or not isinstance(attn.rope, KernelRoPE):
            raise ValueError(f"not an mlx-lm RoPE attention on the kernels: {type(attn).__name__}")
        super().__init__()
        self.n_heads, self.n_kv_heads, self.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.rope = attn.rope
        if qkv is None and type(attn) is KernelRoPEAttention:
            qkv = attn.qkv
        self.qkv = qkv  # (not a Module: its arrays are the projections')
        self.attend = attend

    def __call__(self, x: mx.array, mask=None, cache=None, residual: Optional[mx.array] = None) -> mx.array:
        B, L, _ = x.shape
        offset = 0 if cache is None else cache.offset
        if self.qkv is not None and self.qkv.covers(self.q_proj, self.k_proj, self.v_proj):
            q, k, v = rope_heads_packed(self.qkv.packed(x), self.qkv.widths, self.n_heads, self.n_kv_heads, self.rope,
                                        offset)  # [B, heads, L, D]
        else:
            q, k, v = rope_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.n_heads, self.n_kv_heads,
                                 self.rope, offset)  # [B, heads, L, D]
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = self.attend(q, k, v, cache=cache, scale=self.scale, mask=mask)
        if L > 1:  # (one position: [B, n_q, 1, Dv] reshapes to [B, 1, n_q * Dv] in the same order)
            out = out.transpose(0, 2, 1, 3)  # [B, L, n_q, Dv]
        out = out.reshape(B, L, -1)  # [B, L, n_q * Dv]
        return self.o_proj(out) if residual is None else linear_add(self.o_proj, out, residual)  # [B, L, D]
