"""The target's verify cost as a function of width: measured once per model and machine, cached on disk.

Speculation pays only when verifying gamma+1 tokens costs little more than one. That depends on the
backend: on MLX's CPU backend a quantized matmul is a plain loop whose cost grows with the number of
rows, while float32 through an optimized BLAS (or Metal / CUDA) barely notices the width. So the cost of
one target forward is measured as a function of its width (`CostCurve`), with the seconds of a plain
decoding step when steps are pipelined (as mlx-lm's generate_step runs them), and cached under the user
cache dir keyed by `Target.key` (model fingerprint, weights mode, backend, BLAS, kernels, MLX version).
"""

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from ..paths import cached_json
from .target import Target

#: Context tokens in the cache while the cost curve is measured.
COST_CONTEXT = 64
#: Timed repetitions per width (the minimum is kept).
COST_REPEATS = 5


@dataclass
class CostCurve:
    """Seconds of one target forward of `width` tokens, each read back before the next is built (a verify
    round), and of one plain decoding step when steps are pipelined.

    Attributes:
        seconds: {width: seconds} for the measured widths (1 .. max_width).
        plain_step: seconds per plain decoding step when each step's forward is built while the previous
            one computes (mlx-lm's generate_step; the loop's rounds launched ahead); None: unknown, taken
            as seconds[1]. On the CPU backend here it is about 10% less than seconds[1] (default model:
            65 against 72 ms).
    """

    seconds: Dict[int, float]
    plain_step: Optional[float] = None

    def plain(self) -> float:
        """Seconds of a plain decoding step (pipelined when measured so)."""
        return self.plain_step if self.plain_step is not None else self.seconds[1]

    def __call__(self, width: int) -> float:
        known = sorted(self.seconds)
        if width in self.seconds:
            return self.seconds[width]
        if width > known[-1]:  # extrapolate the last slope
            a, b = known[-2], known[-1]
            slope = (self.seconds[b] - self.seconds[a]) / (b - a)
            return self.seconds[b] + slope * (width - b)
        lo = max(w for w in known if w < width)
        hi = min(w for w in known if w > width)
        t = (width - lo) / (hi - lo)
        return self.seconds[lo] * (1 - t) + self.seconds[hi] * t

    def to_json(self) -> dict:
        """{"seconds": {width: seconds}, "plain_step": seconds or None}."""
        return {"seconds": {str(k): v for k, v in self.seconds.items()}, "plain_step": self.plain_step}


def measure_cost_curve(model: nn.Module, max_width: int, vocab_size: int, pipelined: bool = True) -> CostCurve:
    """Time one forward of each width 1..max_width over a COST_CONTEXT-token cache (a few seconds).

    Args:
        model: the target (mlx-lm model).
        max_width: widest verify forward to time (gamma + 1).
        vocab_size: token ids are drawn below this.
        pipelined: also time pipelined plain steps (the target's curve; not needed for a drafter).

    Returns:
        CostCurve with the minimum of COST_REPEATS timings per width, seconds, and the plain step time
        (pipelined_step_seconds).
    """
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab_size, (1, COST_CONTEXT + max_width), key=mx.random.key(0))
    mx.eval(model(tokens[:, :COST_CONTEXT], cache=cache))
    seconds = {w: float("inf") for w in range(1, max_width + 1)}
    # Widths interleaved within each repeat, so that load from other programs hits them alike; the first
    # repeat compiles each new shape and is not kept.
    for rep in range(COST_REPEATS + 1):
        for width in range(1, max_width + 1):
            block = tokens[:, COST_CONTEXT : COST_CONTEXT + width]
            start = time.perf_counter()
            mx.eval(model(block, cache=cache))
            elapsed = time.perf_counter() - start
            for c in cache:
                c.trim(width)
            if rep:
                seconds[width] = min(seconds[width], elapsed)
    return CostCurve(seconds, pipelined_step_seconds(model, cache) if pipelined else None)


#: Plain steps per timing of pipelined decoding.
PIPELINE_STEPS = 8


def pipelined_step_seconds(model: nn.Module, cache: list) -> float:
    """Seconds per greedy step of plain decoding as the Engine runs it (mlx-lm's generate_step, each step
    launched before the previous token is read back): the minimum over COST_REPEATS timings of
    PIPELINE_STEPS steps after the first; `cache` is left holding what it held."""
    best = float("inf")
    for rep in range(COST_REPEATS + 1):
        held = cache[0].offset
        times = [time.perf_counter() for _ in generate_step(mx.array([1]), model, max_tokens=PIPELINE_STEPS + 1,
                                                            prompt_cache=cache)]
        for c in cache:
            c.trim(c.offset - held)
        if rep:
            best = min(best, (times[-1] - times[0]) / PIPELINE_STEPS)
    return best


def cost_curve(target: Target, max_width: int, say: Optional[Callable[[str], None]] = None) -> CostCurve:
    """The target's cost curve up to `max_width`, from the disk cache or measured once and saved.

    Args:
        target: the Target (its `key` names the cache entry).
        max_width: widest verify forward needed (largest gamma + 1).
        say: called with a one-line message before a measurement (not when cached).
    """
    data = cached_json(
        "cost", target.key,
        lambda: measure_cost_curve(target.model, max_width, target.tokenizer.vocab_size).to_json(),
        valid=lambda d: max(int(k) for k in d["seconds"]) >= max_width and d.get("plain_step", 0) > 0,
        say=say, message="measuring this model's verify cost by width",
    )
    return CostCurve({int(k): float(v) for k, v in data["seconds"].items()}, float(data["plain_step"]))
