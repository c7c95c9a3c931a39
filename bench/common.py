"""Shared benchmark plumbing: machine description, interleaved trials, result files."""

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

RESULTS_DIR = Path(__file__).parent / "results"
#: This repository's root.
REPO = Path(__file__).resolve().parent.parent
#: The benchmark prompt sets, one JSON object per line with its "prompt" (chat, code, math, copy).
PROMPTS = Path(__file__).resolve().parent / "prompts"
PROMPT_SETS = ("chat", "code", "math", "copy")
#: wikitext-2's test split, beside the repository (../shared/data): the long prompts and perplexity windows.
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "test.txt"


def prompt_set(name: str) -> List[str]:
    """The prompts of bench/prompts/NAME.jsonl, in order."""
    lines = (PROMPTS / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def load_prompts(name: str, limit: int) -> List[str]:
    """The first `limit` prompts of set `name` (prompt_set)."""
    return prompt_set(name)[:limit]


def all_prompts() -> List[str]:
    """Every prompt of PROMPT_SETS, set after set."""
    return [p for name in PROMPT_SETS for p in prompt_set(name)]


def wikitext_path() -> Path:
    """WIKITEXT, checked.

    Raises:
        SystemExit: (one line) the file is not there."""
    if not WIKITEXT.is_file():
        raise SystemExit(f"bench: wikitext-2's test split not found at {WIKITEXT}: this benchmark reads it from "
                         f"shared/data/wikitext-2/test.txt beside the repository")
    return WIKITEXT


def wikitext_text() -> str:
    """The text of WIKITEXT (SystemExit, one line, when it is not there)."""
    return wikitext_path().read_text(encoding="utf-8")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (else argparse's one-line usage error)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def positive_ints(text: str) -> List[int]:
    """argparse type: comma-separated integers >= 1, such as "1,2,4,8"."""
    return [_int_at_least(t.strip(), 1) for t in text.split(",")]


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} is below {low}")
    return value


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


def machine_line(info: dict) -> str:
    """One line naming what `machine()` describes, for the head of a benchmark's table."""
    return (f"machine: {info['platform']}, {info['cpus']} CPUs, MLX {info['mlx']} ({info['backend']}), "
            f"BLAS: {info['blas']}")


def time_tokens(tokens: Iterable) -> dict:
    """Drain a token iterator and time it: TTFT (s), decode tokens/s after the first token, count (the
    package's own timing, mlx_infer.benchmark.timing, imported here so that a script sets its environment
    before mlx_infer loads)."""
    from mlx_infer.benchmark.timing import time_tokens as timed

    return timed(tokens)


def interleaved(runners: Dict[str, Callable[[], dict]], trials: int) -> Dict[str, List[dict]]:
    """Run each runner once per trial, in turn (A B C, A B C, ...), so drift hits all alike."""
    out = {name: [] for name in runners}
    for _ in range(trials):
        for name, run in runners.items():
            out[name].append(run())
    return out


def median(rows: List[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


#: Resamples of a bootstrap interval, and the fixed seed that makes a report reproducible.
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def bootstrap_ratio(pairs: Sequence[Tuple[Tuple[float, float], Tuple[float, float]]], level: float = 0.95,
                    resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Tuple[float, float]:
    """Percentile bootstrap interval of a paired ratio of rates (Efron & Tibshirani, "An Introduction to
    the Bootstrap", 1993, ch. 13).

    Each pair is one measured cell (a prompt in one repeat) of two systems, as (count, seconds) of system A
    and of system B; the statistic is (sum A counts / sum A seconds) / (sum B counts / sum B seconds) over
    the cells, and cells are resampled with replacement, both systems together (they ran the same prompt
    in the same repeat, back to back).

    Returns:
        (low, high) of the central `level` interval; (nan, nan) with no pairs.
    """
    if not pairs:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(pairs)
    stats = []
    for _ in range(resamples):
        an = asec = bn = bsec = 0.0
        for _ in range(n):
            (a_n, a_s), (b_n, b_s) = pairs[rng.randrange(n)]
            an, asec, bn, bsec = an + a_n, asec + a_s, bn + b_n, bsec + b_s
        if asec > 0 and bsec > 0 and bn > 0:
            stats.append((an / asec) / (bn / bsec))
    stats.sort()
    if not stats:
        return float("nan"), float("nan")
    tail = (1.0 - level) / 2
    return stats[int(tail * (len(stats) - 1))], stats[int(round((1 - tail) * (len(stats) - 1)))]


def pyplot():
    """matplotlib.pyplot on the Agg backend (PNG files, no display), or None with a note printed when
    matplotlib is not installed (pip install '.[bench]')."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install '.[bench]'): no plot")
        return None
    return plt


def write_result(name: str, payload: dict) -> Path:
    """Write a result JSON under bench/results/ and return its path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


@contextlib.contextmanager
def code_sides(against: Optional[str]) -> Iterator[Dict[str, dict]]:
    """The environments of the processes that measure "this tree" and, with `against` (a git commit or ref of
    this repository), that commit: a `git worktree` of it in a temporary folder, its CPU kernels built in
    their own cache ($MLX_INFER_CACHE), ../shared linked beside it. Each side imports mlx_infer from its own
    tree ($PYTHONPATH), whatever is installed. {name: env}, REF first; the worktree is removed on exit.

    Raises:
        SystemExit: (one line) `against` is not a commit of this repository.
    """
    sides = {"this tree": dict(os.environ, PYTHONPATH=str(REPO))}
    if against is None:
        yield sides
        return
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--end-of-options",
                             f"{against}^{{commit}}"], capture_output=True, text=True)
    if commit.returncode or not commit.stdout.strip():
        raise SystemExit(f"bench: --against {against!r}: not a commit of this repository")
    with tempfile.TemporaryDirectory(prefix="mlx-infer-bench-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree), commit.stdout.strip()],
                       check=True, capture_output=True)
        (Path(tmp) / "shared").symlink_to(REPO.parent / "shared")  # for REF's code that reads ../shared
        try:
            yield {against: dict(os.environ, PYTHONPATH=str(tree), MLX_INFER_CACHE=str(Path(tmp) / "cache")), **sides}
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def run_child(script: str, args: Sequence[str], env: dict) -> dict:
    """Run `script` (a bench script's __file__) again as a measuring child process: `--child` and `args`,
    with `env` (a side of `code_sides`); its measurement, the JSON object on its last stdout line. Exits with
    the child's stderr when it fails."""
    name = f"bench/{Path(script).name}"
    done = subprocess.run([sys.executable, str(Path(script).resolve()), "--child", *args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: a measuring process failed ({env.get('PYTHONPATH')}):\n{done.stderr.strip()}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternated(script: str, against: Optional[str], rounds: int, args: Sequence[str]) -> Dict[str, List[dict]]:
    """`rounds` rounds of one measuring child of `script` per side of `code_sides(against)` (run_child with
    `args`), the sides in turn within each round: {side name: [its measurement per round]}, REF first."""
    with code_sides(against) as sides:
        runs: Dict[str, List[dict]] = {name: [] for name in sides}
        for _ in range(rounds):
            for name, env in sides.items():
                runs[name].append(run_child(script, args, env))
    return runs
