"""mlx-infer's own attention layers, swapped into a model it runs in place of mlx-lm's (per instance: mlx-lm's
modules and classes stay as they are), calling an attention function given to them: kv/attention_hook.install
gives them the project's `attention`.

    use_attention(model, attend)      # idempotent; returns how many blocks call `attend`
    out = model(tokens, cache=cache)  # each layer's self_attn a CacheAttention or KernelRoPEAttention

`CacheAttention` is the attention block of mlx-lm's llama, qwen2, qwen3 and gemma3 (text) models: q / k / v
projections, the heads (qwen3 normalizes q and k per head before moving the heads forward, gemma3 after),
RoPE at the cache's offset, the cache's update, `attend`, o_proj: the same operations on the same modules,
so the same logits bit for bit. llama / qwen2 blocks already on the kernel twins (kernels/rope.py,
kernels/linear.use_kernels) become a KernelRoPEAttention calling `attend`. Attention blocks of other
classes are left as they are (they attend through mlx-lm's own function).
"""

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

from ..kernels.rope import KernelRoPEAttention

__all__ = ["ATTENTIONS", "CacheAttention", "use_attention"]

#: mlx-lm attention classes CacheAttention takes, with where each normalizes q and k: None (no norms),
#: "heads" (per head on [B, L, heads, D], before the heads move forward: qwen3) or "transposed" (on
#: [B, heads, L, D]: gemma3).
ATTENTIONS = {llama.Attention: None, qwen2.Attention: None, qwen3.Attention: "heads",
              gemma3_text.Attention: "transposed"}


class CacheAttention(nn.Module):
    """One of ATTENTIONS calling `attend`: x [B, L, D] -> [B, L, D], the wrapped block's computation. Holds the
    same q_proj / k_proj / v_proj / o_proj, rope and (qwen3, gemma3) q_norm / k_norm modules under the same
    parameter names, and its n_heads, n_kv_heads and scale.

    Args:
        attn: the mlx-lm attention block; its modules are shared, not copied.
        attend: mlx-lm's scaled_dot_product_attention's arguments (queries [B, n_q, L, D], keys / values
            [B, n_kv, S, D], cache=, scale=, mask=) -> [B, n_q, L, Dv] (kv/attention_hook.attention, or
            mlx-lm's scaled_dot_product_attention).

    Raises:
        ValueError: `attn` is not one of ATTENTIONS.
    """

    def __init__(self, attn: nn.Module, attend: Callable):
        if type(attn) not in ATTENTIONS:
            raise ValueError(f"not an mlx-lm attention block mlx-infer takes: {type(attn).__name__}")
        super().__init__()
        self.n_heads, self.n_kv_heads, self.scale = attn.n_heads, attn.n_kv_heads, attn.scale
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.rope = attn.rope
        self.norms = ATTENTIONS[type(attn)]
        if self.norms is not None:
            self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.attend = attend

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)  # [B, L, n_q, D]
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)  # [B, L, n_kv, D]
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # [B, n_kv, L, Dv]
        if self.norms == "heads":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)  # [B, heads, L, D]
        if self.norms == "transposed":
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries, keys = self.rope(queries), self.rope(keys)
        out = self.attend(queries, keys, values, cache=cache, scale=self.scale, mask=mask)  # [B, n_q, L, Dv]
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))  # [B, L, D]


def _ours(attn: nn.Module, attend: Callable) -> nn.Module:
    """`attn` as one of the project's attention layers calling `attend`, or `attn` itself (already one, or a
    class neither takes)."""
    if type(attn) in ATTENTIONS:
        return CacheAttention(attn, attend)
    if type(attn) is KernelRoPEAttention and attn.attend is not attend:
        return KernelRoPEAttention(attn, attend=attend)
    return attn


def use_attention(model: nn.Module, attend: Callable) -> int:
    """Swap every attention block of `model` that ATTENTIONS or KernelRoPEAttention covers for the project's
    layer calling `attend` (as CacheAttention takes it), in place (same modules and parameter names; a block
    already calling `attend` stays). Nothing outside `model` changes: another model of the same classes
    attends as mlx-lm wrote it.

    Returns:
        How many of `model`'s attention blocks call `attend` (0: none of its classes is covered).
    """
    for _, parent in model.named_modules():
        for key, child in parent.children().items():
            if isinstance(child, nn.Module):
                new = _ours(child, attend)
                if new is not child:
                    setattr(parent, key, new)
    return sum(type(m) in (CacheAttention, KernelRoPEAttention) and m.attend is attend
               for _, m in model.named_modules())
