"""The target's verify cost as a function of width: measured once per model and machine, cached on disk.

Speculation pays only when verifying gamma+1 tokens costs little more than one. That depends on the
backend: on MLX's CPU backend a quantized matmul is a plain loop whose cost grows with the number of
rows, while float32 through an optimized BLAS (or Metal / CUDA) barely notices the width. So the cost of
one target forward is measured as a function of its width (`CostCurve`), with the seconds of a plain
decoding step when steps are pipelined (as plain decoding runs them), and cached under the user
cache dir keyed by `Target.key` (model fingerprint, weights mode, backend, BLAS, kernels, MLX version) and
whether the forwards replay compiled graphs (generation/compiled.py), as the speculative loop runs them.
"""

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from ..generation.compiled import CompiledDecode
from ..generation.decode import decode_stream, plain_tokens
from ..generation.sampling import SamplingParams
from ..paths import cached_json, read_cached_json
from .target import Target


class NotMeasuredError(Exception):
    """A one-time measurement (the verify cost curve, a drafter's calibration prior) that is not cached yet,
    asked for by a caller that must not measure now (SpecState.defer_measurements: the request then decodes
    plainly). Internal: caught inside the library, never shown to a user."""


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
            one computes (plain decoding; the loop's rounds launched ahead); None: unknown, taken as
            seconds[1]. With both replayed as compiled graphs they are within a few percent on the CPU
            backend.
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


def measure_cost_curve(model: nn.Module, max_width: int, vocab_size: int, pipelined: bool = True,
                       compiled: Optional[CompiledDecode] = None) -> CostCurve:
    """Time one forward of each width 1..max_width over a COST_CONTEXT-token cache (a few seconds).

    Each repeat times every width and then PIPELINE_STEPS pipelined plain steps, so that load from other
    programs hits the widths and the plain step alike: a plain step timed apart, after the widths, once came
    out slower than the width-1 forward on a busy machine (where it runs a little faster), and made every
    verify look cheaper against plain decoding than it was.

    Args:
        model: the target (mlx-lm model).
        max_width: widest verify forward to time (gamma + 1).
        vocab_size: token ids are drawn below this.
        pipelined: also time pipelined plain steps (the target's curve; not needed for a drafter).
        compiled: the model's CompiledDecode of verify widths, which runs the timed forwards and steps where
            CompiledDecode.applies, as the speculative loop runs them (SpecState.forward); None: the model.

    Returns:
        CostCurve with the minimum of COST_REPEATS timings per width, seconds, and of the plain step
        (pipelined_step_seconds).
    """
    with mx.stream(decode_stream()):  # where decoding and the loop run (a switch of stream costs time)
        cache = make_prompt_cache(model)
        tokens = mx.random.randint(0, vocab_size, (1, COST_CONTEXT + max_width), key=mx.random.key(0))
        mx.eval(model(tokens[:, :COST_CONTEXT], cache=cache))
        forward = compiled if compiled is not None and CompiledDecode.applies(model, cache) else model
        seconds = {w: float("inf") for w in range(1, max_width + 1)}
        plain = float("inf")
        # The first repeat compiles each new shape and is not kept.
        for rep in range(COST_REPEATS + 1):
            for width in range(1, max_width + 1):
                block = tokens[:, COST_CONTEXT : COST_CONTEXT + width]
                start = time.perf_counter()
                mx.eval(forward(block, cache=cache))
                elapsed = time.perf_counter() - start
                for c in cache:
                    c.trim(width)
                if rep:
                    seconds[width] = min(seconds[width], elapsed)
            if pipelined:
                step = pipelined_step_seconds(model, cache, compiled)
                if rep:
                    plain = min(plain, step)
    return CostCurve(seconds, plain if pipelined else None)


#: Plain steps per timing of pipelined decoding.
PIPELINE_STEPS = 8
#: A cached curve whose plain step exceeds this times its width-1 forward was timed while the machine's load
#: changed (a pipelined step costs at most about one forward read back each time) and is measured again.
PLAIN_SLACK = 1.1
#: Measurements of a curve before an inconsistent one is kept (with its plain step capped).
COST_ATTEMPTS = 2


def pipelined_step_seconds(model: nn.Module, cache: list, compiled: Optional[CompiledDecode] = None) -> float:
    """Seconds per greedy step of plain decoding as the Engine runs it (generation/decode.plain_tokens, each
    step launched before the previous token is read back, through `compiled` where it applies): one timing of
    PIPELINE_STEPS steps after the first; `cache` is left holding what it held."""
    held = cache[0].offset
    times = [time.perf_counter() for _ in plain_tokens(model, [1], SamplingParams(), PIPELINE_STEPS + 1, cache=cache,
                                                       compiled=compiled)]
    # the loop launched one more step before it stopped: without waiting for it, the next forward timed (the
    # curve's width 1) would include part of that step
    mx.synchronize(decode_stream())
    for c in cache:
        c.trim(c.offset - held)
    return (times[-1] - times[0]) / PIPELINE_STEPS


def consistent(data: dict, max_width: int) -> bool:
    """Whether a cached curve (CostCurve.to_json) reaches max_width and its plain step is at most
    PLAIN_SLACK times its width-1 forward."""
    plain = data.get("plain_step") or 0
    return max(int(k) for k in data["seconds"]) >= max_width and 0 < plain <= PLAIN_SLACK * data["seconds"]["1"]


def _measure_consistent(target: Target, max_width: int, compiled: Optional[CompiledDecode]) -> dict:
    """measure_cost_curve's JSON, measured again (up to COST_ATTEMPTS times in all) while it is not
    `consistent`; the last one's plain step is then taken as its width-1 forward, so that it is kept."""
    for _ in range(COST_ATTEMPTS):
        data = measure_cost_curve(target.model, max_width, target.tokenizer.vocab_size, compiled=compiled).to_json()
        if consistent(data, max_width):
            return data
    return {**data, "plain_step": data["seconds"]["1"]}


def _cost_ident(target: Target, compiled: Optional[CompiledDecode]) -> str:
    """The cache identity of a target's cost curve: its key, and whether forwards replay compiled graphs."""
    return f"{target.key}|forwards:{'compiled' if compiled is not None else 'model'}"


def _curve(data: dict) -> CostCurve:
    return CostCurve({int(k): float(v) for k, v in data["seconds"].items()}, float(data["plain_step"]))


def cost_curve(target: Target, max_width: int, say: Optional[Callable[[str], None]] = None,
               compiled: Optional[CompiledDecode] = None) -> CostCurve:
    """The target's cost curve up to `max_width`, from the disk cache or measured once and saved.

    Args:
        target: the Target (its `key` names the cache entry, with whether forwards replay compiled graphs).
        max_width: widest verify forward needed (largest gamma + 1).
        say: called with a one-line message before a measurement (not when cached).
        compiled: the target's CompiledDecode of verify widths (measure_cost_curve); None: the model.
    """
    data = cached_json(
        "cost", _cost_ident(target, compiled),
        lambda: _measure_consistent(target, max_width, compiled),
        valid=lambda d: consistent(d, max_width),
        say=say, message="measuring this model's verify cost by width",
        stale="the cached curve is too narrow, or was timed while the machine was busy",
    )
    return _curve(data)


def cached_cost_curve(target: Target, max_width: int, compiled: Optional[CompiledDecode] = None) -> CostCurve:
    """The curve cost_curve would return from the disk cache, without measuring.

    Raises:
        NotMeasuredError: no curve up to max_width (a consistent one) is cached.
    """
    data = read_cached_json("cost", _cost_ident(target, compiled), lambda d: consistent(d, max_width))
    if data is None:
        raise NotMeasuredError(f"this model's verify cost up to width {max_width} is not measured yet")
    return _curve(data)
