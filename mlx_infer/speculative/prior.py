"""What a model drafter (a draft model, layer skip) is worth before any request: its teacher-forced
agreement with the target on a fixed calibration text (the acceptance of a first draft token under
greedy verification) and the seconds of one drafting step, measured once and cached per target, drafter
and machine. The scheduler starts from this prior instead of paying probe rounds to learn it.
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ..paths import cached_json

#: Calibration text: plain prose, code and a list, so that no one style decides.
CALIBRATION_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to "
    "five books at a time, and each loan lasts three weeks.\n\ndef mean(values):\n    total = 0\n    for v in "
    "values:\n        total += v\n    return total / len(values)\n\nShopping list:\n- milk\n- bread\n- eggs\n"
    "- apples\n\nIn 1969 the first humans landed on the Moon, and millions watched the broadcast live."
)
#: Rounds of observation the calibration prior counts as.
PRIOR_WEIGHT = 4.0
#: Rounds before the first probe of a drafter its calibration judges not worth running. A probe of a model
#: drafter is dear: its KV cache first catches up on the whole context (a prefill through its layers).
PRIOR_FIRST_PROBE = 128


def agreement(model: nn.Module, draft: nn.Module, tokens: mx.array) -> float:
    """Fraction of positions where the drafter's argmax equals the target's (tokens: [1, L] int)."""
    full = mx.argmax(model(tokens), axis=-1)
    part = mx.argmax(draft(tokens), axis=-1)
    return mx.mean(full == part).item()


def measure_prior(engine, draft: nn.Module):
    """Prior of a drafter model for the Engine's target: acceptance = agreement on CALIBRATION_TEXT, draft
    cost = seconds of one drafter forward of width 1 (schedule.measure_cost_curve).

    Returns:
        schedule.Prior with weight PRIOR_WEIGHT and first probe after PRIOR_FIRST_PROBE rounds.
    """
    from .schedule import Prior, measure_cost_curve

    tokens = mx.array(engine.tokenizer.encode(CALIBRATION_TEXT))[None]
    step = measure_cost_curve(draft, 1, engine.tokenizer.vocab_size, pipelined=False).seconds[1]
    return Prior(agreement(engine.model, draft, tokens), PRIOR_WEIGHT, step, PRIOR_FIRST_PROBE)


def drafter_prior(engine, draft: nn.Module, ident: Optional[str], say=None):
    """measure_prior, cached on disk when the drafter has a stable identity `ident` (a model path, a skip
    set); measured afresh when it is None (a model object handed in by the caller). say: called with a
    line before a measurement that will be cached."""
    from .schedule import Prior, curve_key

    if ident is None:
        return measure_prior(engine, draft)

    def compute() -> dict:
        p = measure_prior(engine, draft)
        return {"acceptance": p.acceptance, "draft_cost": p.draft_cost}

    data = cached_json("prior", f"{curve_key(engine)}|{ident}", compute,
                       valid=lambda d: 0 <= d["acceptance"] <= 1 and d["draft_cost"] > 0,
                       say=say, message="measuring how often this drafter agrees with the model")
    return Prior(float(data["acceptance"]), PRIOR_WEIGHT, float(data["draft_cost"]), PRIOR_FIRST_PROBE)
