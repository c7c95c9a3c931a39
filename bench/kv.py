"""Naive-Evict vs vToken repacking through the Engine's paged KV cache: retained blocks, memory, quality.

    python bench/kv.py                     # H2O, Scissorhands, StreamingLLM x ratios 0.3 / 0.5 / 0.7
    python bench/kv.py --prompt 512 --tokens 64 --budget 256MiB --policies h2o --ratios 0.5
    python bench/kv.py --tiny-context 16384 --prompt 16000 --tokens 64 --ratios 0.5 --policies h2o,scissorhands
    python bench/kv.py --batched 16 --prompt 256 --tokens 768 --budget 270MiB --policies h2o --ratios 0.5
    python bench/kv.py --step-times --prompt 4096 --tokens 12 --policies h2o --ratios 0.5 --weights auto

On the default model: one wikitext window (bench/kv_core.py's wikitext_ids) as the prompt, greedy, `--tokens`
generated; first with the full cache (the paged cache without eviction), then per policy and ratio with
`evict=POLICY:RATIO` and repack on (vToken) and off (Naive-Evict: the same decisions, blocks freed only when
empty). Columns: retained blocks per request, time average over the decode steps ("mean") and at the end
("end"), the most over the decode steps ("max", after each step's eviction), peak KV bytes of the request
(the prefill included: eviction starts after it), the most such requests a `--budget` pool holds
(budget / peak blocks, and budget / max decode blocks: the steady state once the prefills are done),
greedy agreement with the full cache (fraction of equal tokens position by position, and the length of the
common prefix) and decode tokens/s. The machine may be shared: tokens/s are indicative only. It also plots
the request's KV blocks in the pool after each decode step (kv-*.png: one panel per policy and ratio, the full
cache, Naive-Evict and vToken), the curve whose time average is the "mean" column.

--tiny-context N runs the same on a tiny random-weight llama (tests/gguf_factory.py: 2 layers, 2 KV heads of
16) whose context window is N tokens, for long-context configs the default model (8,192 tokens) cannot
hold; its agreement columns mean nothing (random weights), its blocks are what eviction and repacking
leave.

--batched N instead decodes N requests together (Engine.generate_batch, continuous batching; wikitext
windows at different offsets) under the --budget, with the full cache, then per policy and ratio with
Naive-Evict and with vToken: the most requests decoding at once (from each request's first-token and end
times), total tokens/s (all tokens / wall seconds, prefill included) and the mean retained blocks per
request. Admission reserves each request's worst case in blocks: every token without eviction and with
Naive-Evict (which frees only empty blocks), the most tokens it keeps live with vToken (repacked on
demand), which is how more requests fit the same budget.

--step-times prints the wall time of each decode step of one request with vToken and with Naive-Evict (the
same evictions, no repack), in turn, --trials times: the step after a repack against the same step
without it is what the repack cost, and every OBSERVE_PERIOD-th step, which scores the attention
statistics, against the others is what an observation costs. It ends with the medians of the three kinds
of step.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx_infer

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import machine, pyplot, write_result  # noqa: E402
from gguf_factory import TinySpec, random_weights, write_gguf  # noqa: E402
from kv_core import wikitext_ids  # noqa: E402

from mlx_infer.kv.store import common_prefix  # noqa: E402
from mlx_infer.generation.results import collect  # noqa: E402
from mlx_infer.kv.defaults import OBSERVE_PERIOD  # noqa: E402
from mlx_infer.kv.options import parse_budget  # noqa: E402


def run(engine, prompt, tokens, evict=None, repack=True):
    """(GenerationResult, [the pool's blocks in use after each generated token, that step's eviction and
    repack included, up to the final step, which comes once the request's blocks are released]) of one
    request alone on the engine's pool."""
    engine.reset()
    pool, series = engine.kv_pool, []

    def steps():
        for step in engine.stream_steps(prompt, max_tokens=tokens, evict=evict, repack=repack):
            if step.token is not None and step.finish_reason is None:
                series.append(pool.blocks_in_use)
            yield step

    r = collect(steps())
    engine.reset()
    return r, series


def plot_series(curves, path, title):
    """Retained blocks after each decode step, one panel per (policy, ratio): the full cache, Naive-Evict
    and vToken ({(policy, ratio): {system: [blocks]}}, "full" under every key)."""
    plt = pyplot()
    if plt is None:
        return None
    keys = sorted(curves)
    policies = sorted({k[0] for k in keys})
    ratios = sorted({k[1] for k in keys})
    fig, axes = plt.subplots(len(policies), len(ratios), figsize=(max(6.0, 3.6 * len(ratios)), 2.8 * len(policies) + 0.4),
                             squeeze=False, sharex=True)
    for (policy, ratio), lines in curves.items():
        ax = axes[policies.index(policy)][ratios.index(ratio)]
        # Naive-Evict wide, vToken dashed and the full cache dotted on top: where curves coincide all show
        for system, style, width, label in (("naive", "-", 3.0, "Naive-Evict"), ("vtoken", "--", 1.5, "vToken"),
                                            ("full", ":", 1.5, "full cache")):
            ys = lines[system]
            ax.plot(range(1, len(ys) + 1), ys, style, lw=width, label=label)
        ax.set_ylim(0, max(max(v) for v in lines.values()) * 1.25 + 1)  # headroom for the legend
        ax.set_title(f"{policy}:{ratio:g}", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("decode step (token)")
    for row in axes:
        row[0].set_ylabel("KV blocks retained")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def row(name, ratio, system, r, full, budget_blocks, block_bytes):
    kv, ids = r.stats.kv, r.token_ids
    n = min(len(ids), len(full.token_ids))
    peak_blocks = kv["peak_kv_bytes"] // block_bytes
    return {
        "policy": name, "ratio": ratio, "system": system,
        "blocks_mean": kv["retained_blocks"], "blocks_end": kv["retained_blocks_end"],
        "blocks_max": kv["retained_blocks_max"], "peak_kv_mb": round(kv["peak_kv_bytes"] / 2**20, 2),
        "peak_blocks": peak_blocks,
        "max_requests_peak": budget_blocks // peak_blocks if peak_blocks else None,
        "max_requests_decode": budget_blocks // kv["retained_blocks_max"] if kv["retained_blocks_max"] else None,
        "live_end": kv["live_tokens"], "waste_end": kv["waste"], "repacks": kv["repacks"],
        "repack_s": kv["repack_s"], "evicted": kv["evicted_tokens"],
        "agreement": round(sum(a == b for a, b in zip(ids, full.token_ids)) / n, 3) if n else 0.0,
        "common_prefix": common_prefix(ids, full.token_ids), "generated": len(ids),
        "decode_tps": round(r.stats.decode_tps, 1),
    }


def max_overlap(intervals):
    """The most intervals (start, end) open at once."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def batched_rows(engine, args):
    """--batched: N requests decoding together under the budget, per eviction setting (the engine's KV
    configured with it first)."""
    prompts = [wikitext_ids(engine.tokenizer, args.prompt, skip_chars=args.skip + 4000 * i) for i in range(args.batched)]
    settings = [("full", None, True)]
    for name in args.policies.split(","):
        for ratio in (float(x) for x in args.ratios.split(",")):
            settings += [("naive", f"{name}:{ratio:g}", False), ("vtoken", f"{name}:{ratio:g}", True)]
    rows = []
    for system, evict, repack in settings:
        engine.reset()
        t0 = time.perf_counter()
        out = engine.generate_batch(prompts, max_tokens=args.tokens, chat_template=False, evict=evict,
                                    repack=repack, max_batch=args.batched, prefix_cache=False)
        wall = time.perf_counter() - t0
        tokens = sum(r.stats.generated_tokens for r in out)
        kv = [r.stats.kv for r in out if r.stats.kv is not None]
        rows.append({"system": system, "evict": evict, "requests": len(out), "tokens": tokens,
                     "wall_s": round(wall, 2), "total_tps": round(tokens / wall, 1),
                     "max_concurrent": max_overlap([(r.stats.ttft_s, r.stats.total_s) for r in out]),
                     "blocks_mean": round(sum(k["retained_blocks"] for k in kv) / len(kv), 1) if kv else None,
                     "repacks": sum(k["repacks"] for k in kv) if kv else None})
        print(rows[-1], flush=True)
    full = rows[0]["max_concurrent"]
    for r in rows:
        r["concurrency_vs_full"] = round(r["max_concurrent"] / full, 2)
    return rows


def step_times(engine, prompt, tokens, evict, repack):
    """Wall milliseconds of each decode step (token to token) of one request, and its kv stats."""
    engine.reset()
    times, last, step = [], None, None
    for step in engine.stream_steps(prompt, max_tokens=tokens, evict=evict, repack=repack, chat_template=False):
        now = time.perf_counter()
        if last is not None:
            times.append(round(1000 * (now - last), 1))
        last = now
    engine.reset()
    return times, step.stats.kv


def step_rows(engine, prompt, args):
    """--step-times: per policy and ratio, vToken's and Naive-Evict's step times, in turn, --trials times."""
    rows = []
    for name in args.policies.split(","):
        for ratio in (float(x) for x in args.ratios.split(",")):
            spec = f"{name}:{ratio:g}"
            for trial in range(args.trials):
                for system, repack in (("vtoken", True), ("naive", False)):
                    times, kv = step_times(engine, prompt, args.tokens, spec, repack)
                    rows.append({"evict": spec, "system": system, "trial": trial, "step_ms": times,
                                 "repacks": kv["repacks"], "repack_ms": round(1000 * kv["repack_s"], 2)})
                    print(rows[-1], flush=True)
    print("medians (ms): the first decode step (vToken repacks there), the observation steps (every "
          f"{OBSERVE_PERIOD}th), the others")
    for spec in dict.fromkeys(r["evict"] for r in rows):
        for system in ("vtoken", "naive"):
            steps = [r["step_ms"] for r in rows if r["evict"] == spec and r["system"] == system]
            kinds = {"first": [t[0] for t in steps],
                     "observe": [x for t in steps for i, x in enumerate(t) if i % OBSERVE_PERIOD == OBSERVE_PERIOD - 1],
                     "other": [x for t in steps for i, x in enumerate(t) if i and i % OBSERVE_PERIOD != OBSERVE_PERIOD - 1]}
            print(f"  {spec} {system}: " + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in kinds.items() if v))
    return rows


def tiny_model(context: int, folder: Path) -> str:
    """A tiny random-weight llama GGUF whose context window is `context` tokens (tests/gguf_factory.py)."""
    spec = TinySpec("llama", context=context)
    return str(write_gguf(folder / f"tiny-llama-{context}.gguf", spec, random_weights(spec, seed=0)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=512, help="wikitext prompt tokens")
    ap.add_argument("--skip", type=int, default=0, help="characters of wikitext skipped")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--budget", default="256MiB", help="the fixed KV budget of the concurrency column")
    ap.add_argument("--policies", default="h2o,scissorhands,streaming",
                    help="eviction policies, comma-separated (h2o, scissorhands, streaming, snapkv, random)")
    ap.add_argument("--ratios", default="0.3,0.5,0.7", help="eviction ratios (fraction of tokens evicted), comma-separated")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    ap.add_argument("--weights", default="float32", help="auto, native or float32 (as mlx_infer.load)")
    ap.add_argument("--model", default=None, help="GGUF / MLX dir / repo id (default: the embedded default model)")
    ap.add_argument("--tiny-context", type=int, default=None, metavar="N",
                    help="a tiny random-weight llama with an N-token context instead of --model")
    ap.add_argument("--batched", type=int, default=None, metavar="N",
                    help="N requests decoding together under --budget (see above)")
    ap.add_argument("--step-times", action="store_true",
                    help="the wall time of each decode step, vToken against Naive-Evict (what a repack costs a step)")
    ap.add_argument("--trials", type=int, default=2, help="--step-times: runs of each system")
    args = ap.parse_args()
    folder = tempfile.TemporaryDirectory()
    model = tiny_model(args.tiny_context, Path(folder.name)) if args.tiny_context else args.model
    label = f"tiny llama ({args.tiny_context}-token context)" if args.tiny_context else (args.model or "default model")
    engine = mlx_infer.load(model, weights=args.weights, kv_cache="paged", block_size=args.block_size)
    if args.batched:
        engine.configure_kv(kv_cache="paged", kv_budget=args.budget, block_size=args.block_size)
        budget_blocks = engine.kv_pool.max_blocks
        rows = batched_rows(engine, args)
        cols = ["system", "evict", "requests", "max_concurrent", "concurrency_vs_full", "total_tps", "wall_s",
                "blocks_mean", "repacks"]
        print(f"{label}, {args.batched} requests of {args.prompt} wikitext tokens + {args.tokens} generated, "
              f"block {args.block_size}, budget {args.budget} = {budget_blocks} blocks")
        print(" | ".join(cols))
        for r in rows:
            print(" | ".join(str(r.get(c)) for c in cols))
        result = {"machine": machine(), "command": " ".join(sys.argv), "model": label, "rows": rows,
                  "budget": args.budget, "budget_blocks": budget_blocks}
        print("wrote", write_result("kv-batched", result))
        return
    prompt = wikitext_ids(engine.tokenizer, args.prompt, skip_chars=args.skip)
    if args.step_times:
        rows = step_rows(engine, prompt, args)
        result = {"machine": machine(), "command": " ".join(sys.argv), "model": label, "rows": rows}
        print("wrote", write_result("kv-steps", result))
        return
    full, full_series = run(engine, prompt, args.tokens)
    series = {}
    block_bytes = engine.kv_pool.block_bytes
    budget_blocks = parse_budget(args.budget) // block_bytes
    rows = [row("full", 0.0, "full", full, full, budget_blocks, block_bytes)]
    mismatched = []
    for name in args.policies.split(","):
        for ratio in (float(x) for x in args.ratios.split(",")):
            spec = f"{name}:{ratio:g}"
            naive, naive_series = run(engine, prompt, args.tokens, spec, repack=False)
            packed, packed_series = run(engine, prompt, args.tokens, spec, repack=True)
            series[(name, ratio)] = {"full": full_series, "naive": naive_series, "vtoken": packed_series}
            if naive.token_ids != packed.token_ids:
                mismatched.append(spec)
            rows += [row(name, ratio, "naive", naive, full, budget_blocks, block_bytes),
                     row(name, ratio, "vtoken", packed, full, budget_blocks, block_bytes)]
            n, v = rows[-2], rows[-1]
            for r in (n, v):
                r["fewer_blocks_mean_pct"] = round(100 * (1 - v["blocks_mean"] / n["blocks_mean"]), 1)
                r["fewer_blocks_end_pct"] = round(100 * (1 - v["blocks_end"] / n["blocks_end"]), 1)
    cols = ["policy", "ratio", "system", "blocks_mean", "blocks_end", "blocks_max", "peak_kv_mb",
            "max_requests_peak", "max_requests_decode", "live_end", "repacks", "agreement", "common_prefix",
            "decode_tps"]
    print(f"{label}, prompt {args.prompt} wikitext tokens, {args.tokens} generated, block {args.block_size}, "
          f"budget {args.budget} = {budget_blocks} blocks of {block_bytes} bytes")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c)) for c in cols))
    print("Naive-Evict and vToken tokens identical:", "yes" if not mismatched else f"NO for {mismatched}")
    result = {"machine": machine(), "command": " ".join(sys.argv), "model": label, "prompt_tokens": args.prompt,
              "tokens": args.tokens, "budget": args.budget, "budget_blocks": budget_blocks,
              "block_bytes": block_bytes, "weights": args.weights, "rows": rows, "naive_vtoken_mismatch": mismatched,
              "blocks_per_step": {f"{p}:{r:g}": v for (p, r), v in series.items()}}
    path = write_result("kv", result)
    png = plot_series(series, path.with_suffix(".png"),
                      f"{label}: KV blocks after each decode step (prompt {args.prompt} tokens, block {args.block_size})")
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
