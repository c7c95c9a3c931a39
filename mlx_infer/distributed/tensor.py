"""Tensor parallelism: each rank holds a slice of every layer's projections (Megatron-LM's split, arXiv 1909.08053).

    plan = tensor_plan(model, size)             # DistributedError when the heads do not split
    shard_weights(model, plan, rank)            # before use_kernels: slices of each projection's weights
    ... use_kernels(model); install_attention(model) ...
    add_all_sums(model, group)                  # after: an all_sum after attention's and the MLP's products

What each projection holds on rank r of N (a llama / qwen2 / qwen3 / gemma block: q / k / v / o, gate / up / down):

- q, k, v (column-sharded): the rows of the rank's heads. Heads are split by KV head, so that each rank's query
  heads read its own KV heads: rank r holds KV heads [k_r, k_r+1) and the query heads of their groups. The
  split is as even as the KV heads allow and need not be equal (the default model, 9 query and 3 KV heads,
  splits 6 + 3 over 2 ranks), so the check is that every rank gets one KV head (n_kv_heads >= N) and
  that each slice of o_proj's input starts on a quantization group. Each rank's KV cache holds its heads only.
- gate, up (column-sharded): a slice of the intermediate rows, split evenly in whole quantization groups.
- o, down (row-sharded): the columns matching the rank's heads / intermediate rows; each rank's product is a
  partial sum of the output, and an all_sum after it gives every rank the whole. An additive bias stays on
  rank 0 only (added once).

The slices are ordinary nn.Linear / nn.QuantizedLinear arrays, so `use_kernels` afterwards swaps them for the
CPU kernel layers exactly as it does unsharded: q / k / v and gate / up still run as one fused product per
rank (kernels/fused.py) on the rank's rows. The decoder block with its residual adds inside the products
(kernels/block.py) becomes a `TensorBlock`: rank 0 adds the residual inside o_proj's / down_proj's product as
before, the other ranks add none, and the all_sum of those partial sums is residual + the block's output.
Two all_sums per layer per forward, each of the hidden state ([B, L, D] floats).

`shard_mlx` is the other path: mlx-lm's own `model.shard(group)` (MLX's sharded linear layers, equal head splits
only); `use_kernels` then leaves the sharded products on MLX's quantized matmul (bench/distributed.py measures
both).
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import DistributedError
from ..kernels.block import KernelDecoderBlock
from ..kernels.rope import KernelRoPEAttention
from ..kernels.swiglu import KernelGatedMLP
from .group import Group

__all__ = ["AllSum", "TensorBlock", "TensorPlan", "add_all_sums", "model_layers", "shard_mlx", "shard_weights",
           "tensor_plan"]


def model_layers(model: nn.Module) -> list:
    """The decoder blocks of an mlx-lm model (model.model.layers, or model.layers).

    Raises:
        DistributedError: a model without a layers list.
    """
    inner = getattr(model, "model", None)
    for holder in (inner, model, getattr(model, "language_model", None)):
        layers = getattr(holder, "layers", None) if holder is not None else None
        if isinstance(layers, list) and layers:
            return layers
    raise DistributedError(f"{type(model).__module__} has no list of decoder layers; it cannot be sharded")


def _parts(layer: nn.Module) -> Tuple[nn.Module, nn.Module]:
    """(attention, MLP) of a decoder block with q/k/v/o and gate/up/down projections.

    Raises:
        DistributedError: another kind of block (mixture of experts, linear attention, ...).
    """
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "n_heads", "n_kv_heads")
    if attn is None or mlp is None or not all(hasattr(attn, n) for n in names) or \
            not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        raise DistributedError(f"tensor parallel takes llama-style blocks (q/k/v/o, gate/up/down); "
                               f"{type(layer).__module__} has others: use --parallel pipeline")
    return attn, mlp


def _align(layer: nn.Module) -> int:
    """The unit an input slice of `layer` must start on: its quantization group (1 for a float layer)."""
    return getattr(layer, "group_size", 1) if isinstance(layer, nn.QuantizedLinear) else 1


def _even(total: int, size: int, unit: int) -> List[int]:
    """Bounds [0, ..., total] splitting `total` into `size` parts of whole `unit`s, as even as possible."""
    units = total // unit
    return [min(total, unit * (units * r // size)) if r < size else total for r in range(size + 1)]


@dataclass
class TensorPlan:
    """What each rank holds: its KV heads [kv[r], kv[r+1]) (query heads: those times the group), and its
    intermediate rows [ffn[r], ffn[r+1])."""

    size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    kv: List[int]
    ffn: List[int]

    def heads(self, rank: int) -> Tuple[int, int]:
        """The rank's query heads [lo, hi)."""
        g = self.n_heads // self.n_kv_heads
        return self.kv[rank] * g, self.kv[rank + 1] * g


def tensor_plan(model: nn.Module, size: int) -> TensorPlan:
    """How `model`'s heads and MLP rows split over `size` ranks (the first layer's shapes; all must match).

    Raises:
        DistributedError: fewer KV heads than ranks, query heads that are not a whole number of groups per KV
            head, a slice of o_proj's or down_proj's input that does not start on a quantization group, or
            blocks tensor parallel does not take.
    """
    layers = model_layers(model)
    attn, mlp = _parts(layers[0])
    n_heads, n_kv = attn.n_heads, attn.n_kv_heads
    if n_kv < size or n_heads % n_kv:
        raise DistributedError(f"tensor parallel over {size} ranks needs at least {size} KV heads, each with the "
                               f"same number of query heads; this model has {n_heads} query and {n_kv} KV heads: "
                               f"use --parallel pipeline, or fewer ranks")
    q_rows = _rows(attn.q_proj)
    head_dim = q_rows // n_heads
    kv = [n_kv * r // size for r in range(size + 1)]
    g = n_heads // n_kv
    unit = _align(attn.o_proj)
    if any((k * g * head_dim) % unit for k in kv):
        raise DistributedError(f"tensor parallel over {size} ranks splits o_proj inside a quantization group "
                               f"(head_dim {head_dim}, group {unit}): use --parallel pipeline")
    ffn = _even(_rows(mlp.gate_proj), size, max(_align(mlp.down_proj), 1))
    if any(hi <= lo for lo, hi in zip(ffn, ffn[1:])):
        raise DistributedError(f"the MLP's {_rows(mlp.gate_proj)} rows do not split over {size} ranks: use "
                               "--parallel pipeline")
    for layer in layers[1:]:
        a, m = _parts(layer)
        if (a.n_heads, a.n_kv_heads, _rows(a.q_proj), _rows(m.gate_proj)) != (n_heads, n_kv, q_rows, ffn[-1]):
            raise DistributedError("tensor parallel takes models whose layers all have the same shapes; use "
                                   "--parallel pipeline")
    return TensorPlan(size, n_heads, n_kv, head_dim, kv, ffn)


def _rows(layer: nn.Module) -> int:
    """Output features of a Linear / QuantizedLinear."""
    return layer["weight"].shape[0]


def _keep_rows(layer: nn.Module, lo: int, hi: int) -> None:
    """Keep output rows [lo, hi) of a Linear / QuantizedLinear (weight, scales, biases, bias), in place."""
    for key in ("weight", "scales", "biases", "bias"):
        if key in layer and layer[key] is not None:
            layer[key] = mx.contiguous(layer[key][lo:hi])


def _keep_columns(layer: nn.Module, lo: int, hi: int, keep_bias: bool) -> None:
    """Keep input features [lo, hi) of a Linear / QuantizedLinear, in place (quantized: the packed words and
    the groups of those features; lo and hi on group bounds). The additive bias stays only when keep_bias."""
    if isinstance(layer, nn.QuantizedLinear):
        bits, gs = layer.bits, layer.group_size
        layer["weight"] = mx.contiguous(layer["weight"][:, lo * bits // 32:hi * bits // 32])
        for key in ("scales", "biases"):
            if layer.get(key) is not None:
                layer[key] = mx.contiguous(layer[key][:, lo // gs:hi // gs])
    else:
        layer["weight"] = mx.contiguous(layer["weight"][:, lo:hi])
    if "bias" in layer and not keep_bias:
        layer.pop("bias")


def shard_weights(model: nn.Module, plan: TensorPlan, rank: int) -> None:
    """Slice every block's projections to rank `rank`'s part of `plan` (module docstring), in place, and set
    each attention's n_heads / n_kv_heads to the rank's. Run on the mlx-lm model before use_kernels (lazy
    weights: only the slices are evaluated)."""
    q_lo, q_hi = plan.heads(rank)
    k_lo, k_hi = plan.kv[rank], plan.kv[rank + 1]
    f_lo, f_hi = plan.ffn[rank], plan.ffn[rank + 1]
    d = plan.head_dim
    for layer in model_layers(model):
        attn, mlp = _parts(layer)
        _keep_rows(attn.q_proj, q_lo * d, q_hi * d)
        _keep_rows(attn.k_proj, k_lo * d, k_hi * d)
        _keep_rows(attn.v_proj, k_lo * d, k_hi * d)
        _keep_columns(attn.o_proj, q_lo * d, q_hi * d, keep_bias=rank == 0)
        attn.n_heads, attn.n_kv_heads = q_hi - q_lo, k_hi - k_lo
        _keep_rows(mlp.gate_proj, f_lo, f_hi)
        _keep_rows(mlp.up_proj, f_lo, f_hi)
        _keep_columns(mlp.down_proj, f_lo, f_hi, keep_bias=rank == 0)


def shard_mlx(model: nn.Module, group: Group) -> None:
    """mlx-lm's own tensor sharding (`model.shard(group)`: MLX's sharded linear layers, which all_sum inside),
    for the models that have it.

    Raises:
        DistributedError: a model without `shard`, or heads that do not divide by the group size.
    """
    if not hasattr(model, "shard"):
        raise DistributedError(f"{type(model).__module__} has no shard(); use --parallel pipeline")
    attn, _ = _parts(model_layers(model)[0])
    if attn.n_heads % group.size or attn.n_kv_heads % group.size:
        raise DistributedError(f"mlx-lm's sharding needs heads divisible by {group.size}; this model has "
                               f"{attn.n_heads} query and {attn.n_kv_heads} KV heads")
    model.shard(group.group)


class AllSum(nn.Module):
    """A row-sharded projection followed by the all_sum of its partial outputs: x [..., K_r] -> [..., N]."""

    def __init__(self, layer: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.layer = layer
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.layer(x), group=self._group)


class TensorBlock(nn.Module):
    """A KernelDecoderBlock on sharded weights: x [B, L, D] -> [B, L, D] on every rank.

    Rank 0 adds the residual inside o_proj's and down_proj's products (kernels/block.py), the others add
    none, and an all_sum of the partial results follows each: h = all_sum(attn_r(norm(x)) (+ x on rank 0)),
    out = all_sum(mlp_r(norm(h)) (+ h on rank 0)). Same parameter names as the block it wraps."""

    def __init__(self, block: KernelDecoderBlock, group: mx.distributed.Group, root: bool):
        super().__init__()
        self.input_layernorm, self.self_attn = block.input_layernorm, block.self_attn
        self.post_attention_layernorm, self.mlp = block.post_attention_layernorm, block.mlp
        self.use_sliding = block.use_sliding
        self._group, self._root = group, root

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        xn = self.input_layernorm(x)  # [B, L, D]
        if type(self.self_attn) is KernelRoPEAttention:
            h = self.self_attn(xn, mask, cache, residual=x if self._root else None)
        else:
            h = self.self_attn(xn, mask, cache) + (x if self._root else 0)
        h = mx.distributed.all_sum(h, group=self._group)
        hn = self.post_attention_layernorm(h)
        if type(self.mlp) is KernelGatedMLP:
            out = self.mlp(hn, residual=h if self._root else None)
        else:
            out = self.mlp(hn) + (h if self._root else 0)
        return mx.distributed.all_sum(out, group=self._group)


def add_all_sums(model: nn.Module, group: Group) -> int:
    """After `shard_weights` and the kernels' swaps: each KernelDecoderBlock becomes a TensorBlock, and any
    other block gets its o_proj and down_proj wrapped in AllSum (its own residual adds then add the
    whole). Returns how many blocks were changed."""
    layers = model_layers(model)
    for i, block in enumerate(layers):
        if type(block) is KernelDecoderBlock:
            layers[i] = TensorBlock(block, group.group, group.is_root)
        else:
            attn, mlp = _parts(block)
            attn.o_proj = AllSum(attn.o_proj, group.group)
            mlp.down_proj = AllSum(mlp.down_proj, group.group)
    return len(layers)
