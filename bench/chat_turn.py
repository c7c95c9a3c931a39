"""TTFT of a chat's next turn over a long history, against the first turn's, in Python and in the CLI.

A chat's next turn prefills only the new message (and the template around it): on the paged KV cache from
the full blocks of the earlier turns in the prefix cache (what `mlx-infer chat` and `mlx-infer serve` use),
on the dense cache from the last request's kept cache. Measured on the default model:

  python-dense / python-paged
           Engine.generate(history) on an engine of each KV cache over one loaded model: the first turn (a
           ~1.2k-token user message, the cache empty), then the next turn (history + the answer + a short
           question); `reset()` between trials.
  cli / cli-dense
           `mlx-infer chat --stats` (its default paged cache, and --kv-cache dense) with both turns piped
           on stdin; TTFT read from its stats lines.
All paths interleaved, --trials times; medians.

Usage: python bench/chat_turn.py [--trials 3] [--history-tokens 1200] [--max-tokens 16]
Prints the table and writes bench/results/chat_turn-*.json.
"""

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from mlx_infer.engine import Engine  # noqa: E402
from common import machine, write_result  # noqa: E402

FACT = "The archive in the old library keeps letters, maps and diaries from the town's first century. "
QUESTION = "Summarize that in one sentence."


def history_text(engine, tokens: int) -> str:
    """A user message of about `tokens` tokens."""
    per = len(engine.tokenizer.encode(FACT))
    return FACT * max(1, tokens // per)


def python_trial(engine, text: str, max_tokens: int) -> dict:
    engine.reset()
    history = [{"role": "user", "content": text}]
    first = engine.generate(history, max_tokens=max_tokens, speculative="off")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": QUESTION}]
    second = engine.generate(history, max_tokens=max_tokens, speculative="off")
    return {"first_ttft_s": first.stats.ttft_s, "next_ttft_s": second.stats.ttft_s,
            "first_prompt": first.stats.prompt_tokens, "next_prompt": second.stats.prompt_tokens,
            "next_cached": second.stats.cached_prompt_tokens}


def cli_trial(text: str, max_tokens: int, *flags: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "mlx_infer", "chat", "--stats", "--spec", "off", "-n", str(max_tokens),
                          *flags],
                         input=f"{text}\n{QUESTION}\n", capture_output=True, text=True, timeout=600)
    ttfts = [float(x) for x in re.findall(r"TTFT ([0-9.]+) s", out.stderr)]
    if len(ttfts) != 2:
        raise RuntimeError(f"expected two stats lines from mlx-infer chat, got: {out.stderr[-500:]}")
    return {"first_ttft_s": ttfts[0], "next_ttft_s": ttfts[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--history-tokens", type=int, default=1200)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    dense = mlx_infer.load()
    paged = Engine(dense.model, dense.tokenizer, dense.config, dense.source, kv_cache="paged")
    text = history_text(dense, args.history_tokens)
    for engine in (dense, paged):
        python_trial(engine, text, 2)  # warm-up: compiles shapes, converts nothing twice
    rows = {"python-dense": [], "python-paged": [], "cli": [], "cli-dense": []}
    for _ in range(args.trials):
        rows["python-dense"].append(python_trial(dense, text, args.max_tokens))
        rows["python-paged"].append(python_trial(paged, text, args.max_tokens))
        rows["cli"].append(cli_trial(text, args.max_tokens))
        rows["cli-dense"].append(cli_trial(text, args.max_tokens, "--kv-cache", "dense"))
    summary = {}
    print(f"{'path':13} {'first TTFT s':>13} {'next TTFT s':>12} {'ratio':>6}")
    for path, trials in rows.items():
        first = statistics.median(t["first_ttft_s"] for t in trials)
        nxt = statistics.median(t["next_ttft_s"] for t in trials)
        summary[path] = {"first_ttft_s": first, "next_ttft_s": nxt, "ratio": nxt / first}
        print(f"{path:13} {first:13.3f} {nxt:12.3f} {nxt / first:6.2f}")
    for path in ("python-dense", "python-paged"):
        p = rows[path][0]
        print(f"({path}: first prompt {p['first_prompt']} tokens; next prompt {p['next_prompt']}, "
              f"{p['next_cached']} of them from earlier turns)")
    write_result("chat_turn", {"machine": machine(), "args": vars(args), "trials": rows, "summary": summary})


if __name__ == "__main__":
    main()
