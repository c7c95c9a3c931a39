"""Calibration: what a model drafter (a draft model, layer skip, a DFlash / DSpark block drafter) is worth
before any request: its teacher-forced agreement with the target on a fixed calibration text (the acceptance
of a first draft token under greedy verification) and the seconds of one drafting step (one drafting pass
for a block drafter), measured once and cached per target, drafter and machine. The scheduler starts from
this prior instead of paying probe rounds to learn it (the decision itself is schedule.drafter_pays).
"""

import time
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from ..paths import cached_json, read_cached_json
from .capture import TargetTaps
from .cost import NotMeasuredError, measure_cost_curve
from .drafters.base import Drafter
from .drafters.block import BlockDrafter
from .schedule import Prior
from .target import Target

#: Calibration text: plain prose, code and a list, so that no one style decides.
CALIBRATION_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to "
    "five books at a time, and each loan lasts three weeks.\n\ndef mean(values):\n    total = 0\n    for v in "
    "values:\n        total += v\n    return total / len(values)\n\nShopping list:\n- milk\n- bread\n- eggs\n"
    "- apples\n\nIn 1969 the first humans landed on the Moon, and millions watched the broadcast live."
)
#: Rounds of observation the calibration prior counts as.
PRIOR_WEIGHT = 4.0


def agreement(model: nn.Module, draft: nn.Module, tokens: mx.array) -> float:
    """Fraction of positions where the drafter's argmax equals the target's (tokens: [1, L] int)."""
    full = mx.argmax(model(tokens), axis=-1)
    part = mx.argmax(draft(tokens), axis=-1)
    return mx.mean(full == part).item()


def measure_prior(target: Target, draft: nn.Module) -> Prior:
    """Prior of a drafter model for the target: acceptance = agreement on CALIBRATION_TEXT, draft cost =
    seconds of one drafter forward of width 1 (cost.measure_cost_curve).

    Returns:
        schedule.Prior with weight PRIOR_WEIGHT.
    """
    tokens = mx.array(target.tokenizer.encode(CALIBRATION_TEXT))[None]
    step = measure_cost_curve(draft, 1, target.tokenizer.vocab_size, pipelined=False).seconds[1]
    return Prior(agreement(target.model, draft, tokens), PRIOR_WEIGHT, step)


#: Timed drafting passes of a block drafter (the minimum is kept).
BLOCK_COST_REPEATS = 5


def block_agreement(target: Target, drafter: Drafter, tokens: mx.array, stride: int = 2) -> float:
    """Fraction of anchors a (every `stride`-th position of `tokens`, [1, L] int) where a block drafter
    (DFlash / DSpark), given the target's taps of positions 0..a-1 and the anchor tokens[a], drafts as its
    first token the target's argmax after position a. Runs one target forward with taps and one drafting
    pass per anchor; leaves the drafter to be started again with `begin`."""
    with TargetTaps(target.model, drafter.target_layer_ids) as taps:
        target_next = mx.argmax(target.model(tokens), axis=-1)[0]  # [L]
        feats = taps.features()  # [1, L, n*H]
    mx.eval(target_next, feats)
    ids, wanted = tokens[0].tolist(), target_next.tolist()
    drafter.begin(ids[:1], None)
    anchors = range(0, len(ids) - 1, stride)
    same = 0
    for a in anchors:
        draft = drafter.propose(ids[: a + 1], 1).tokens
        same += bool(draft) and draft[0] == wanted[a]
        step = ids[a + 1 : a + 1 + stride]  # committed as if the drafts were accepted
        drafter.update(len(step) - 1, step, hidden=feats[:, a : a + len(step)])
    return same / max(1, len(anchors))


def block_pass_seconds(drafter: Drafter, context: list) -> float:
    """Seconds of one full-block drafting pass (the minimum of BLOCK_COST_REPEATS) over a drafter whose
    context already holds `context` but its last token."""
    best = float("inf")
    for _ in range(BLOCK_COST_REPEATS + 1):  # the first pass compiles the block shape: not kept
        start = time.perf_counter()
        drafter.propose(context, drafter.max_draft)
        best = min(best, time.perf_counter() - start)
    return best


def measure_block_prior(target: Target, drafter: Drafter) -> Prior:
    """Prior of a block drafter for the target: acceptance = block_agreement on CALIBRATION_TEXT, draft
    cost = seconds of one drafting pass (block_pass_seconds).

    Returns:
        schedule.Prior with weight PRIOR_WEIGHT.
    """
    ids = target.tokenizer.encode(CALIBRATION_TEXT)
    acceptance = block_agreement(target, drafter, mx.array(ids)[None])
    return Prior(acceptance, PRIOR_WEIGHT, block_pass_seconds(drafter, ids))


def drafter_prior(target: Target, drafter: Drafter, say: Optional[Callable[[str], None]] = None) -> Prior:
    """The calibration prior of a model drafter (a draft model or layer skip: `drafter.model`; a block
    drafter: its drafting pass), cached on disk when the drafter has a stable identity (`drafter.ident`)."""
    def measure() -> Prior:
        if isinstance(drafter, BlockDrafter):
            return measure_block_prior(target, drafter)
        return measure_prior(target, drafter.model)

    return cached_prior(target, drafter.ident, measure, say)


def cached_drafter_prior(target: Target, drafter: Drafter) -> Prior:
    """The prior drafter_prior would return from the disk cache, without measuring.

    Raises:
        NotMeasuredError: none is cached (always so for a drafter without an identity).
    """
    data = read_cached_json("prior", _prior_ident(target, drafter.ident), _valid_prior) if drafter.ident else None
    if data is None:
        raise NotMeasuredError("this drafter's agreement with the model is not measured yet")
    return Prior(float(data["acceptance"]), PRIOR_WEIGHT, float(data["draft_cost"]))


def _named(ident: str) -> str:
    """'draft:/path' -> 'draft model', 'dflash:...' -> 'dflash drafter' (for the line said before measuring)."""
    kind = ident.split(":", 1)[0]
    return "draft model" if kind == "draft" else f"{kind} drafter"


def _prior_ident(target: Target, ident: str) -> str:
    return f"{target.key}|{ident}"


def _valid_prior(data: dict) -> bool:
    return 0 <= data["acceptance"] <= 1 and data["draft_cost"] > 0


def cached_prior(target: Target, ident: Optional[str], measure: Callable[[], Prior],
                 say: Optional[Callable[[str], None]] = None) -> Prior:
    """measure() (a schedule.Prior), cached on disk when the drafter has a stable identity `ident` (a model
    path, a skip set, a drafter checkpoint); measured afresh when it is None (a model object handed in by
    the caller). say: called with a line before a measurement that will be cached."""
    if ident is None:
        return measure()

    def compute() -> dict:
        p = measure()
        return {"acceptance": p.acceptance, "draft_cost": p.draft_cost}

    data = cached_json("prior", _prior_ident(target, ident), compute, valid=_valid_prior,
                       say=say, message=f"measuring how often the {_named(ident)} agrees with the model")
    return Prior(float(data["acceptance"]), PRIOR_WEIGHT, float(data["draft_cost"]))
