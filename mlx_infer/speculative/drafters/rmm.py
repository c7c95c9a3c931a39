"""RMM self-drafting: the target with its linear layers reduced (RMM, arXiv 2608.13426) drafts, the full
target verifies. Lossless (the verify loop is exact for the full model) and training-free; the drafting
pass shares every weight with the target and has its own KV cache."""

from typing import Optional

import mlx.nn as nn

from ...errors import MlxInferError
from ...rmm.apply import reduced_view
from ...rmm.defaults import RMM_DRAFT
from ...rmm.layers import RmmLinear, RmmQuantizedLinear
from ...rmm.options import Retention, parse_rmm
from .draft_model import DraftModelDrafter


class RmmDrafter(DraftModelDrafter):
    """Drafts with `reduced_view(model, retention)`.

    Args:
        model: the target (mlx-lm model).
        retention: the drafter's retention (None: rmm.defaults.RMM_DRAFT).

    Raises:
        MlxInferError: a retention that reduces nothing in this model (no layer the kernels take).
    """

    name = "rmm"

    def __init__(self, model: nn.Module, retention: Optional[Retention] = None):
        retention = retention or parse_rmm(RMM_DRAFT)
        view = reduced_view(model, retention)
        if not any(isinstance(m, (RmmLinear, RmmQuantizedLinear)) for m in view.modules()):
            raise MlxInferError(f"RMM drafting ({retention}) reduces no layer of this model (it needs affine "
                                "4/8-bit quantized or float linear layers); use speculative='lookup'")
        super().__init__(view, ident=f"rmm:{retention}")
        self.retention = retention

