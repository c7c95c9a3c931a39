"""Where a plain decode step's time goes on MLX's CPU backend: the whole step against its quantized products
alone, at each number of kernel threads, interleaved.

Parts (default model as loaded by mlx_infer.load, weights="auto"; one token over a short cache):
  step        model(token, cache) then mx.eval: the graph's build (Python) and its evaluation, ms
  products    the step's 211 quantized products alone (each layer's q/k/v/o/gate/up/down on its own weights,
              chained so that each layer waits for the last, then the tied output head), as one graph, ms
  head        the output head's product alone, ms
Each part is the median of --calls evaluations after a warm-up. Every thread count runs in a fresh process
(the kernels' thread pool is sized once per process, $MLX_INFER_KERNEL_THREADS), and the processes of the
thread counts alternate for --rounds rounds.

Usage: python bench/step.py [--threads 1,2] [--rounds 3] [--calls 40]
Prints a table and writes bench/results/step-*.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import machine, machine_line, write_result  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_infer.kernels.qmm import qmm_backend  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def timed(build, calls: int) -> tuple:
    """(build ms, eval ms): medians over `calls` of building the graph and of evaluating it."""
    for _ in range(3):
        mx.eval(build())
    builds, evals = [], []
    for _ in range(calls):
        start = time.perf_counter()
        out = build()
        built = time.perf_counter()
        mx.eval(out)
        builds.append(built - start)
        evals.append(time.perf_counter() - built)
    return statistics.median(builds) * 1e3, statistics.median(evals) * 1e3


def measure(calls: int) -> dict:
    """The three parts in this process (see the module docstring)."""
    engine = mlx_infer.load()
    model = engine.model
    cache = make_prompt_cache(model)
    ids = engine.encode(PROMPT)
    mx.eval(model(mx.array([ids]), cache=cache))
    token = mx.array([[ids[-1]]])
    head = model.model.embed_tokens.as_linear  # the tied output head of the default model (SmolLM2)
    x0 = mx.random.normal((1, 1, model.args.hidden_size), key=mx.random.key(0))

    def products():
        x = x0  # [1, 1, D]
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            x = x + attn.o_proj(q) + 0 * (k.sum() + v.sum())
            x = x + mlp.down_proj(mlp.gate_proj(x) * mlp.up_proj(x))
        return head(x)  # [1, 1, V]

    def step():
        out = model(token, cache=cache)
        return out

    out = {"kernel": qmm_backend()}
    out["step_build_ms"], out["step_eval_ms"] = timed(step, calls)
    out["products_build_ms"], out["products_eval_ms"] = timed(products, calls)
    out["head_eval_ms"] = timed(lambda: head(x0), calls)[1]
    out["cache_tokens"] = cache[0].offset
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="kernel thread counts to compare, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="processes per thread count, alternating")
    ap.add_argument("--calls", type=int, default=40, help="timed evaluations per part (the median is kept)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.calls)))
        return
    threads = [int(t) for t in args.threads.split(",")]
    runs = {t: [] for t in threads}
    for _ in range(args.rounds):
        for t in threads:
            env = dict(os.environ, MLX_INFER_KERNEL_THREADS=str(t))
            done = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)], env=env,
                                  capture_output=True, text=True, check=True)
            runs[t].append(json.loads(done.stdout.strip().splitlines()[-1]))
    info = machine()
    print(machine_line(info))
    keys = ("step_build_ms", "step_eval_ms", "products_eval_ms", "head_eval_ms")
    print(f"{'threads':>7}  " + "  ".join(f"{k:>17}" for k in keys) + "  products / step eval")
    table = []
    for t in threads:
        row = {"threads": t, "kernel": runs[t][0]["kernel"]}
        row.update({k: statistics.median(r[k] for r in runs[t]) for k in keys})
        row["products_share"] = row["products_eval_ms"] / row["step_eval_ms"]
        table.append(row)
        print(f"{t:>7}  " + "  ".join(f"{row[k]:>17.2f}" for k in keys) + f"  {row['products_share']:.2f}")
    path = write_result("step", {"machine": info, "args": vars(args), "table": table, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
