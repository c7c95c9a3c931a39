"""The decode / verify attention kernel and the default model's forward at long contexts, against the same
code at another git commit: one process per side, the sides alternated for --rounds rounds.

Each process measures (medians of --calls evaluations after a warm-up):
  kernel   dense_attention (the paged-attention kernel over an mlx-lm KVCache buffer) with the default
           model's head shapes (9 query heads, 3 KV heads, head_dim 64), random float32 K / V, for every
           context of --contexts and query width 1 (decode) and 9 (a verify of 8 drafted tokens), 30 calls
           per evaluation (the default model's layers): "hot" = over 2 layers' K / V in turn (they stay in
           the caches: the kernel's arithmetic), "streamed" = over 30 layers' (at these contexts they do not
           fit the caches: what a decode step reads), microseconds per call
  model    the default model's forward of 1 and of 9 tokens over a cache holding the first `context`
           tokens of wikitext-2 (prefilled in chunks of 512, trimmed back after every call), ms
--against REF runs the same measurement on commit REF (a `git worktree` of it in a temporary folder, its
CPU kernels built there in their own cache, $MLX_INFER_CACHE) in the other process of each round. Each side
imports mlx_infer from its own tree ($PYTHONPATH), whatever is installed. Needs wikitext-2's test split at
../shared/data/wikitext-2/test.txt beside the repository (the model part's context).

Usage: python bench/attention.py [--against REF] [--rounds 3] [--contexts 1000,3000] [--calls 15]
Prints a table (and REF / this tree per cell) and writes bench/results/attention-*.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import alternated, machine, machine_line, positive_ints, wikitext_path, wikitext_text, write_result  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_infer.kernels.dense_attention import dense_attention  # noqa: E402
from mlx_infer.kernels.paged_attention import paged_attention_backend  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # the default model's attention
WIDTHS = (1, 9)
PREFILL_CHUNK = 512


def median_ms(fn, calls: int) -> float:
    """Median wall milliseconds of mx.eval(fn()) over `calls` calls, after one warm-up call."""
    mx.eval(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_cells(contexts, calls: int) -> dict:
    """'hot' / 'streamed' x context x width -> microseconds per call of the attention kernel (LAYERS calls
    per evaluation, over 2 or LAYERS layers' K / V in turn)."""
    out = {}
    for ctx in contexts:
        cap = -(-ctx // 256) * 256
        for name, layers in (("hot", 2), ("streamed", LAYERS)):
            kv = [(mx.random.normal((1, KV_HEADS, cap, HEAD_DIM)), mx.random.normal((1, KV_HEADS, cap, HEAD_DIM)))
                  for _ in range(layers)]
            mx.eval(kv)
            for width in WIDTHS:
                q = mx.random.normal((1, HEADS, width, HEAD_DIM))
                ms = median_ms(lambda: [dense_attention(q, *kv[i % layers], ctx, HEAD_DIM ** -0.5)
                                        for i in range(LAYERS)], calls)
                out[f"kernel {name} ctx={ctx} w={width} (us/call)"] = ms * 1e3 / LAYERS
            del kv
    return out


def model_cells(contexts, calls: int) -> dict:
    """context x width -> ms of the default model's forward over that many cached tokens."""
    engine = mlx_infer.load()
    model = engine.model
    ids = engine.tokenizer.encode(wikitext_text()[:12 * max(contexts)])
    out = {}
    for ctx in contexts:
        cache = make_prompt_cache(model)
        for i in range(0, ctx, PREFILL_CHUNK):
            mx.eval(model(mx.array([ids[i:min(i + PREFILL_CHUNK, ctx)]]), cache=cache))
        for width in WIDTHS:
            tokens = mx.array([ids[ctx - width:ctx]])

            def forward():
                logits = model(tokens, cache=cache)
                mx.eval(logits)
                for c in cache:
                    c.trim(width)
                return logits

            out[f"model ctx={ctx} w={width} (ms)"] = median_ms(forward, calls)
    return out


def measure(contexts, calls: int) -> dict:
    return {"attention": paged_attention_backend(), **kernel_cells(contexts, calls), **model_cells(contexts, calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default=None, help="a git commit (or ref) of this repository to compare with")
    ap.add_argument("--rounds", type=int, default=3, help="processes per side, alternated")
    ap.add_argument("--contexts", type=positive_ints, default=[1000, 3000], help="cached tokens, comma-separated")
    ap.add_argument("--calls", type=int, default=15, help="timed evaluations per cell (the median is kept)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    contexts = args.contexts
    wikitext_path()  # (the model part's context)
    if args.child:
        print(json.dumps(measure(contexts, args.calls)))
        return
    runs = alternated(__file__, args.against, args.rounds, ["--contexts", ",".join(map(str, contexts)), "--calls", str(args.calls)])
    info = machine()
    print(machine_line(info))
    names = list(runs)
    kernels = ", ".join(f"{n}: {runs[n][0]['attention']}" for n in names)
    print(f"attention kernel: {kernels}; medians of {args.rounds} processes per side")
    cells = [k for k in runs[names[-1]][0] if k != "attention"]
    table = []
    print(f"{'cell':<42}" + "".join(f"{n[:14]:>16}" for n in names) + ("      ratio" if len(names) == 2 else ""))
    for cell in cells:
        row = {"cell": cell, **{n: statistics.median(r[cell] for r in runs[n]) for n in names}}
        line = f"{cell:<42}" + "".join(f"{row[n]:>16.1f}" for n in names)
        if len(names) == 2:
            row["ratio"] = row[names[1]] / row[names[0]]
            line += f"{row['ratio']:>10.2f}x"
        table.append(row)
        print(line)
    path = write_result("attention", {"machine": info, "args": vars(args), "table": table, "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
