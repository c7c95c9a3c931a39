"""Quantized layers whose matmul goes through the kernel layer's `qmm`, and `use_kernels(model)`, which
swaps them (and nn.RMSNorm / nn.RoPE / mlx-lm's SwiGLU MLPs for their kernel twins, kernels/rms_norm.py,
kernels/rope.py and kernels/swiglu.py) into a loaded mlx-lm model in place.

The swapped layers are subclasses of mlx.nn's QuantizedLinear / QuantizedEmbedding holding the very same
arrays (no copy, same parameter names), so `isinstance` checks and the embedding lookup are unchanged; only
the product differs, and only by float rounding (accumulation order). The kernels take 4- and 8-bit codes;
a layer of 2, 3, 5 or 6 bits (a GGUF's Q5_0 / Q5_1 / Q5_K tensors, which a Q4_K_M file holds where a row
is not a multiple of 256 values, as all of Gemma-3-270M's 640-wide ones) gets its codes widened to 8 bits
once when swapped (`widen_codes`: the same integers, scales and biases, so the same dequantized weights),
rather than running MLX's quantized matmul, a scalar loop on the CPU. On Gemma-3-270M Q4_K_M that is 81 of
its 127 quantized layers (measured in docs/kernels.md: decode 2.5-3.5x, TTFT 10-20x, 23 MiB more).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .fused import FusedLinear, fusable
from .qmm import qmm
from .rms_norm import OFFSET_RMS_NORMS, KernelOffsetRMSNorm, KernelRMSNorm
from .rope import ROPE_ATTENTIONS, KernelRoPE, KernelRoPEAttention
from .swiglu import GATED_MLPS, KernelGatedMLP

#: What the kernels take: MLX's affine mode at these bit widths and group sizes.
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)
#: Bit widths whose codes are widened to 8 bits (`widen_codes`) so that the kernels run the layer.
WIDENED_BITS = (2, 3, 5, 6)

__all__ = ["KernelQuantizedLinear", "KernelQuantizedEmbedding", "fuse_projections", "supports", "use_kernels",
           "widen_codes"]


def supports(layer: nn.Module) -> bool:
    """Whether a QuantizedLinear / QuantizedEmbedding can run on the kernels: affine mode with biases,
    bits 4 or 8 (or WIDENED_BITS, widened to 8 when swapped), group size 32, 64 or 128."""
    return (isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and layer.mode == "affine" and "biases" in layer and layer["biases"] is not None
            and layer.bits in KERNEL_BITS + WIDENED_BITS and layer.group_size in KERNEL_GROUP_SIZES)


def widen_codes(w: mx.array, bits: int) -> mx.array:
    """MLX affine codes of `bits` bits (1..8) re-stored as 8-bit codes, the same integers: w uint32
    [N, K * bits / 32] (MLX's layout: a little-endian bit stream, value j in bits [bits * j, bits * (j + 1)),
    so 8 values fill `bits` bytes) -> uint32 [N, K / 4] (value j in byte j). With the layer's scales and
    biases unchanged, mx.dequantize(..., bits=8) of the result equals mx.dequantize(w, ..., bits) exactly.
    Evaluated here (once, at load).

    Raises:
        ValueError: bits outside 1..8, or rows that do not hold whole groups of 8 values.
    """
    if not 1 <= bits <= 8 or (w.shape[-1] * 32) % (8 * bits):
        raise ValueError(f"widen_codes: cannot widen rows of {w.shape[-1]} words of {bits}-bit codes")
    N = w.shape[0]
    groups = mx.view(w, mx.uint8).reshape(N, -1, bits)  # [N, K / 8, bits]: 8 codes in `bits` bytes
    stream = groups[..., 0].astype(mx.uint64)  # [N, K / 8]: those bytes as one little-endian integer
    for i in range(1, bits):
        stream = stream | (groups[..., i].astype(mx.uint64) << (8 * i))
    shifts = mx.arange(8, dtype=mx.uint64) * bits  # [8]
    codes = ((stream[..., None] >> shifts) & ((1 << bits) - 1)).astype(mx.uint8)  # [N, K / 8, 8]
    out = mx.view(codes.reshape(N, -1), mx.uint32)  # [N, K / 4]
    mx.eval(out)
    return out


def _kernel_codes(layer: nn.Module) -> tuple:
    """(weight, bits) of a supported layer as the kernels take them: its own, or widened to 8 bits."""
    if layer.bits in WIDENED_BITS:
        return widen_codes(layer["weight"], layer.bits), 8
    return layer["weight"], layer.bits


class KernelQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose product is `qmm`: x [..., K] -> [..., N] (+ bias [N])."""

    def __init__(self, layer: nn.QuantizedLinear):
        """Wrap the arrays of `layer` (weight [N, K*bits/32] uint32, scales / biases [N, K/group_size],
        optional bias [N]) without copying them (codes of WIDENED_BITS: widened to 8 bits, a new weight).
        Raises ValueError when supports(layer) is False."""
        if not supports(layer):
            raise ValueError(f"the kernels cannot run {layer}: affine mode, bits {KERNEL_BITS + WIDENED_BITS} "
                             f"and group sizes {KERNEL_GROUP_SIZES} only")
        nn.Module.__init__(self)  # not QuantizedLinear's: it would quantize a random weight
        self.group_size, self.mode = layer.group_size, layer.mode
        self.weight, self.bits = _kernel_codes(layer)
        self.scales, self.biases = layer["scales"], layer["biases"]
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
        without copying them (codes of WIDENED_BITS: widened to 8 bits, a new weight). Raises ValueError
        when supports(layer) is False."""
        if not supports(layer):
            raise ValueError(f"the kernels cannot run {layer}: affine mode, bits {KERNEL_BITS + WIDENED_BITS} "
                             f"and group sizes {KERNEL_GROUP_SIZES} only")
        nn.Module.__init__(self)  # not QuantizedEmbedding's: it would quantize a random weight
        self.group_size, self.mode = layer.group_size, layer.mode
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.weight, self.bits = _kernel_codes(layer)
        self.scales, self.biases = layer["scales"], layer["biases"]
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
    classes, such as another model's own norm class, are left as they are). The MLP and attention twins run their gate / up and q / k / v projections as one product each
    where those are kernel layers of one format (`fuse_projections`, kernels/fused.py: bit-identical
    outputs, no weight kept twice).

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
    return swapped
