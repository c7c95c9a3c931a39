"""The benchmark's options (BenchOptions) and the --suite value, checked in plain Python before MLX loads."""

from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..errors import MlxInferError
from .defaults import (
    BATCH_SIZES, KV_CONTEXT, KV_SUITE_BITS, LONG_CONTEXTS, MAX_TOKENS, PREFILL_LENGTHS, PROMPTS_PER_SET,
    SPEC_SUITE_MODES, SUITES, TRIALS,
)


@dataclass
class BenchOptions:
    """What the suites run (each default in benchmark/defaults.py).

    Attributes:
        trials: timed runs per system and case (>= 1); the median counts.
        max_tokens: tokens generated per run (>= 1).
        lengths: prompt lengths of the prefill suite, tokens.
        contexts: prompt lengths of the long suite, tokens.
        modes: speculative modes of the spec suite ("off" is added first when missing).
        batch_sizes: requests decoded together in the batch suite.
        kv_bits: KV caches of the kv suite (None: float, 8, 4).
        kv_context: prompt tokens of the kv suite.
        prompts_per_set: prompts per prompt set in the spec suite.
        kv_bits_after: the engine's KV setting to restore after the kv suite (the user's --kv-bits).
    """

    trials: int = TRIALS
    max_tokens: int = MAX_TOKENS
    lengths: Sequence[int] = PREFILL_LENGTHS
    contexts: Sequence[int] = LONG_CONTEXTS
    modes: Sequence[str] = SPEC_SUITE_MODES
    batch_sizes: Sequence[int] = BATCH_SIZES
    kv_bits: Sequence[Optional[int]] = KV_SUITE_BITS
    kv_context: int = KV_CONTEXT
    prompts_per_set: int = PROMPTS_PER_SET
    kv_bits_after: Optional[str] = None


def parse_suites(text: str) -> List[str]:
    """'decode,spec' -> ["decode", "spec"]; 'all' -> every suite of SUITES, in order.

    Raises:
        MlxInferError: an unknown suite name (the message lists the known ones)."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if "all" in names:
        return list(SUITES)
    bad = [n for n in names if n not in SUITES]
    if bad or not names:
        raise MlxInferError(f"unknown --suite {', '.join(bad) or repr(text)}: use a comma-separated list of "
                            f"{', '.join(SUITES)}, or all")
    return list(dict.fromkeys(names))
