"""Pipeline parallelism: each rank runs a contiguous range of the layers, activations passed with send / recv.

    ranges = layer_ranges(30, 2)                # [(0, 15), (15, 30)]
    shard_pipeline(model, group)                # model.model becomes a PipelineStage of the rank's layers

Rank 0 runs the first layers; rank r receives the hidden state [B, L, D] from rank r - 1, runs its layers and
sends it to rank r + 1; the last rank's output reaches every rank with an all_gather (as mlx-lm's
`pipeline()` models do), so that every rank computes the same logits and stays in lockstep. A forward moves
B * L * D floats per link plus the all_gather (size * B * L * D), whatever the layer count: far fewer bytes
than tensor parallel's two all_sums per layer, so pipeline parallel is the one for slow links; it runs the
ranks one after another, so one request's decode gets no faster than on one machine (it fits a model
no single machine holds), where tensor parallel divides each step's weight reads.

Each rank holds only its layers' weights and KV cache (the other layers are dropped before the weights are
evaluated). The greedy output is the one of one process: each layer computes exactly what it computes
there, on the same inputs (send / recv copy the bytes).
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2, qwen3
from mlx_lm.models.base import create_attention_mask

from ..errors import DistributedError
from .group import Group

__all__ = ["PipelineStage", "layer_ranges", "shard_pipeline"]

#: Inner models whose forward is exactly embed -> layers (one causal mask) -> norm (PipelineStage's).
STAGE_MODELS = (llama.LlamaModel, qwen2.Qwen2Model, qwen3.Qwen3Model)


def layer_ranges(n_layers: int, size: int) -> List[Tuple[int, int]]:
    """Contiguous [lo, hi) layer ranges, one per rank, as even as possible (the first ranks take the extra).

    Raises:
        DistributedError: fewer layers than ranks.
    """
    if n_layers < size:
        raise DistributedError(f"pipeline parallel over {size} ranks needs at least {size} layers; the model has "
                               f"{n_layers}: use fewer ranks")
    base, extra = divmod(n_layers, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds, bounds[1:]))


class PipelineStage(nn.Module):
    """The inner model (embed_tokens, layers, norm) of one rank: inputs [B, L] -> the normed hidden state
    [B, L, D] of the whole model, on every rank. Holds the rank's layers only; `embed_tokens` and `norm` are
    the model's (every rank embeds, for the shape and dtype of what it receives, and computes the logits).

    Args:
        inner: an mlx-lm inner model of STAGE_MODELS.
        lo, hi: the rank's layer range.
        group: the Group (rank, size, the mx group).
    """

    def __init__(self, inner: nn.Module, lo: int, hi: int, group: Group):
        super().__init__()
        self.embed_tokens, self.norm = inner.embed_tokens, inner.norm
        self.layers = inner.layers[lo:hi]
        self.first_layer = lo
        self._group, self._rank, self._size = group.group, group.rank, group.size
        self._dtypes: Optional[Tuple[mx.Dtype, mx.Dtype]] = None  # (what this rank receives, the last rank's output)

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: Optional[mx.array] = None) -> mx.array:
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)  # [B, L, D]
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        if self._dtypes is None:
            self._dtypes = self._agree_dtypes(h, mask)
        received, last = self._dtypes
        if self._rank > 0:
            h = mx.distributed.recv_like(h.astype(received), self._rank - 1, group=self._group)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        if self._rank < self._size - 1:
            h = mx.distributed.send(h, self._rank + 1, group=self._group)
        B = h.shape[0]
        h = mx.distributed.all_gather(h.astype(last), group=self._group)[-B:]  # the last rank's, [B, L, D]
        return self.norm(h)

    def _agree_dtypes(self, h: mx.array, mask) -> Tuple[mx.Dtype, mx.Dtype]:
        """The dtype of the hidden state each link carries, agreed on the first forward: the layers may
        change it (the CPU kernels' products are float32 on float16 weights), and a receiver must know what
        its sender's layers give. Rank r receives rank r - 1's dtype, finds its own layers' output dtype from
        their lazy graph (nothing evaluated) and sends it on; the last rank's reaches every rank (int32
        all_sum). (What this rank receives, the last rank's output dtype)."""
        received = h.dtype
        if self._rank > 0:
            code = mx.distributed.recv_like(mx.zeros((1,), dtype=mx.int32), self._rank - 1, group=self._group)
            received = _DTYPES[int(code.item())]
        probe = h.astype(received)
        for layer in self.layers:
            probe = layer(probe, mask, None)  # (lazy: only its dtype is read)
        out = _DTYPES.index(probe.dtype)
        if self._rank < self._size - 1:
            mx.eval(mx.distributed.send(mx.array([out], dtype=mx.int32), self._rank + 1, group=self._group))
        mine = out if self._rank == self._size - 1 else 0
        last = mx.distributed.all_sum(mx.array([mine], dtype=mx.int32), group=self._group)
        return received, _DTYPES[int(last.item())]


#: The dtypes a hidden state can have, by the code the ranks exchange.
_DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _inner(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None:
        raise DistributedError(f"{type(model).__module__} has no inner model; pipeline parallel cannot split it")
    return inner


def check_pipeline(model: nn.Module, size: int) -> None:
    """Raise DistributedError when `model` cannot be pipelined over `size` ranks (an inner model other than
    STAGE_MODELS, a llama with sliding-window layers, fewer layers than ranks)."""
    inner = _inner(model)
    if type(inner) not in STAGE_MODELS or getattr(inner, "swa_idx", None) is not None:
        raise DistributedError(f"pipeline parallel takes llama / qwen2 / qwen3 models; {type(model).__module__} "
                               "is not one: use --parallel tensor")
    layer_ranges(len(inner.layers), size)


def shard_pipeline(model: nn.Module, group: Group) -> Tuple[int, int]:
    """Replace `model.model` by the rank's PipelineStage, in place (before the weights are evaluated: the
    other layers are never loaded). Returns the rank's layer range.

    Raises:
        DistributedError: as check_pipeline.
    """
    check_pipeline(model, group.size)
    inner = _inner(model)
    lo, hi = layer_ranges(len(inner.layers), group.size)[group.rank]
    model.model = PipelineStage(inner, lo, hi, group)
    return lo, hi
