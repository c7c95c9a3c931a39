"""End-to-end tokens/s of this tree against the same code at another git commit: one process per side, the
sides alternated for --rounds rounds (this VM drifts by 10-30% between minutes; only alternated sides compare).

Each process loads the default model (or --model) as users get it and measures, after a warm-up:
  decode    one request: greedy decode tokens/s after the first token (`Engine.stream_steps`, pipelined as
            `generate`), a whole prefill each time, median of --trials
  batch     --concurrency requests (the prompts of bench/prompts in order, again from the first past the
            last; with --prompt-tokens N, windows of
            N tokens of wikitext-2, bench/kv_core.py's wikitext_ids, one after another in the text) through
            `Engine.generate_batch`, greedy, from an empty cache (no prefix-cache hits): total tokens / wall
            seconds, every prompt's prefill included, median of --trials
and the greedy tokens of both (the sides must agree).
--against REF runs the same measurement on commit REF (a `git worktree` of it in a temporary folder, its
CPU kernels built there in their own cache, $MLX_INFER_CACHE) in the other process of each round. Each side
imports mlx_infer from its own tree ($PYTHONPATH), whatever is installed.

Usage: python bench/throughput.py [--against REF] [--rounds 4] [--trials 3] [--max-tokens 64] [--concurrency 8]
                                  [--prompt-tokens N]
Prints a table (REF, this tree, the ratio of the medians over rounds and the per-round ratios) and writes
bench/results/throughput-*.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import (all_prompts, alternated, machine, machine_line, non_negative_int, positive_int,  # noqa: E402
                    wikitext_path, write_result)
from kv_core import wikitext_ids  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def prompts(n: int) -> list:
    """n prompts of bench/prompts (common.all_prompts), from the first again past the last."""
    out = all_prompts()
    return [out[i % len(out)] for i in range(n)]


def measure(model, trials: int, max_tokens: int, concurrency: int, prompt_tokens: int) -> dict:
    """This process's cells (see the module docstring)."""
    engine = mlx_infer.load(model)
    one = engine.encode(PROMPT)
    if prompt_tokens + max_tokens > engine.context_length:
        raise SystemExit(f"bench/throughput.py: --prompt-tokens {prompt_tokens} + --max-tokens {max_tokens} exceed the "
                         f"model's context window ({engine.context_length} tokens)")
    if prompt_tokens:
        many = [wikitext_ids(engine.tokenizer, prompt_tokens, skip_chars=40 * prompt_tokens * i) for i in range(concurrency)]
    else:
        many = [engine.encode(p) for p in prompts(concurrency)]

    def decode():
        engine.reset()  # a whole prefill every time
        first, tokens = None, []
        for s in engine.stream_steps(one, max_tokens=max_tokens):
            if s.token is not None:
                tokens.append(s.token)
                first = first or time.perf_counter()
        return tokens, (len(tokens) - 1) / (time.perf_counter() - first)

    def batch():
        engine.reset()  # no prefix-cache hits from the previous run: every prompt prefilled
        start = time.perf_counter()
        results = engine.generate_batch(many, max_tokens=max_tokens)
        wall = time.perf_counter() - start
        return [r.token_ids for r in results], sum(len(r.token_ids) for r in results) / wall

    decode(), batch()  # warm-up
    single = [decode() for _ in range(trials)]
    batched = [batch() for _ in range(trials)]
    return {"kernels": engine.source.kernels, "decode_tps": statistics.median(d[1] for d in single),
            "batch_tps": statistics.median(b[1] for b in batched), "decode_tokens": single[0][0],
            "batch_tokens": batched[0][0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=None, help="a git commit (or ref) of this repository to compare with")
    ap.add_argument("--model", default=None, help="GGUF / MLX dir / repo id (default: the embedded default model)")
    ap.add_argument("--rounds", type=positive_int, default=4, help="processes per side, alternated")
    ap.add_argument("--trials", type=positive_int, default=3, help="timed runs of each cell per process (the median is kept)")
    ap.add_argument("--max-tokens", type=positive_int, default=64)
    ap.add_argument("--concurrency", type=positive_int, default=8, help="requests of the batched cell")
    ap.add_argument("--prompt-tokens", type=non_negative_int, default=0,
                    help="the batched cell's prompts: windows of this many wikitext-2 tokens (0: bench/prompts)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.trials, args.max_tokens, args.concurrency, args.prompt_tokens)))
        return
    if args.prompt_tokens:
        wikitext_path()  # before any process starts
    child = ["--trials", str(args.trials), "--max-tokens", str(args.max_tokens), "--concurrency", str(args.concurrency),
             "--prompt-tokens", str(args.prompt_tokens)]
    runs = alternated(__file__, args.against, args.rounds, child + (["--model", args.model] if args.model else []))
    info = machine()
    names = list(runs)
    print(machine_line(info))
    print("kernels: " + ", ".join(f"{n}: {runs[n][0]['kernels']}" for n in names) +
          f"; medians of {args.rounds} processes per side, {args.trials} runs each, {args.max_tokens} tokens")
    table = []
    print(f"{'cell':<28}" + "".join(f"{n[:14]:>16}" for n in names) + ("      ratio  per round" if len(names) == 2 else ""))
    prompts_of = f" x {args.prompt_tokens}" if args.prompt_tokens else ""
    for cell, label in (("decode_tps", "decode tok/s, 1 request"),
                        ("batch_tps", f"tok/s, {args.concurrency}{prompts_of} batched")):
        row = {"cell": cell, **{n: statistics.median(r[cell] for r in runs[n]) for n in names}}
        line = f"{label:<28}" + "".join(f"{row[n]:>16.1f}" for n in names)
        if len(names) == 2:
            row["ratio"] = row[names[1]] / row[names[0]]
            row["round_ratios"] = [b[cell] / a[cell] for a, b in zip(runs[names[0]], runs[names[1]])]
            line += f"{row['ratio']:>10.3f}x  " + " ".join(f"{r:.2f}" for r in row["round_ratios"])
        table.append(row)
        print(line)
    same = all(r["decode_tokens"] == runs[names[0]][0]["decode_tokens"] and
               r["batch_tokens"] == runs[names[0]][0]["batch_tokens"] for n in names for r in runs[n])
    print(f"greedy tokens the same on every side and round: {same}")
    path = write_result("throughput", {"machine": info, "args": vars(args), "table": table, "same_tokens": same,
                                       "runs": {n: [{k: v for k, v in r.items() if not k.endswith('_tokens')}
                                                    for r in rs] for n, rs in runs.items()}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
