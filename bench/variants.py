"""Plain decoding on each CPU kernel variant against llama.cpp: one process per variant
($MLX_INFER_KERNEL_ISA, which the kernels read once per process), mlx-infer and llama.cpp interleaved in
each, the variants' processes alternated for --pairs rounds. What docs/kernels.md's int8-activation figures
come from: the variants' ratios to llama.cpp measured side by side, so that this VM's drift between minutes
(+-15%) hits both.

Each process: the default model (native weights), PROMPT (chat-templated; the prompt of the former
bench/decode.py), --trials interleaved trials of --max-tokens tokens per runner; medians of decode tok/s and
TTFT. llama.cpp decodes the very same token ids (mlx_infer.benchmark.peers.llama_cpp_runner).

Usage: python bench/variants.py [--isa avx512,avx512vnni] [--pairs 3] [--trials 5] [--max-tokens 64]
Prints a row per process and a summary; writes bench/results/variants-*.json. Needs llama-cpp-python.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import interleaved, machine, machine_line, median, time_tokens, write_result  # noqa: E402

from mlx_infer.benchmark.peers import llama_cpp_runner  # noqa: E402
from mlx_infer.kernels import cpu  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def mlx_infer_runner(engine, prompt_ids, max_tokens):
    """A runner of one greedy request from an empty KV cache (a whole prefill every time, as llama.cpp's)."""
    def run():
        engine.reset()
        return time_tokens(s for s in engine.stream_steps(prompt_ids, max_tokens=max_tokens) if s.token is not None)

    return run


def measure(trials: int, max_tokens: int) -> dict:
    """This process's variant against llama.cpp: medians of decode tok/s and TTFT s of each."""
    engine = mlx_infer.load(weights="native")
    ids = engine.encode(PROMPT)
    llama, note = llama_cpp_runner(engine.source.path, ids, max_tokens)
    if llama is None:
        raise SystemExit(f"llama.cpp: {note}")
    runners = {"mlx-infer": mlx_infer_runner(engine, ids, max_tokens), "llama.cpp": llama}
    for run in runners.values():
        run()  # warm-up
    rows = interleaved(runners, trials)
    out = {"kernel": f"cpu-{cpu.isa()}"}
    for name, key in (("mlx-infer", "mlx_infer"), ("llama.cpp", "llama_cpp")):
        out[f"{key}_decode_tps"] = median(rows[name], "decode_tps")
        out[f"{key}_ttft_s"] = median(rows[name], "ttft_s")
    out["ratio"] = out["mlx_infer_decode_tps"] / out["llama_cpp_decode_tps"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", default="avx512,avx512vnni", help="MLX_INFER_KERNEL_ISA values, comma-separated")
    ap.add_argument("--pairs", type=int, default=3, help="rounds of one process per variant, alternated")
    ap.add_argument("--trials", type=int, default=5, help="interleaved trials per runner in each process")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.trials, args.max_tokens)))
        return
    isas = [v.strip() for v in args.isa.split(",") if v.strip()]
    info = machine()
    print(machine_line(info))
    print(f"{'round':>5}  {'requested':>11}  {'kernel':>16}  {'mlx-infer tok/s':>15}  {'llama.cpp tok/s':>15}  ratio")
    runs = []
    for r in range(args.pairs):
        for isa in isas:
            env = dict(os.environ, MLX_INFER_KERNEL_ISA=isa)
            done = subprocess.run([sys.executable, __file__, "--child", "--trials", str(args.trials),
                                   "--max-tokens", str(args.max_tokens)], env=env, capture_output=True, text=True,
                                  check=True)
            row = dict(json.loads(done.stdout.strip().splitlines()[-1]), round=r, requested=isa)
            runs.append(row)
            print(f"{r:>5}  {isa:>11}  {row['kernel']:>16}  {row['mlx_infer_decode_tps']:>15.1f}  "
                  f"{row['llama_cpp_decode_tps']:>15.1f}  {row['ratio']:.2f}")
    for isa in isas:
        ratios = [row["ratio"] for row in runs if row["requested"] == isa]
        print(f"{isa}: mlx-infer / llama.cpp {min(ratios):.2f}-{max(ratios):.2f}")
    path = write_result("variants", {"machine": info, "args": vars(args), "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
