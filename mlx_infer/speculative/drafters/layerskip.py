"""Self-speculative layer skip (Draft & Verify, arXiv 2309.08168): the target, with a subset of its
decoder layers skipped, drafts for itself. No extra weights; the drafting pass has its own KV cache
for the layers it keeps.

Which layers to skip is found by a short calibration (a few forwards over a fixed text): each candidate
skip set is scored by how often its next-token argmax agrees with the full model's, weighed against the
fraction of layers it still runs. The choice is cached per model under the user cache dir.
"""

import copy
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ...errors import MlxInferError
from ...paths import cached_json
from ..calibrate import CALIBRATION_TEXT, agreement
from ..target import Target
from .draft_model import DraftModelDrafter

#: Draft length assumed when candidate skip sets are compared.
CALIBRATION_GAMMA = 4


def skip_view(model: nn.Module, keep: Sequence[int]) -> nn.Module:
    """A shallow copy of an mlx-lm model that runs only the decoder layers in `keep` (shared weights).

    Raises:
        MlxInferError: a model whose layer stack cannot be subset (custom per-layer caches).
    """
    unsupported = MlxInferError(
        f"layer-skip drafting does not support {type(model).__module__} models (their cache layout is tied to "
        "the layer count); use speculative='lookup'"
    )
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), list):
        raise unsupported
    view_inner = copy.copy(inner)
    view_inner.layers = [inner.layers[i] for i in keep]
    view = copy.copy(model)
    view.model = view_inner
    if len(make_prompt_cache(view)) != len(keep):
        raise unsupported
    return view


def candidate_skips(n_layers: int) -> List[List[int]]:
    """Skip sets to try: strided and contiguous runs of middle layers (first and last layers always kept,
    as Draft & Verify finds them the most important)."""
    lo, hi = max(1, n_layers // 6), n_layers - max(1, n_layers // 6)
    middle = list(range(lo, hi))
    out = [middle[::2], middle[1::2], middle[::3], middle[: len(middle) // 2], middle[len(middle) // 4 : 3 * len(middle) // 4]]
    return [sorted(s) for s in out if s]


def calibrate(model: nn.Module, tokenizer) -> List[int]:
    """The skip set with the best expected tokens per unit of drafting + verify time, over candidate_skips.

    Score of a candidate with agreement a, keeping r of the layers, drafting g = CALIBRATION_GAMMA tokens:
    (1 + a + ... + a^g) / (g * r + 1), the +1 being one (cheap-width) verify forward.
    """
    n_layers = len(model.layers)
    tokens = mx.array(tokenizer.encode(CALIBRATION_TEXT))[None]
    best, best_score = [], 0.0
    for skip in candidate_skips(n_layers):
        keep = [i for i in range(n_layers) if i not in skip]
        a = agreement(model, skip_view(model, keep), tokens)
        r = len(keep) / n_layers
        score = sum(a**j for j in range(CALIBRATION_GAMMA + 1)) / (CALIBRATION_GAMMA * r + 1)
        if score > best_score:
            best, best_score = skip, score
    return best


def cached_skip_set(target: Target, say: Optional[Callable[[str], None]] = None) -> List[int]:
    """The calibrated skip set of the target, from the disk cache or calibrated once and saved
    (say: called with a one-line message before a calibration)."""
    data = cached_json("layerskip", target.key, lambda: {"skip": calibrate(target.model, target.tokenizer)},
                       say=say, message="calibrating which layers layerskip skips")
    return [int(i) for i in data["skip"]]


class LayerSkipDrafter(DraftModelDrafter):
    """Drafts with the target itself minus the layers in `skip` (Draft & Verify, arXiv 2309.08168).

    Args:
        model: the target (mlx-lm model).
        skip: decoder layer indices to skip while drafting.
    """

    name = "layerskip"

    def __init__(self, model: nn.Module, skip: Sequence[int]):
        keep = [i for i in range(len(model.layers)) if i not in set(skip)]
        super().__init__(skip_view(model, keep), ident=f"layerskip:{sorted(skip)}")
        self.skip = list(skip)
