"""The quantized layers whose matmul goes through the kernel layer's `qmm` (swapped into a loaded model by
kernels/linear.py's `use_kernels`), and `linear_add`, a layer's product with a residual added in the same
operation.

The layers are subclasses of mlx.nn's QuantizedLinear / QuantizedEmbedding holding the very same arrays (no
copy, same parameter names), so `isinstance` checks and the embedding lookup are unchanged; only the product
differs, and only by float rounding (accumulation order). The kernels take 4- and 8-bit codes; a layer of 2,
3, 5 or 6 bits (a GGUF's Q5_0 / Q5_1 / Q5_K tensors, which a Q4_K_M file holds where a row is not a multiple
of 256 values, as all of Gemma-3-270M's 640-wide ones) gets its codes widened to 8 bits once when swapped
(`widen_codes`: the same integers, scales and biases, so the same dequantized weights), rather than running
MLX's quantized matmul, a scalar loop on the CPU. On Gemma-3-270M Q4_K_M that is 81 of its 127 quantized
layers: much faster decode and prefill for a little more memory (measured in docs/kernels.md).
"""

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from .qmm import qmm

__all__ = ["KERNEL_BITS", "KERNEL_GROUP_SIZES", "WIDENED_BITS", "KernelQuantizedEmbedding", "KernelQuantizedLinear",
           "linear_add", "supports", "use_gpu_qmm", "widen_codes"]

#: What the kernels take: MLX's affine mode at these bit widths and group sizes.
KERNEL_BITS = (4, 8)
KERNEL_GROUP_SIZES = (32, 64, 128)
#: Bit widths whose codes are widened to 8 bits (`widen_codes`) so that the kernels run the layer.
WIDENED_BITS = (2, 3, 5, 6)


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


def linear_add(layer: nn.Module, x: mx.array, residual: mx.array) -> mx.array:
    """residual + layer(x), bit for bit as those two operations give it: x [..., K], residual [..., N].

    For a KernelQuantizedLinear without a bias (a decoder block's o_proj and down_proj) `qmm` adds the
    residual in the product's own operation (on the CPU kernel with float32 operands; elsewhere qmm adds it
    as a separate operation); any other layer (an RMM layer, a float Linear) runs as it is, then the add.
    """
    if type(layer) is KernelQuantizedLinear and "bias" not in layer:
        return qmm(x, layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits,
                   residual=residual)
    return residual + layer(x)


def use_gpu_qmm(model: nn.Module) -> int:
    """Swap `model`'s nn.QuantizedLinear / nn.QuantizedEmbedding layers of 4 or 8 bits (KERNEL_BITS; others
    keep MLX's own product: no codes widened on a GPU) for the kernel layers, in place (same arrays), so that
    their skinny products run on the GPU kernel (qmm; kernels/selfcheck.py's checked_gpu_kernels calls this
    only where that kernel passed its check on this device and was faster).

    Returns:
        How many layers were swapped.
    """
    swapped = 0

    def swap(path: str, module: nn.Module) -> nn.Module:
        nonlocal swapped
        if not (supports(module) and module.bits in KERNEL_BITS):
            return module
        if type(module) is nn.QuantizedLinear:
            swapped += 1
            return KernelQuantizedLinear(module)
        if type(module) is nn.QuantizedEmbedding:
            swapped += 1
            return KernelQuantizedEmbedding(module)
        return module

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return swapped
