"""Shared benchmark plumbing: machine description, interleaved trials, result files."""

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List

RESULTS_DIR = Path(__file__).parent / "results"


def machine() -> dict:
    """What the numbers were measured on: OS, CPU count, MLX version, backend, BLAS."""
    import mlx.core as mx

    from mlx_infer.backend import backend_name, blas_in_use, total_memory_bytes

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "memory_gib": round(total_memory_bytes() / 2**30, 1),
        "mlx": mx.__version__,
        "backend": backend_name(),
        "blas": blas_in_use(),
    }


def time_tokens(tokens: Iterable) -> dict:
    """Drain a token iterator and time it: TTFT (s), decode tokens/s after the first token, count."""
    start = time.perf_counter()
    first = None
    n = 0
    for _ in tokens:
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {
        "ttft_s": first - start,
        "decode_tps": (n - 1) / (end - first) if n > 1 else 0.0,
        "tokens": n,
    }


def interleaved(runners: Dict[str, Callable[[], dict]], trials: int) -> Dict[str, List[dict]]:
    """Run each runner once per trial, in turn (A B C, A B C, ...), so drift hits all alike."""
    out = {name: [] for name in runners}
    for _ in range(trials):
        for name, run in runners.items():
            out[name].append(run())
    return out


def median(rows: List[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def write_result(name: str, payload: dict) -> Path:
    """Write a result JSON under bench/results/ and return its path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
