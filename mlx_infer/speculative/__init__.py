"""Speculative decoding: everything that makes decoding faster without changing the output.

    verify.py     pure accept/reject (greedy; exact speculative sampling, arXiv 2211.17192 / 2302.01318)
    loop.py       one round: draft -> one target forward -> verify -> commit -> KV rollback
    drafters/     the Drafter interface; lookup (arXiv 2311.03511), draft_model, layerskip,
                  dflash (arXiv 2602.06036) and dspark (block drafters fed the target's hidden states)
    capture.py    taps of the target's decoder-layer outputs for the block drafters
    confidence.py DSpark's confidence-scheduled verify length
    schedule.py   the draft length per round (max_draft="auto")
    prior.py      what a model drafter is worth before a request (a calibration, cached)

`token_source` builds the token iterator the Engine consumes in place of plain decoding.
"""

from typing import Callable, Iterator, List, Optional, Union

from mlx_lm.models.cache import make_prompt_cache

from ..defaults import DEFAULT_MAX_DRAFT
from ..errors import MlxInferError
from ..generation.decode import plain_tokens
from .drafters import Drafter, DraftModelDrafter, LookupDrafter, check_same_vocab, cut_draft_model
from .drafters.block import BlockDrafter
from .drafters.hybrid import LookupThenBlock
from .loop import SpecStats, check_rollback, speculative_tokens
from .schedule import DraftScheduler, cost_curve, speculation_pays

MODES = ("off", "auto", "lookup", "draft", "layerskip", "dflash", "dspark")

#: The modes that draft with a model given as draft_model (the others draft from the context or the target).
MODEL_MODES = ("auto", "draft", "dflash", "dspark")

__all__ = ["MODES", "MODEL_MODES", "SpecStats", "speculative_tokens", "token_source", "make_drafter",
           "cut_draft_model", "prepare", "check_max_draft", "check_draft_model", "Drafter", "LookupDrafter",
           "DraftModelDrafter"]


def check_max_draft(max_draft) -> None:
    """Raise MlxInferError unless max_draft is "auto" or an int >= 0."""
    if max_draft == "auto":
        return
    if not isinstance(max_draft, int) or isinstance(max_draft, bool) or max_draft < 0:
        raise MlxInferError(f"max_draft must be 'auto' or an integer >= 0, got {max_draft!r}")


def check_draft_model(mode: str, draft_model) -> None:
    """Raise MlxInferError when a draft model is given to a mode that would not use it (off, lookup,
    layerskip), rather than ignore it or load it for nothing."""
    if draft_model is not None and mode not in MODEL_MODES:
        raise MlxInferError(f"speculative={mode!r} uses no draft model; drop draft_model or use one of "
                            f"{', '.join(MODEL_MODES)}")


def make_drafter(mode: str, engine, draft_model=None) -> Drafter:
    """The drafter for a mode.

    Args:
        mode: "lookup", "draft", "layerskip" (arXiv 2309.08168), "dflash", "dspark" or "auto" (a draft model
            when one is given; else lookup backed by the target's registered drafter (registry.py,
            drafters/hybrid.py) when it is available locally and its calibration prior says it can pay on
            this machine (prior.block_pays, measured once and cached); else lookup).
        engine: the target Engine (its tokenizer is checked against a draft model's).
        draft_model: for "draft": a model path / repo id (str), an Engine, or an mlx-lm nn.Module that shares
            the target's tokenizer (trusted as is). For "dflash" / "dspark": a drafter directory or repo id,
            a DFlashModel / DSparkModel, or a ready drafter.

    Raises:
        MlxInferError: unknown mode, a missing or incompatible draft model, a draft model the mode does not use.
    """
    if mode not in MODES or mode == "off":
        raise MlxInferError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
    check_draft_model(mode, draft_model)
    if mode == "auto" and draft_model is None:
        return _auto_drafter(engine)
    if mode == "lookup" and draft_model is None:
        return LookupDrafter()
    if mode == "layerskip":
        from .drafters.layerskip import LayerSkipDrafter, cached_skip_set

        return LayerSkipDrafter(engine.model, cached_skip_set(engine))
    if mode in ("dflash", "dspark"):
        from .drafters.load import block_drafter

        return block_drafter(mode, engine, draft_model)
    if mode == "auto":
        mode = "draft"
    if draft_model is None:
        raise MlxInferError("speculative='draft' needs draft_model= (a smaller model with the same tokenizer)")
    from ..engine import Engine

    if isinstance(draft_model, str):  # loaded and checked once per target Engine
        cache = engine.__dict__.setdefault("_draft_engines", {})
        if draft_model not in cache:
            from .. import load

            loaded = load(draft_model, weights=engine.source.weights)
            check_same_vocab(engine.tokenizer, loaded.tokenizer)
            cache[draft_model] = loaded
        return DraftModelDrafter(cache[draft_model].model)
    if isinstance(draft_model, Engine):
        check_same_vocab(engine.tokenizer, draft_model.tokenizer)
        draft_model = draft_model.model
    return DraftModelDrafter(draft_model)


def _auto_drafter(engine, say: Optional[Callable[[str], None]] = None) -> Drafter:
    """auto without a draft model: lookup backed by the target's registered block drafter when one is
    available locally and its calibration prior says it can pay (prior.block_pays), else lookup alone.
    say: gets a line before a measurement (the cost curve, the drafter's prior)."""
    from .prior import block_pays
    from .registry import registered_drafter

    block = registered_drafter(engine)
    return LookupThenBlock(block) if block is not None and block_pays(engine, block, say) else LookupDrafter()


def token_source(engine, prompt_ids: List[int], params, max_tokens: int, speculative: str,
                 draft_model=None, max_draft: Union[str, int] = "auto",
                 stats: Optional[SpecStats] = None) -> Iterator[int]:
    """The speculative token iterator the Engine uses in place of plain decoding (same tokens / same
    distribution). Arguments as `Engine.stream_steps`; raises MlxInferError for bad arguments before any
    forward pass."""
    check_max_draft(max_draft)
    drafter = make_drafter(speculative, engine, draft_model)
    stats = stats if stats is not None else SpecStats()
    if speculative == "auto":
        bound = DEFAULT_MAX_DRAFT if max_draft == "auto" else max_draft
        try:
            check_rollback(make_prompt_cache(engine.model), len(prompt_ids) + max_tokens + bound)
        except MlxInferError:  # "auto" never fails: a cache that cannot roll back decodes plainly
            stats.mode = "off"
            return plain_tokens(engine.model, prompt_ids, params, max_tokens)
    block = getattr(drafter, "max_draft", None)  # block drafters: at most one block per round
    if max_draft == "auto" and getattr(drafter, "schedule", None) is not None:
        max_draft = block  # DSpark: its confidence schedule cuts the block
    if max_draft != "auto":
        return speculative_tokens(engine.model, prompt_ids, params, max_tokens, drafter, max_draft, stats)
    limit = block or DEFAULT_MAX_DRAFT
    curve = cost_curve(engine, limit + 1)
    if not speculation_pays(curve, limit):
        stats.mode = "off"  # verifying several tokens costs as much as decoding them one by one here
        return plain_tokens(engine.model, prompt_ids, params, max_tokens)
    scheduler = _scheduler(engine, speculative, draft_model, drafter, curve, limit, params, block is not None)
    if hasattr(drafter, "worth_drafting"):
        drafter.worth_drafting = scheduler.worth
    return speculative_tokens(engine.model, prompt_ids, params, max_tokens, drafter, scheduler, stats,
                              observe=scheduler.observe)


def _drafter_ident(speculative: str, draft_model, drafter) -> Optional[str]:
    """A stable name of a model drafter for the disk cache of its prior (None: a model object)."""
    if speculative == "layerskip":
        return f"layerskip:{sorted(drafter.skip)}"
    return f"draft:{draft_model}" if isinstance(draft_model, str) else None


def _scheduler(engine, speculative: str, draft_model, drafter: Drafter, curve, limit: int, params,
               per_round: bool) -> DraftScheduler:
    """The DraftScheduler of a request: the one this engine used last time for the same drafter, sampling
    kind and draft limit (what it learned carries over), else a new one; a new scheduler of a model drafter
    starts from its calibration prior (prior.py)."""
    key = (speculative, draft_model if isinstance(draft_model, (str, type(None))) else id(draft_model), limit,
           params.greedy)
    memory = engine.__dict__.setdefault("_schedulers", {})
    scheduler = memory.get(key)
    if scheduler is not None:
        scheduler.new_request()
        return scheduler
    prior = None
    if isinstance(drafter, DraftModelDrafter):
        from .prior import drafter_prior

        prior = drafter_prior(engine, drafter.model, _drafter_ident(speculative, draft_model, drafter))
    elif isinstance(drafter, BlockDrafter):
        from .prior import block_prior

        prior = block_prior(engine, drafter)
    scheduler = DraftScheduler(curve, limit, free=drafter.free, per_round=per_round, prior=prior)
    memory[key] = scheduler
    return scheduler


def prepare(engine, speculative: str, max_draft: Union[str, int] = "auto",
            say: Optional[Callable[[str], None]] = None, draft_model=None) -> None:
    """Measure now, once per model and machine, what a speculative request would otherwise measure on its
    first run (the verify cost curve and a model drafter's prior for max_draft="auto"; layerskip's
    calibration), so that the first request's TTFT does not include them. All are cached on disk; `say`
    gets a line before each measurement.
    """
    if speculative in (None, "off"):
        return
    if speculative == "layerskip":
        from .drafters.layerskip import cached_skip_set

        cached_skip_set(engine, say)
    if speculative == "auto" and draft_model is None:
        _auto_drafter(engine, say)
    if max_draft == "auto":
        cost_curve(engine, DEFAULT_MAX_DRAFT + 1, say)
        if speculative == "layerskip" or (speculative in ("draft", "auto") and isinstance(draft_model, str)):
            from .prior import drafter_prior

            drafter = make_drafter(speculative, engine, draft_model)
            drafter_prior(engine, drafter.model, _drafter_ident(speculative, draft_model, drafter), say)
        elif speculative == "dflash":
            from .prior import block_prior

            block_prior(engine, make_drafter(speculative, engine, draft_model), say)
