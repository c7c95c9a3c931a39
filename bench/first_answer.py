"""Time to the first answer token of the README's first command on a new machine, against a warm one.

`mlx-infer generate "What is the capital of France?"` is run as a subprocess, and the seconds from its start to
the first byte on its stdout are read (load, prefill and whatever runs before the answer included), with:

  cold   a cache folder holding the built CPU kernels and the converted GGUF (copied from --cache) but none
         of the one-time measurements (the verify cost curve in cost/, the drafters' calibration priors in
         prior/, layerskip's skip sets in layerskip/): what a first run pays once the kernels are built
  warm   the same folder after the cold run: every cache filled
Interleaved, --trials times (each cold trial starts from a folder emptied of the measurements again);
medians, and each run's wall time to its exit (the cold run measures after its answer).

Usage: python bench/first_answer.py [--cache /tmp/mlxi-cache] [--trials 3]
Prints the table and writes bench/results/first_answer-*.json.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, machine_line, positive_int, write_result  # noqa: E402

PROMPT = "What is the capital of France?"
#: The cache folders that hold one-time measurements (everything else is kernels and conversions).
MEASUREMENTS = ("cost", "prior", "layerskip")
#: The cache folders a cold run keeps: the built kernels and the converted GGUF.
KEPT = ("kernels", "gguf")


def scratch_cache(source: Path) -> Path:
    """A temporary cache folder with source's kernels and conversions and no measurements."""
    folder = Path(tempfile.mkdtemp(prefix="mlxi-first-"))
    for name in KEPT:
        if (source / name).is_dir():
            shutil.copytree(source / name, folder / name, symlinks=True)
    return folder


def forget_measurements(cache: Path) -> None:
    for name in MEASUREMENTS:
        shutil.rmtree(cache / name, ignore_errors=True)


def first_byte(cache: Path, args: list) -> dict:
    """Seconds from the start of `mlx-infer generate` to its first stdout byte and to its exit."""
    env = {**os.environ, "MLX_INFER_CACHE": str(cache)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_infer", "generate", PROMPT, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    rest, err = proc.communicate()
    end = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"mlx-infer generate failed ({proc.returncode}): {err.decode()[-2000:]}")
    return {"first_s": first, "exit_s": end, "stderr": err.decode()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/mlxi-cache"),
                    help="a cache folder with the kernels built and the default model converted")
    ap.add_argument("--trials", type=positive_int, default=3)
    ap.add_argument("--args", default="", help="extra arguments for mlx-infer generate")
    opts = ap.parse_args()
    cache = scratch_cache(opts.cache)
    runs = {"cold": [], "warm": []}
    try:
        for _ in range(opts.trials):
            forget_measurements(cache)
            runs["cold"].append(first_byte(cache, opts.args.split()))
            runs["warm"].append(first_byte(cache, opts.args.split()))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    info = machine()
    print(machine_line(info))
    print("run    first token s (median)  each                    exit s (median)")
    for name, rows in runs.items():
        firsts = [r["first_s"] for r in rows]
        exits = [r["exit_s"] for r in rows]
        print(f"{name:6} {statistics.median(firsts):22.2f}  {' '.join(f'{x:.2f}' for x in firsts):23} "
              f"{statistics.median(exits):.2f}")
    ratio = statistics.median(r["first_s"] for r in runs["cold"]) / statistics.median(r["first_s"] for r in runs["warm"])
    print(f"cold / warm first token: {ratio:.2f}x")
    print("cold run's stderr:\n" + runs["cold"][0]["stderr"])
    path = write_result("first_answer", {"machine": info, "prompt": PROMPT, "args": opts.args, "runs": runs,
                                         "ratio": ratio})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
