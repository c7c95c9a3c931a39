"""Quantized layers whose matmul goes through the kernel layer's `qmm`, and `use_kernels(model)`, which
swaps them (and nn.RMSNorm / nn.RoPE / mlx-lm's SwiGLU MLPs for their kernel twins, kernels/rms_norm.py,
kernels/rope.py and kernels/swiglu.py) into a loaded mlx-lm model in place.

The swapped layers are subclasses of mlx.nn's QuantizedLinear / QuantizedEmbedding holding the very same
arrays (no copy, same parameter names), so saving, `isinstance` checks and the embedding lookup are
unchanged; only the product differs, and only by float rounding (accumulation order).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .qmm import qmm
from .rms_norm import KernelRMSNorm
from .rope import ROPE_ATTENTIONS, KernelRoPE, KernelRoPEAttention
from .swiglu import SWIGLU_MLPS, KernelSwiGLUMLP

#: What the kernels take: MLX's affine mode at these bit widths and group sizes.
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)

__all__ = ["KernelQuantizedLinear", "KernelQuantizedEmbedding", "supports", "use_kernels"]


def supports(layer: nn.Module) -> bool:
    """Whether a QuantizedLinear / QuantizedEmbedding can run on the kernels: affine mode with biases,
    bits 4 or 8, group size 32, 64 or 128."""
    return (isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and layer.mode == "affine" and "biases" in layer and layer["biases"] is not None
            and layer.bits in KERNEL_BITS and layer.group_size in KERNEL_GROUP_SIZES)


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product is `qmm`: x [..., K] -> [..., N] (+ bias [N])."""

    def __init__(self, layer: nn.QuantizedLinear):
        """Wrap the arrays of `layer` (weight [N, K*bits/32] uint32, scales / biases [N, K/group_size],
        optional bias [N]) without copying them. Raises ValueError when supports(layer) is False."""
        if not supports(layer):
            raise ValueError(f"the kernels cannot run {layer}: affine mode, bits {KERNEL_BITS} and group "
                             f"sizes {KERNEL_GROUP_SIZES} only")
        nn.Module.__init__(self)  # not QuantizedLinear's: it would quantize a random weight
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.weight, self.scales, self.biases = layer["weight"], layer["scales"], layer["biases"]
        if "bias" in layer:
            self.bias = layer["bias"]
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        y = qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)  # [..., N]
        if "bias" in self:
            y = y + self["bias"]
        return y


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose `as_linear` (the tied lm_head: hidden [..., D] -> logits [..., V]) is
    `qmm`; the lookup (ids -> [..., D]) is unchanged."""

    def __init__(self, layer: nn.QuantizedEmbedding):
        """Wrap the arrays of `layer` (weight [V, D*bits/32] uint32, scales / biases [V, D/group_size])
        without copying them. Raises ValueError when supports(layer) is False."""
        if not supports(layer):
            raise ValueError(f"the kernels cannot run {layer}: affine mode, bits {KERNEL_BITS} and group "
                             f"sizes {KERNEL_GROUP_SIZES} only")
        nn.Module.__init__(self)  # not QuantizedEmbedding's: it would quantize a random weight
        self.group_size, self.bits, self.mode = layer.group_size, layer.bits, layer.mode
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.weight, self.scales, self.biases = layer["weight"], layer["scales"], layer["biases"]
        self.freeze()

    def as_linear(self, x: mx.array) -> mx.array:
        return qmm(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)


def _swap(path: str, module: nn.Module) -> nn.Module:
    if type(module) is nn.QuantizedLinear and supports(module):
        return KernelQuantizedLinear(module)
    if type(module) is nn.QuantizedEmbedding and supports(module):
        return KernelQuantizedEmbedding(module)
    if type(module) is nn.RMSNorm:
        return KernelRMSNorm(module)
    if type(module) is nn.RoPE:
        return KernelRoPE(module)
    return module


def use_kernels(model: nn.Module) -> int:
    """Swap every QuantizedLinear and QuantizedEmbedding of `model` that the kernels support, every
    nn.RMSNorm and nn.RoPE, every SwiGLU MLP of mlx-lm's llama / qwen2 / qwen3 and every llama / qwen2
    attention block whose RoPE is an nn.RoPE, for its kernel twin, in
    place (same arrays; layers already swapped, unsupported or of other classes, such as a model's own norm
    class, are left as they are).

    Returns:
        How many modules were swapped.
    """
    swapped = 0
    for _, parent in model.named_modules():
        for key, child in parent.children().items():
            if type(child) in SWIGLU_MLPS:
                setattr(parent, key, KernelSwiGLUMLP(child))
                swapped += 1

    def swap(path: str, module: nn.Module) -> nn.Module:
        nonlocal swapped
        new = _swap(path, module)
        swapped += new is not module
        return new

    leaves = tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
    for _, parent in model.named_modules():  # after the leaves: the attention's rope is a KernelRoPE now
        for key, child in parent.children().items():
            if type(child) in ROPE_ATTENTIONS and isinstance(child.rope, KernelRoPE):
                setattr(parent, key, KernelRoPEAttention(child))
                swapped += 1
    return swapped
