"""Timed token streams and interleaved trials: what every suite measures with."""

import statistics
import time
from typing import Callable, Dict, Iterable, List, Optional

#: Progress callback of the suites: (suite, runs done, runs in the suite).
OnRun = Optional[Callable[[str, int, int], None]]


def time_tokens(tokens: Iterable) -> dict:
    """Drain a token iterator and time it.

    Returns:
        {"ttft_s": seconds to the first token, "decode_tps": tokens per second after the first one (0 with
        fewer than two), "total_s": seconds of the whole stream, "tokens": how many}.
    """
    start = time.perf_counter()
    first = None
    n = 0
    for _ in tokens:
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft_s": first - start, "decode_tps": (n - 1) / (end - first) if n > 1 else 0.0,
            "total_s": end - start, "tokens": n}


def interleaved(runners: Dict[str, Callable[[], dict]], trials: int, tick: Callable[[], None]) -> Dict[str, List[dict]]:
    """One untimed warm-up of each runner (compiles, pages weights in), then `trials` rounds running each in
    turn (A B C, A B C, ...), so that drift of the machine hits all alike; `tick()` after every run.

    Returns:
        {runner name: its `trials` results, in order}.
    """
    for run in runners.values():
        run()
        tick()
    out: Dict[str, List[dict]] = {name: [] for name in runners}
    for _ in range(trials):
        for name, run in runners.items():
            out[name].append(run())
            tick()
    return out


def median(rows: List[dict], key: str) -> float:
    """The median of `key` over result dicts."""
    return statistics.median(r[key] for r in rows)


def runs_per_case(systems: int, trials: int) -> int:
    """Runs `interleaved` makes for one case: a warm-up and `trials` timed runs per system."""
    return systems * (trials + 1)
