"""What speculative decoding keeps per target model: `SpecState`, owned by the Engine.

It holds the draft models and block drafters loaded for the target (each loaded once), the cost curves
and calibration priors (measured once per model and machine and cached on disk by cost.py / calibrate.py,
memoized here), the target's compiled verify forwards (whose traces serve every request), and turns a
request's validated SpecOptions into a token iterator: choose the drafter, choose the draft-length policy,
run the loop.
"""

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..defaults import DEFAULT_MAX_DRAFT, MAX_VERIFY_WIDTH
from ..errors import MlxInferError
from ..generation.compiled import CompiledDecode, module_fingerprint
from ..generation.logprobs import LogprobQueue
from ..generation.sampling import SamplingParams
from ..structured.grammar import GrammarState
from .calibrate import cached_drafter_prior, drafter_prior
from .cost import CostCurve, NotMeasuredError, cached_cost_curve, cost_curve
from .drafters.base import Drafter
from .drafters.block import BlockDrafter
from .drafters.draft_model import DraftModelDrafter, check_same_vocab
from .drafters.hybrid import LookupThenBlock
from .drafters.layerskip import LayerSkipDrafter, cached_skip_set
from .drafters.rmm import RmmDrafter
from .drafters.lookup import LookupDrafter
from .loop import SpecStats, check_rollback, speculative_tokens
from .modes import DraftModel, SpecOptions
from .resolve import (BLOCK_MODES, block_drafter, load_block_model, load_draft_model, registered_sources,
                      warn_broken)
from .schedule import DraftPolicy, DraftScheduler, FixedGamma, drafter_pays, speculation_pays
from .target import Target

Say = Optional[Callable[[str], None]]

#: Drafters that run a model and so have a calibration prior (calibrate.py).
MODEL_DRAFTERS = (DraftModelDrafter, BlockDrafter)


class SpecState:
    """Speculative decoding's per-model state (see the module docstring).

    Args:
        target: the Target (model, tokenizer, measurement key, registry names, weights mode).
        registry: a registry.json to read instead of the installed one (tests).

    Attributes:
        defer_measurements: False (the default): a request measures what it needs and is not cached yet (the
            cost curve, a drafter's prior) before it decodes. True: a speculative="auto" request that would
            measure decodes plainly instead (its stats' mode "off"); `prepare` takes the measurements later.
    """

    def __init__(self, target: Target, registry: Optional[Path] = None):
        self.target = target
        self.registry = registry
        self._draft_models: Dict[str, nn.Module] = {}  # path / repo id -> loaded draft model
        self._block_models: Dict[Tuple[str, str], tuple] = {}  # (mode, path) -> (Backbone, ident)
        self._registered: Dict[str, Optional[tuple]] = {}  # mode -> (Backbone, ident) or None
        self._auto_block: Optional[str] = None  # the registered mode auto backs lookup with ("" for none)
        self._curves: Dict[int, CostCurve] = {}
        self._priors: Dict[str, object] = {}
        self._object_priors: List[Tuple[nn.Module, object]] = []  # (model object, prior): ident-less drafters
        self._skip: Optional[List[int]] = None
        self._forward: Optional[Tuple[tuple, CompiledDecode]] = None  # (module fingerprint, compiled forwards)
        self.defer_measurements = False
        self._cached_only = False  # True: curve / prior read the disk cache, NotMeasuredError when it lacks them

    def forward(self) -> CompiledDecode:
        """The target's forwards of up to MAX_VERIFY_WIDTH tokens as compiled graphs (generation/compiled.py),
        kept while its modules stay the same: the loop's rounds and the cost curve run them."""
        fingerprint = module_fingerprint(self.target.model)
        if self._forward is None or self._forward[0] != fingerprint:
            self._forward = (fingerprint, CompiledDecode(self.target.model, MAX_VERIFY_WIDTH))
        return self._forward[1]

    # -- measurements (memoized; cached on disk below) ------------------------------------------------

    @contextmanager
    def _only_cached(self, on: bool = True) -> Iterator[None]:
        """Within: (when `on`) curve and prior take what is memoized or on disk, and raise NotMeasuredError
        where they would measure."""
        before, self._cached_only = self._cached_only, on or self._cached_only
        try:
            yield
        finally:
            self._cached_only = before

    def curve(self, width: int, say: Say = None) -> CostCurve:
        """The target's cost curve up to `width` (cost.cost_curve, memoized). Raises NotMeasuredError
        within `_only_cached` when it is not cached."""
        have = [w for w in self._curves if w >= width]
        if have:
            return self._curves[min(have)]
        if self._cached_only:
            curve = cached_cost_curve(self.target, width, self.forward())
        else:
            curve = cost_curve(self.target, width, say, self.forward())
        self._curves[width] = curve
        return curve

    @staticmethod
    def width(drafter: Drafter) -> int:
        """The widest verify a request with this drafter can need: one curve serves every drafter up to it."""
        return max(drafter.max_draft or 0, DEFAULT_MAX_DRAFT) + 1

    def prior(self, drafter: Drafter, say: Say = None):
        """A model drafter's calibration prior (calibrate.drafter_prior), memoized by its identity, or for a
        model object handed in by the caller by that object (kept alive here, so never confused with
        another one that reuses its id()). Raises NotMeasuredError within `_only_cached` when it is not
        cached."""
        if drafter.ident is None:
            for model, prior in self._object_priors:
                if model is drafter.model:
                    return prior
            prior = self._measure_prior(drafter, say)
            self._object_priors.append((drafter.model, prior))
            return prior
        if drafter.ident not in self._priors:
            self._priors[drafter.ident] = self._measure_prior(drafter, say)
        return self._priors[drafter.ident]

    def _measure_prior(self, drafter: Drafter, say: Say = None):
        if self._cached_only:
            return cached_drafter_prior(self.target, drafter)
        return drafter_prior(self.target, drafter, say)

    def skip_set(self, say: Say = None) -> List[int]:
        """layerskip's calibrated skip set (cached on disk)."""
        if self._skip is None:
            self._skip = cached_skip_set(self.target, say)
        return self._skip

    # -- drafters ---------------------------------------------------------------------------------------

    def _block_model(self, mode: str, source) -> tuple:
        key = (mode, str(source))
        if key not in self._block_models:
            self._block_models[key] = load_block_model(mode, source)
        return self._block_models[key]

    def _registered_model(self, mode: str) -> Optional[tuple]:
        """The target's registered drafter of `mode` that loads and fits, or None; a present one that does
        not load or fit gets a warning (once) and is skipped."""
        if mode not in self._registered:
            self._registered[mode] = None
            for kind, source in registered_sources(self.target, (mode,), self.registry):
                try:
                    model, ident = self._block_model(kind, source)
                    block_drafter(model, self.target, ident)  # checks the fit
                except MlxInferError as e:
                    warn_broken(kind, source, e)
                    continue
                self._registered[mode] = (model, ident)
                break
        return self._registered[mode]

    def _block(self, mode: str, source, say: Say = None) -> BlockDrafter:
        """A block drafter of `mode` from `source` (None: the registered one)."""
        if isinstance(source, BlockDrafter):
            return source
        if source is None:
            found = self._registered_model(mode)
            if found is None:
                raise MlxInferError(f"no {mode} drafter is known for this model; pass --draft-model (a {mode} "
                                    "drafter directory or repo id; train one with mlx-infer train-drafter)")
            model, ident = found
        elif isinstance(source, nn.Module):
            model, ident = source, None
        else:
            model, ident = self._block_model(mode, source)
        curve = self.curve(int(model.block_size) + 1, say) if mode == "dspark" else None
        return block_drafter(model, self.target, ident, curve)

    def _draft(self, source) -> DraftModelDrafter:
        """A draft-model drafter from a path / repo id, a DraftModel, or a trusted mlx-lm model."""
        if isinstance(source, str):
            if source not in self._draft_models:
                self._draft_models[source] = load_draft_model(source, self.target)
            return DraftModelDrafter(self._draft_models[source], ident=f"draft:{source}")
        if isinstance(source, DraftModel):
            check_same_vocab(self.target.tokenizer, source.tokenizer)
            return DraftModelDrafter(source.model)
        return DraftModelDrafter(source)

    def _auto(self, say: Say = None) -> Drafter:
        """auto without a draft model: lookup backed by the registered block drafter when its calibration
        prior says it can pay on this machine (schedule.drafter_pays), else lookup alone."""
        if self._auto_block is None:
            self._auto_block = ""  # a drafter that fails here is not tried again
            try:
                self._auto_block = self._auto_choice(say)
            except NotMeasuredError:
                self._auto_block = None  # decided once measured
                raise
        if self._auto_block:
            return LookupThenBlock(self._block(self._auto_block, None, say))
        return LookupDrafter()

    def _auto_choice(self, say: Say = None) -> str:
        """The registered block mode auto backs lookup with, "" for none (see _auto)."""
        found = next((m for m in BLOCK_MODES if self._registered_model(m) is not None), None)
        if found is None:
            return ""
        block = self._block(found, None, say)
        curve = self.curve(self.width(block), say)
        return found if drafter_pays(curve, self.prior(block, say), block.max_draft, per_round=True) else ""

    def drafter(self, options: SpecOptions, say: Say = None) -> Drafter:
        """A fresh drafter for one request (what it loads is kept for the next).

        Raises:
            MlxInferError: a missing or incompatible draft model, or no registered drafter for dflash / dspark.
        """
        mode, source = options.mode, options.draft_model
        if mode == "auto":
            return self._auto(say) if source is None else self._draft(source)
        if mode == "lookup":
            return LookupDrafter()
        if mode == "layerskip":
            return LayerSkipDrafter(self.target.model, self.skip_set(say))
        if mode == "rmm":
            return RmmDrafter(self.target.model)
        if mode in BLOCK_MODES:
            return self._block(mode, source, say)
        return self._draft(source)

    # -- the draft-length policy -------------------------------------------------------------------------

    def policy(self, options: SpecOptions, drafter: Drafter, params: SamplingParams,
               say: Say = None) -> Optional[DraftPolicy]:
        """The draft-length policy of a request, or None where speculation cannot pay on this machine (the
        request then decodes plainly)."""
        if options.max_draft != "auto":
            return FixedGamma(options.max_draft)
        if drafter.self_scheduled:
            return FixedGamma(drafter.max_draft)  # DSpark: its confidence schedule cuts the block
        limit = drafter.max_draft or DEFAULT_MAX_DRAFT
        curve = self.curve(self.width(drafter), say)
        if not speculation_pays(curve, limit):
            return None  # verifying several tokens costs as much as decoding them one by one here
        # model drafters start from their calibration; lookup's buckets from their first verified proposal
        prior = self.prior(drafter, say) if isinstance(drafter, MODEL_DRAFTERS) else None
        return DraftScheduler(curve, limit, free=drafter.free, per_round=drafter.max_draft is not None, prior=prior)

    # -- requests ----------------------------------------------------------------------------------------

    def prepare(self, options: SpecOptions, params: SamplingParams = SamplingParams(), say: Say = None) -> None:
        """Measure now, once per model and machine, what a request with these options would otherwise measure
        on its first run (layerskip's calibration, the cost curve, a model drafter's prior), so that the
        first request's TTFT does not include them. Nothing when the target's cache cannot roll back (auto
        then decodes plainly; another mode fails at the request)."""
        if not options.on:
            return
        try:
            check_rollback(make_prompt_cache(self.target.model), 0)
        except MlxInferError:
            return
        drafter = self.drafter(options, say)
        if options.max_draft == "auto" and not drafter.self_scheduled:
            self.curve(self.width(drafter), say)
            if isinstance(drafter, MODEL_DRAFTERS):
                self.prior(drafter, say)

    def tokens(self, prompt_ids: List[int], params: SamplingParams, max_tokens: int, options: SpecOptions,
               stats: SpecStats, cache: list, start: int = 0,
               progress: Optional[Callable[[int, int], None]] = None, *, grammar: Optional[GrammarState] = None,
               logprobs: Optional[LogprobQueue] = None) -> Optional[Iterator[int]]:
        """The speculative token iterator of one request (the same tokens as plain decoding when greedy, the
        same distribution when sampling), or None when the request is to decode plainly (auto on a cache
        that cannot roll back; a policy that finds speculation cannot pay; with defer_measurements, auto
        before its measurements are cached): stats.mode is then "off".

        Args:
            prompt_ids: the whole prompt; cache: the target's per-layer caches, holding prompt_ids[:start]
                (loop.speculative_tokens); grammar, logprobs: the request's GrammarState and LogprobQueue
                (None: unconstrained / no logprobs), see loop.speculative_tokens: speculation stays on under a
                grammar (auto may still find it cannot pay), its forced tokens join the drafts.

        Raises:
            MlxInferError: the cache cannot roll back (modes other than auto), or a drafter that cannot load.
        """
        if options.mode == "auto":
            try:
                check_rollback(cache, len(prompt_ids) + max_tokens + DEFAULT_MAX_DRAFT)
            except MlxInferError:  # "auto" never fails: a cache that cannot roll back decodes plainly
                stats.mode = "off"
                return None
        else:
            check_rollback(cache, 0)  # before any drafter is loaded or measured
        try:
            with self._only_cached(options.mode == "auto" and self.defer_measurements):
                drafter = self.drafter(options)
                policy = self.policy(options, drafter, params)
        except NotMeasuredError:  # deferred: `prepare` measures later
            policy = None
        if policy is None:
            stats.mode = "off"
            return None
        return speculative_tokens(self.target.model, prompt_ids, params, max_tokens, drafter, policy, stats,
                                  cache=cache, start=start, progress=progress, compiled=self.forward(),
                                  grammar=grammar, logprobs=logprobs)

