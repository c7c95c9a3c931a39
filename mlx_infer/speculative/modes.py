"""The speculative options of a request (mode, draft model, max draft), validated once."""

from dataclasses import dataclass
from typing import Optional, Union

import mlx.nn as nn

from ..defaults import SPEC_MODEL_MODES as MODEL_MODES, SPEC_MODES as MODES
from ..errors import MlxInferError


@dataclass(frozen=True)
class DraftModel:
    """A draft model handed over as objects (what the Engine makes of a draft_model Engine).

    Attributes:
        model: the mlx-lm model.
        tokenizer: its tokenizer (checked against the target's once).
    """

    model: nn.Module
    tokenizer: object


def check_max_draft(max_draft) -> None:
    """Raise MlxInferError unless max_draft is "auto" or an int >= 0."""
    if max_draft == "auto":
        return
    if not isinstance(max_draft, int) or isinstance(max_draft, bool) or max_draft < 0:
        raise MlxInferError(f"max_draft must be 'auto' or an integer >= 0, got {max_draft!r}")


@dataclass(frozen=True)
class SpecOptions:
    """What a request asks of speculative decoding; the constructor validates.

    Attributes:
        mode: one of MODES ("off": plain decoding).
        draft_model: for "draft" / "auto": a model path or repo id (str), a DraftModel, or an mlx-lm model
            trusted to share the target's tokenizer; for "dflash" / "dspark": a drafter directory or repo id,
            a DFlashModel / DSparkModel, or a ready drafter; None: the mode's default.
        max_draft: draft tokens per round, an int >= 0, or "auto" (scheduled from measured costs).

    Raises:
        MlxInferError: an unknown mode, a bad max_draft, or a draft model given to a mode that uses none
            ("off", "lookup", "layerskip", "rmm").
    """

    mode: str = "off"
    draft_model: Optional[object] = None
    max_draft: Union[str, int] = "auto"

    def __post_init__(self):
        if self.mode not in MODES:
            raise MlxInferError(f"speculative must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_max_draft(self.max_draft)
        if self.draft_model is not None and self.mode not in MODEL_MODES:
            raise MlxInferError(f"speculative={self.mode!r} uses no draft model; drop draft_model or use one of "
                                f"{', '.join(MODEL_MODES)}")
        if self.mode == "draft" and self.draft_model is None:
            raise MlxInferError("speculative='draft' needs draft_model= (a smaller model with the same tokenizer)")

    @property
    def on(self) -> bool:
        """Whether the request decodes speculatively at all."""
        return self.mode != "off"
