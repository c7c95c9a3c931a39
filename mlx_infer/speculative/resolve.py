"""From what a request names to drafters: draft models by path or repo id, block-drafter checkpoints, and
the target's registered drafter (registry.py). Loading and checking only; the Engine's SpecState
(state.py) keeps what was loaded, so that each is loaded once per target."""

import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence, Tuple

import mlx.nn as nn

from ..errors import MlxInferError
from ..loading import load_model
from ..loading.hub import download_repo
from .confidence import ConfidenceSchedule
from .cost import CostCurve
from .drafters.backbone import Backbone
from .drafters.block import BlockDrafter
from .drafters.checkpoint import checkpoint_ident, resolve_dir
from .drafters.dflash import DFlashDrafter, load_dflash_model
from .drafters.draft_model import check_same_vocab
from .drafters.dspark import DSparkDrafter, DSparkModel, load_dspark_model
from .registry import registered
from .target import Target

#: The block-drafter modes.
BLOCK_MODES = ("dflash", "dspark")


def load_draft_model(source: str, target: Target) -> nn.Module:
    """A draft model named by path or repo id, loaded as the target was (its weights mode), with its
    tokenizer checked against the target's.

    Raises:
        MlxInferError: not found, not loadable, or a different vocabulary.
    """
    net, tokenizer, _, _ = load_model(source, weights=target.weights)
    check_same_vocab(target.tokenizer, tokenizer)
    return net


def load_block_model(mode: str, source) -> Tuple[Backbone, str]:
    """(DFlashModel or DSparkModel, its identity "mode:<checkpoint ident>") from a directory or repo id.

    Raises:
        MlxInferError: no such directory / repo, or a malformed checkpoint.
    """
    directory = resolve_dir(source)
    model = (load_dflash_model if mode == "dflash" else load_dspark_model)(directory)
    return model, f"{mode}:{checkpoint_ident(directory)}"


def block_drafter(model: Backbone, target: Target, ident: Optional[str] = None,
                  curve: Optional[CostCurve] = None) -> BlockDrafter:
    """The drafter of a loaded block model for the target: DFlash, or DSpark with its confidence schedule on
    the target's cost curve (arXiv 2602.06036; DeepSpec's Algorithm 1).

    Raises:
        MlxInferError: the drafter does not fit the target (hidden size, vocabulary, taps).
    """
    if isinstance(model, DSparkModel):
        schedule = ConfidenceSchedule(curve=curve) if model.has_confidence else None
        return DSparkDrafter(model, target.model, schedule, ident)
    return DFlashDrafter(model, target.model, ident)


def registered_sources(target: Target, kinds: Sequence[str] = BLOCK_MODES,
                       registry: Optional[Path] = None) -> Iterator[Tuple[str, str]]:
    """(kind, local directory) of each registered drafter for the target that is on this machine: shipped
    with the package, or a published one already in the Hugging Face cache (never downloaded here).
    registry: a registry.json to read instead of the installed one."""
    for entry in registered(target.names, registry):
        kind = entry.get("kind")
        if kind not in kinds:
            continue
        if "path" in entry:
            yield kind, entry["path"]
            continue
        try:
            yield kind, str(download_repo(entry["repo"], local_only=True))
        except (MlxInferError, KeyError):
            continue  # not downloaded: nothing to say


def warn_broken(kind: str, source: str, error: Exception) -> None:
    """One warning line for a registered drafter that is present but does not load or fit."""
    warnings.warn(f"the registered {kind} drafter {source} cannot be used ({error}); drafting without it",
                  stacklevel=3)
