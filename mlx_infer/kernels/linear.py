"""`use_kernels(model)`, which swaps a loaded mlx-lm model's quantized layers for the kernel layers of
kernels/quantized.py (whose matmul is the kernel layer's `qmm`), and nn.RMSNorm / nn.RoPE / mlx-lm's gated
MLPs, RoPE attention blocks and decoder blocks for their kernel twins (kernels/rms_norm.py, kernels/rope.py,
kernels/swiglu.py, kernels/block.py), in place.
"""

from typing import Optional

import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .block import DECODER_BLOCKS, KernelDecoderBlock
from .fused import FusedLinear, fusable
from .quantized import (KERNEL_BITS, KERNEL_GROUP_SIZES, WIDENED_BITS, KernelQuantizedEmbedding, KernelQuantizedLinear,
                        supports, widen_codes)
from .rms_norm import OFFSET_RMS_NORMS, KernelOffsetRMSNorm, KernelRMSNorm
from .rope import ROPE_ATTENTIONS, KernelRoPE, KernelRoPEAttention
from .swiglu import GATED_MLPS, KernelGatedMLP

__all__ = ["KERNEL_BITS", "KERNEL_GROUP_SIZES", "WIDENED_BITS", "KernelQuantizedEmbedding", "KernelQuantizedLinear",
           "fuse_projections", "supports", "use_kernels", "widen_codes"]


def _swap(path: str, module: nn.Module) -> nn.Module:
    if type(module) is nn.QuantizedLinear and supports(module):
        return KernelQuantizedLinear(module)
    if type(module) is nn.QuantizedEmbedding and supports(module):
        return KernelQuantizedEmbedding(module)
    if type(module) is nn.RMSNorm:
        return KernelRMSNorm(module)
    if type(module) in OFFSET_RMS_NORMS:
        return KernelOffsetRMSNorm(module)
    if type(module) is nn.RoPE:
        return KernelRoPE(module)
    return module


def fuse_projections(*layers: nn.Module) -> Optional[FusedLinear]:
    """The layers (of one input) as one FusedLinear when all are KernelQuantizedLinear that `fusable`
    accepts (their arrays become views of the fused ones), else None (they stay as they are)."""
    if all(type(layer) is KernelQuantizedLinear for layer in layers) and fusable(layers):
        return FusedLinear(layers)
    return None


def use_kernels(model: nn.Module) -> int:
    """Swap every QuantizedLinear and QuantizedEmbedding of `model` that the kernels support (2/3/5/6-bit
    codes widened to 8 bits), every nn.RMSNorm, Gemma's RMSNorm and nn.RoPE, every SwiGLU / GeGLU MLP of
    mlx-lm's llama / qwen2 / qwen3 / gemma2 / gemma3 and every llama / qwen2 attention block whose RoPE is an
    nn.RoPE, for its kernel twin, in place (same arrays; layers already swapped, unsupported or of other
    classes, such as another model's own norm class, are left as they are). The MLP and attention twins run
    their gate / up and q / k / v projections as one product each where those are kernel layers of one
    format (`fuse_projections`, kernels/fused.py: bit-identical outputs, no weight kept twice), and every
    llama / qwen2 decoder block on those twins becomes a KernelDecoderBlock (its residual adds inside its
    products, kernels/block.py), in its model's `layers` list.

    Returns:
        How many modules were swapped.
    """
    swapped = 0

    def swap(path: str, module: nn.Module) -> nn.Module:
        nonlocal swapped
        new = _swap(path, module)
        swapped += new is not module
        return new

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    for _, parent in model.named_modules():  # after the leaves: the projections and the rope are kernel twins now
        for key, child in parent.children().items():
            if type(child) in GATED_MLPS:
                setattr(parent, key, KernelGatedMLP(child, fuse_projections(child.gate_proj, child.up_proj)))
                swapped += 1
            elif type(child) in ROPE_ATTENTIONS and isinstance(child.rope, KernelRoPE):
                qkv = fuse_projections(child.q_proj, child.k_proj, child.v_proj)
                setattr(parent, key, KernelRoPEAttention(child, qkv))
                swapped += 1
    for _, parent in model.named_modules():  # after the blocks' attention and MLP became kernel twins
        for key, child in parent.children().items():
            if isinstance(child, list):  # a model's `layers` (children() gives a copy of the list)
                for i, block in enumerate(child):
                    if _block_swappable(block):
                        parent[key][i] = KernelDecoderBlock(block)
                        swapped += 1
    return swapped


def _block_swappable(block: nn.Module) -> bool:
    """Whether KernelDecoderBlock takes `block` (one of DECODER_BLOCKS on the kernel attention and MLP)."""
    return (type(block) in DECODER_BLOCKS and type(block.self_attn) is KernelRoPEAttention
            and type(block.mlp) is KernelGatedMLP)
