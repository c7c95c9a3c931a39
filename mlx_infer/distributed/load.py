"""A rank's shard of a model: `load_sharded`, the distributed twin of loading.load_model.

    group = init_group("ring")
    shard = load_sharded(None, group, parallel="auto")   # shard.model: this rank's part, collectives inside

Order on every rank: rank 0 resolves the model first (a GGUF converts once into a shared cache while the
others wait), then each rank loads it lazily, compares the model files' digest with every other rank
(digest.py), checks the split and shards before any weight is read, evaluates only its own weights, swaps in
the CPU kernels (loading.load_model), and adds the all_sums (tensor parallel). Any check that fails, fails on
every rank with the same line, since every rank decides from the same files.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import mlx.nn as nn

from ..errors import MlxInferError
from ..loading import ModelSource, load_model, resolve
from .defaults import PARALLEL_MODES
from .digest import check_same_model, model_digest
from .group import Group, broadcast_ints
from .pipeline import check_pipeline, shard_pipeline
from .tensor import add_all_sums, model_layers, shard_mlx, shard_weights, tensor_plan

__all__ = ["Shard", "choose_parallel", "load_sharded"]

#: Tensor parallel's layers: "kernels" (the weights sliced, then mlx-infer's CPU kernel layers, fused
#: q/k/v and gate/up, residual adds in the products on rank 0) or "mlx" (mlx-lm's shard(): MLX's layers).
TENSOR_LAYERS = ("kernels", "mlx")


@dataclass
class Shard:
    """A rank's part of a model.

    Attributes:
        model, tokenizer, config, source: as loading.load_model's (model: this rank's shard).
        group: the Group. parallel: "tensor", "pipeline", or "none" (size 1).
        detail: what the rank holds, for messages ("layers 0-14 of 30", "6 of 9 query heads, ...").
    """

    model: nn.Module
    tokenizer: object
    config: dict
    source: ModelSource
    group: Group
    parallel: str
    detail: str = ""


def choose_parallel(model: nn.Module, size: int) -> str:
    """The default mode: tensor parallel when the query and KV heads divide evenly by the group size (each
    rank then does the same work), else pipeline parallel (which any llama / qwen model with at least
    `size` layers takes)."""
    try:
        plan = tensor_plan(model, size)
    except MlxInferError:
        return "pipeline"
    return "tensor" if plan.n_kv_heads % size == 0 else "pipeline"


def _prepare(group: Group, parallel: str, layers: str, out: dict) -> Callable[[nn.Module, dict, ModelSource], None]:
    def prepare(net: nn.Module, config: dict, source: ModelSource) -> None:
        check_same_model(group, model_digest(source.mlx_dir))
        mode = choose_parallel(net, group.size) if parallel == "auto" else parallel
        if mode == "tensor" and layers == "mlx":
            shard_mlx(net, group)
            out["detail"] = "mlx-lm's shard()"
        elif mode == "tensor":
            plan = tensor_plan(net, group.size)
            shard_weights(net, plan, group.rank)
            lo, hi = plan.heads(group.rank)
            out["detail"] = (f"query heads {lo}-{hi - 1} of {plan.n_heads}, MLP rows "
                             f"{plan.ffn[group.rank]}-{plan.ffn[group.rank + 1] - 1} of {plan.ffn[-1]}")
        else:
            check_pipeline(net, group.size)
            n = len(model_layers(net))
            lo, hi = shard_pipeline(net, group)
            out["detail"] = f"layers {lo}-{hi - 1} of {n}"
        out["mode"] = mode

    return prepare


def load_sharded(model: Optional[str], group: Group, parallel: str = "auto", weights: str = "auto",
                 progress: Optional[Callable[[int, int, str], None]] = None, layers: str = "kernels") -> Shard:
    """Load this rank's shard of `model` (see the module docstring).

    Args:
        model: as mlx_infer.load (None: the embedded default).
        group: the Group (size 1: the whole model, parallel "none").
        parallel: "auto" (choose_parallel), "tensor" or "pipeline".
        weights, progress: as mlx_infer.load.
        layers: tensor parallel's layers, one of TENSOR_LAYERS.

    Raises:
        MlxInferError: an unknown mode, as load_model.
        DistributedError: the files differ between ranks, a model that does not split (tensor.tensor_plan,
            pipeline.check_pipeline), a peer lost.
    """
    if parallel not in PARALLEL_MODES:
        raise MlxInferError(f"unknown --parallel {parallel!r}; use one of {', '.join(PARALLEL_MODES)}")
    if layers not in TENSOR_LAYERS:
        raise MlxInferError(f"unknown tensor-parallel layers {layers!r}; use one of {', '.join(TENSOR_LAYERS)}")
    if group.size == 1:
        net, tokenizer, config, source = load_model(model, weights=weights, progress=progress)
        return Shard(net, tokenizer, config, source, group, "none", "the whole model")
    if group.is_root:
        resolve(model, progress)  # (a GGUF's conversion, written once into the cache the ranks may share)
    broadcast_ints(group, [1], 1, "the go-ahead after rank 0 found the model")
    out: dict = {}
    net, tokenizer, config, source = load_model(model, weights=weights, progress=progress if group.is_root else None,
                                                prepare=_prepare(group, parallel, layers, out))
    if out["mode"] == "tensor" and layers == "kernels":
        add_all_sums(net, group)
    return Shard(net, tokenizer, config, source, group, out["mode"], out.get("detail", ""))

