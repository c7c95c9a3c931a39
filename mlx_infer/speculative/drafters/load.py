"""Build a DFlash or DSpark drafter for an Engine's target from what the user gave (speculative="dflash" /
"dspark", draft_model=...)."""

from ...errors import MlxInferError
from .base import Drafter


def block_drafter(mode: str, engine, source) -> Drafter:
    """The block drafter of `mode` for engine.model.

    Args:
        mode: "dflash" or "dspark".
        engine: the target Engine (DSpark: its verify cost curve is measured once and cached on disk).
        source: a drafter directory or HF repo id (str / Path), a DFlashModel / DSparkModel, a ready
            Drafter (returned as is), or None: the target's registered drafter of this kind (registry.py).

    Raises:
        MlxInferError: no source and none registered, a malformed checkpoint, or a drafter that does not fit
            the target.
    """
    from .checkpoint import checkpoint_ident, resolve_dir
    from .dflash import DFlashDrafter, DFlashModel, load_dflash_model
    from .dspark import DSparkDrafter, DSparkModel, load_dspark_model

    if source is None:
        from ..registry import registered_drafter

        drafter = registered_drafter(engine, kinds=(mode,))
        if drafter is None:
            raise MlxInferError(f"no {mode} drafter is known for this model; pass --draft-model "
                                f"(a {mode} drafter directory or repo id; train one with mlx-infer train-drafter)")
        return drafter
    if isinstance(source, Drafter):
        return source
    ident = None
    if not isinstance(source, (DFlashModel, DSparkModel)):
        # loaded once per engine and path: a chat loads its drafter at the first turn, not at every turn
        loaded = engine.__dict__.setdefault("_drafter_models", {})
        key = (mode, str(source))
        if key not in loaded:
            directory = resolve_dir(source)
            model = (load_dflash_model if mode == "dflash" else load_dspark_model)(directory)
            loaded[key] = (model, f"{mode}:{checkpoint_ident(directory)}")
        source, ident = loaded[key]
    if mode == "dflash":
        drafter = DFlashDrafter(source, engine.model)
    else:
        from ..confidence import ConfidenceSchedule
        from ..schedule import cost_curve

        drafter = DSparkDrafter(source, engine.model)  # checks the fit before any timing
        if source.has_confidence:
            drafter.schedule = ConfidenceSchedule(curve=cost_curve(engine, source.block_size + 1))
    drafter.ident = ident  # what its calibration prior is cached under (prior.block_prior)
    return drafter
