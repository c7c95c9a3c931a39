"""A decoder block whose two residual connections are added inside its last products.

    block = KernelDecoderBlock(layer)     # an mlx-lm llama / qwen2 TransformerBlock on the kernel twins
    out = block(x, mask, cache)           # x [B, L, D] -> [B, L, D], the block's own computation

mlx-lm's llama / qwen2 block computes h = x + attn(norm1(x)), out = h + mlp(norm2(h)): two adds per layer,
each its own operation. On MLX's CPU backend every operation costs a few microseconds to schedule besides its
work, and a decode step of the default model had 519 (60 of them these adds). Here attention's o_proj and the
MLP's down_proj take the residual into their product (`linear_add`: `qmm` adds it as it stores each output,
bit for bit the separate add), so the block has no add of its own.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2

from .rope import KernelRoPEAttention
from .swiglu import KernelGatedMLP

__all__ = ["DECODER_BLOCKS", "KernelDecoderBlock"]

#: mlx-lm decoder blocks whose forward is exactly h = x + self_attn(input_layernorm(x), mask, cache),
#: out = h + mlp(post_attention_layernorm(h)).
DECODER_BLOCKS = (llama.TransformerBlock, qwen2.TransformerBlock)


class KernelDecoderBlock(nn.Module):
    """One of DECODER_BLOCKS whose attention is a KernelRoPEAttention and MLP a KernelGatedMLP, with the
    residual adds in their products: x [B, L, D] -> [B, L, D]. Holds the same input_layernorm, self_attn,
    post_attention_layernorm and mlp modules (same parameter names) and llama's `use_sliding`; an attention
    or MLP of another class set in their place later runs with the block's own adds."""

    def __init__(self, block: nn.Module):
        """Wrap `block`'s modules without copying them. Raises ValueError for another class, or an attention
        or MLP that is not on the kernel twins."""
        if (type(block) not in DECODER_BLOCKS or type(block.self_attn) is not KernelRoPEAttention
                or type(block.mlp) is not KernelGatedMLP):
            raise ValueError(f"not an mlx-lm decoder block on the kernel twins: {type(block).__name__}")
        super().__init__()
        self.input_layernorm, self.self_attn = block.input_layernorm, block.self_attn
        self.post_attention_layernorm, self.mlp = block.post_attention_layernorm, block.mlp
        self.use_sliding = block.use_sliding if type(block) is llama.TransformerBlock else False

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        xn = self.input_layernorm(x)  # [B, L, D]
        if type(self.self_attn) is KernelRoPEAttention:
            h = self.self_attn(xn, mask, cache, residual=x)
        else:  # another attention swapped in since (a test's, a tool's): the block's own add
            h = x + self.self_attn(xn, mask, cache)
        hn = self.post_attention_layernorm(h)
        return self.mlp(hn, residual=h) if type(self.mlp) is KernelGatedMLP else h + self.mlp(hn)
