"""Speculative decoding: everything that makes decoding faster without changing the output.

    modes.py      SpecOptions: mode, draft model, max draft of a request (validated once)
    state.py      SpecState: what the Engine keeps per target (loaded drafters, schedulers, curves, priors)
    resolve.py    what a request names -> drafters (paths, checkpoints, the registry's entries)
    registry.py   the data of models/registry.json (target -> drafter)
    loop.py       the algorithm: draft -> one target forward -> verify -> commit -> KV rollback
    feedback.py   beside it, once per round: the round's times, SpecStats, what the policy learns
    constrained.py under a grammar: drafts with its forced tokens, each row's mask, the commit into it
    verify.py     pure accept/reject (greedy; exact speculative sampling, arXiv 2211.17192 / 2302.01318)
    schedule.py   the draft-length policies: FixedGamma, DraftScheduler (max_draft="auto")
    cost.py       the target's verify cost by width (measured once, cached)
    calibrate.py  what a model drafter is worth before a request (measured once, cached)
    confidence.py DSpark's confidence-scheduled verify length
    capture.py    taps of the target's decoder-layer outputs for the block drafters
    target.py     Target, and the parts of a target block drafters borrow
    drafters/     the Drafter interface; lookup (arXiv 2311.03511), draft_model, layerskip (arXiv 2309.08168),
                  dflash (arXiv 2602.06036), dspark, hybrid (lookup, then a block drafter)
"""

from .drafters import Drafter, DraftModelDrafter, LookupDrafter, cut_draft_model
from .loop import SpecStats, speculative_tokens
from .modes import MODEL_MODES, MODES, DraftModel, SpecOptions, check_max_draft
from .state import SpecState
from .target import Target

__all__ = ["MODES", "MODEL_MODES", "SpecOptions", "DraftModel", "check_max_draft", "SpecState", "Target",
           "SpecStats", "speculative_tokens", "Drafter", "DraftModelDrafter", "LookupDrafter", "cut_draft_model"]
