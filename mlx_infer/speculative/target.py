"""The target of speculative decoding: `Target` (the model, its tokenizer and what measurements of it are
keyed by: `measurement_key`), and the parts of an mlx-lm model that block drafters borrow: its decoder-layer list, token
embedding and output head, and its sizes. Works for every mlx-lm model whose decoder layers are a
`.layers` list (GGUF files are converted to mlx-lm models, so those too)."""

from dataclasses import dataclass
from typing import Callable, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..backend import backend_name, blas_in_use
from ..errors import UnsupportedModelError
from ..kernels import cpu as cpu_kernels
from ..loading import ModelSource
from ..paths import model_fingerprint


@dataclass(frozen=True)
class Target:
    """The model speculative decoding verifies with, as the Engine hands it over.

    Attributes:
        model: the mlx-lm model.
        tokenizer: its mlx-lm TokenizerWrapper (vocab_size, encode, eos ids).
        key: what a measurement of this model on this machine depends on (model fingerprint, weights mode,
            backend, BLAS, kernels, MLX version): the disk-cache key of cost curves and priors.
        names: names that identify the model for the drafter registry (repo id, file and directory names).
        weights: the weights mode the model was loaded with ("auto", "native", "float32"): draft models
            named by path are loaded the same way.
    """

    model: nn.Module
    tokenizer: object
    key: str
    names: Tuple[str, ...] = ()
    weights: str = "auto"


def measurement_key(source: ModelSource) -> str:
    """What a timing of this model on this machine depends on (the disk-cache key of cost curves and
    priors): the model's content, not where it lies, its weights mode, the quantized-matmul kernel its layers
    run on and the build of the CPU kernels (any of which a model's layers may run), the backend, BLAS and
    MLX version, and the RMM retention of a reduced model."""
    build = cpu_kernels.build_id() if backend_name() == "cpu" else None
    key = (f"{model_fingerprint(source.mlx_dir)}|{source.weights}|{source.kernels}|{backend_name()}|"
           f"{blas_in_use()}|{mx.__version__}|{build}")  # type: ignore[attr-defined]  # not in MLX's stubs
    return key if source.rmm is None else f"{key}|rmm:{source.rmm}"


def _inner(model: nn.Module) -> nn.Module:
    """The module that owns `embed_tokens` and `layers` (mlx-lm: model.model, or model.language_model.model)."""
    for path in (("model",), ("language_model", "model"), ("language_model",), ()):
        m = model
        for name in path:
            m = m.get(name) if isinstance(m, nn.Module) else None
            if m is None:
                break
        if isinstance(m, nn.Module) and "embed_tokens" in m and isinstance(m.get("layers"), list):
            return m
    raise UnsupportedModelError(
        f"{type(model).__module__} models have no embed_tokens / layers list that a block drafter can use; "
        "use speculative='lookup'"
    )


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    """The target's decoder-layer list itself (mutable, the object the model iterates over).

    Raises:
        UnsupportedModelError: no such list.
    """
    return _inner(model)["layers"]


def embedding(model: nn.Module) -> nn.Module:
    """The target's token embedding: int ids [...] -> [..., H] (nn.Embedding or QuantizedEmbedding)."""
    return _inner(model)["embed_tokens"]


def output_head(model: nn.Module) -> Callable[[mx.array], mx.array]:
    """The target's lm_head: [..., H] -> [..., V] logits. A tied model (no lm_head) uses its embedding's
    `as_linear`, as mlx-lm does."""
    for owner in (model, model.get("language_model")):
        if isinstance(owner, nn.Module) and "lm_head" in owner:
            return owner["lm_head"]
    return embedding(model).as_linear


def dims(model: nn.Module) -> Tuple[int, int, int]:
    """(decoder layers, hidden size H, vocabulary rows V) of the target."""
    emb = embedding(model)
    hidden = int(emb(mx.array([0])).shape[-1])
    return len(decoder_layers(model)), hidden, int(emb.weight.shape[0])


def output_vocab(model: nn.Module) -> int:
    """Rows of the target's logits (its output vocabulary, padding included): the lm_head's (or tied
    embedding's) rows; for a model without those parts, the shape of a lazily built one-token forward
    (never evaluated)."""
    for owner in (model, model.get("language_model")):
        if isinstance(owner, nn.Module) and "lm_head" in owner and "weight" in owner["lm_head"]:
            return int(owner["lm_head"]["weight"].shape[0])
    try:
        return int(embedding(model)["weight"].shape[0])
    except UnsupportedModelError:
        return int(model(mx.zeros((1, 1), dtype=mx.uint32)).shape[-1])
