"""The parts of a target (an mlx-lm model) that block drafters borrow: its decoder-layer list, token
embedding and output head, and its sizes. Works for every mlx-lm model whose decoder layers are a
`.layers` list (GGUF files are converted to mlx-lm models, so those too)."""

from typing import Callable, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..errors import UnsupportedModelError


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
