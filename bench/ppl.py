"""Perplexity of the default model on wikitext-2 test windows under KV eviction (the paged KV cache), and the
teacher-forced core (`window_nll`) every lossy KV knob reuses with its own cache.

Method: each window is P + T consecutive tokens of wikitext-2's test split (`--windows` windows, evenly
spaced over the tokenized file, not overlapping). Teacher-forced decoding: one forward prefills the first P
tokens, then the following reference tokens are fed one at a time, each a forward of one token through the
cache; the logits of every forward score the next reference token, so T tokens are scored (the first from
the prefill's last position). Between two forwards the cache evicts as its policy decides, through the
engine's own machinery (KVRequest: the query tap, the AttentionObserver, the EvictionController and the
Repacker), so the quality measured is that of the real cache. NLL of a position = -log softmax(logits)[next
reference token], in nats; PPL = exp(mean NLL over all scored positions of all windows). Greedy agreement:
the fraction of scored positions where the argmax of the evicted run equals the argmax of the full-cache run
on the same window (the same teacher-forced inputs, so positions pair exactly). The full cache is the paged
cache without eviction (its NLL equals one full forward's, tests/kv/test_ppl.py).

One difference from Engine.stream_steps: mlx-lm's decode loop builds the next forward before the engine's
eviction step, so there eviction takes effect one forward later and the first observation sees the first
decode query instead of the prefill's last ones; here eviction happens strictly between forwards.

    python bench/ppl.py                                   # 2 windows of 256 + 128 tokens, 5 policies x 3 ratios
    python bench/ppl.py --windows 4 --prefix 256 --tokens 256 --policies h2o,snapkv --ratios 0.5 --repack off

Prints a table (policy, ratio, ppl, delta vs the full cache, greedy agreement, live tokens at the end: SnapKV
evicts once, after the prefill, so it ends holding more than the others), writes bench/results/ppl-*.json
and, when matplotlib is installed, a PNG next to it: perplexity against retention (1 - ratio), one line per
policy. Repacking never changes the logits (docs/kv.md), so `--repack` changes only the retained blocks
recorded in the JSON.
"""

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import mlx_infer  # noqa: F401  (first: preloads the optimized BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, machine_line, pyplot, write_result  # noqa: E402

from mlx_infer.kv.options import EvictSpec, parse_evict  # noqa: E402
from mlx_infer.kv.session import KVRequest, PagedKV, release  # noqa: E402

WIKITEXT = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "wikitext-2" / "test.txt"


def wikitext_windows(tokenizer, n_windows: int, length: int, path: Path = WIKITEXT) -> List[List[int]]:
    """`n_windows` windows of `length` token ids each from wikitext-2 test (the whole file tokenized once),
    starting at evenly spaced offsets, not overlapping.

    Raises:
        SystemExit: the file holds fewer than n_windows * length tokens.
    """
    ids = list(tokenizer.encode(path.read_text()))
    if n_windows * length > len(ids):
        raise SystemExit(f"wikitext-2 test has {len(ids)} tokens, {n_windows} windows of {length} asked for")
    stride = len(ids) // n_windows
    return [ids[i * stride:i * stride + length] for i in range(n_windows)]


def window_nll(model: nn.Module, tokens: Sequence[int], prefix_len: int, make_cache: Callable[[], list],
               on_step: Optional[Callable[[list], None]] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Teacher-forced next-token NLL of one window through a cache.

    Args:
        model: an mlx-lm model (logits [1, L, vocab] for input ids [1, L]).
        tokens: the window, N int token ids, N > prefix_len.
        prefix_len: P >= 1, tokens prefilled in one forward; then tokens[P .. N-2] go in one per forward.
        make_cache: called once before the prefill: the per-layer caches (mlx-lm's prompt_cache protocol,
            e.g. `lambda: make_prompt_cache(model)`, a paged cache, a quantized one).
        on_step: called with the caches after every forward but the last, before the next one (where a
            lossy cache evicts); None: nothing.

    Returns:
        (nll, argmax): float64 [N - P], nll[i] = -log p(tokens[P + i] | what the cache holds of tokens[:P + i])
        in nats (log-softmax of the float32 logits); int64 [N - P], the argmax of the same logits.
    """
    if not 1 <= prefix_len < len(tokens):
        raise ValueError(f"prefix_len must be in [1, {len(tokens)}), got {prefix_len}")
    cache = make_cache()
    ids = mx.array(list(tokens), mx.int32)
    nll, top = [], []
    x = ids[None, :prefix_len]
    for i in range(prefix_len, len(tokens)):
        logits = model(x, cache=cache)[0, -1].astype(mx.float32)  # [vocab]
        n, a = mx.logsumexp(logits) - logits[int(tokens[i])], mx.argmax(logits)
        mx.eval(n, a)
        nll.append(n.item())
        top.append(a.item())
        if i + 1 < len(tokens):
            if on_step is not None:
                on_step(cache)
            x = ids[None, i:i + 1]
    return np.array(nll, np.float64), np.array(top, np.int64)


def paged_nll(model: nn.Module, kv: PagedKV, tokens: Sequence[int], prefix_len: int,
              evict: Optional[EvictSpec], repack: bool = True) -> Tuple[np.ndarray, np.ndarray, dict]:
    """`window_nll` on a fresh request of the paged cache `kv`, evicting per `evict` (None: the full cache)
    between forwards through KVRequest, as the engine does. Returns (nll, argmax, the request's kv stats as
    GenerationStats.kv); the request's blocks go back to the pool."""
    cache = kv.new_cache()
    try:
        with KVRequest(kv, cache, evict, repack) as req:
            nll, top = window_nll(model, tokens, prefix_len, lambda: cache, lambda _: req.step())
        return nll, top, req.stats()
    finally:
        release(cache)


def ppl(nll: np.ndarray) -> float:
    """Perplexity exp(mean NLL) of NLLs in nats."""
    return float(math.exp(float(np.mean(nll))))


def plot(rows: List[dict], full_ppl: float, path: Path) -> Optional[Path]:
    """Perplexity against retention (1 - ratio), one line per policy, the full cache dashed; the PNG's path,
    or None (with a note printed) when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((1 - r["ratio"], r["ppl"]) for r in rows if r["policy"] == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.axhline(full_ppl, color="k", linestyle="--", label="full cache")
    ax.set_xlabel("retention (1 - eviction ratio)")
    ax.set_ylabel("perplexity (wikitext-2 test)")
    ax.set_yscale("log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(plt.ScalarFormatter())
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=2, help="wikitext windows")
    ap.add_argument("--prefix", type=int, default=256, help="P: tokens prefilled per window")
    ap.add_argument("--tokens", type=int, default=128, help="T: reference tokens scored per window")
    ap.add_argument("--policies", default="h2o,scissorhands,streaming,snapkv,random")
    ap.add_argument("--ratios", default="0.3,0.5,0.7", help="eviction ratios (fraction of tokens evicted)")
    ap.add_argument("--repack", choices=("on", "off"), default="on", help="off: Naive-Evict (same logits)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weights", default="float32")
    args = ap.parse_args()
    specs = [parse_evict(f"{p}:{r}") for p in args.policies.split(",") for r in args.ratios.split(",")]
    repack = args.repack == "on"

    engine = mlx_infer.load(weights=args.weights)
    kv = PagedKV(engine.model, None, args.block_size)
    windows = wikitext_windows(engine.tokenizer, args.windows, args.prefix + args.tokens)
    info = machine()
    print(f"model: {engine.source.name} ({args.weights}); {args.windows} wikitext-2 test windows of "
          f"{args.prefix} prefilled + {args.tokens} scored tokens; block {args.block_size}; repack {args.repack}")
    print(machine_line(info), flush=True)

    start = time.perf_counter()
    runs = {None: [paged_nll(engine.model, kv, w, args.prefix, None) for w in windows]}
    for spec in specs:
        runs[spec] = [paged_nll(engine.model, kv, w, args.prefix, spec, repack) for w in windows]
        print(f"  {spec}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    full_nll = np.concatenate([r[0] for r in runs[None]])
    full_top = np.concatenate([r[1] for r in runs[None]])
    full_ppl = ppl(full_nll)

    rows = []
    for spec, per_window in runs.items():
        nll = np.concatenate([r[0] for r in per_window])
        top = np.concatenate([r[1] for r in per_window])
        p = ppl(nll)
        rows.append({
            "policy": spec.policy if spec else "full", "ratio": spec.ratio if spec else 0.0,
            "ppl": round(p, 4), "delta": round(p - full_ppl, 4), "delta_pct": round(100 * (p / full_ppl - 1), 2),
            "agreement": round(float(np.mean(top == full_top)), 4),
            "mean_nll": round(float(np.mean(nll)), 5),
            "window_ppl": [round(ppl(r[0]), 4) for r in per_window],
            "window_agreement": [round(float(np.mean(r[1] == f[1])), 4) for r, f in zip(per_window, runs[None])],
            "blocks_mean": [r[2]["retained_blocks"] for r in per_window],
            "live_end": [r[2]["live_tokens"] for r in per_window],
            "evicted": [r[2]["evicted_tokens"] for r in per_window],
            "repacks": [r[2]["repacks"] for r in per_window],
        })
    print(f"{'policy':<14}{'ratio':>6}{'ppl':>10}{'delta':>10}{'delta %':>9}{'agree':>8}{'live end':>10}")
    for r in rows:
        ratio = f"{r['ratio']:g}" if r["policy"] != "full" else "-"
        print(f"{r['policy']:<14}{ratio:>6}{r['ppl']:>10.3f}{r['delta']:>+10.3f}{r['delta_pct']:>+9.1f}"
              f"{r['agreement']:>8.3f}{np.mean(r['live_end']):>10.1f}")
    print(f"({len(full_nll)} scored tokens per row; live end: tokens the cache holds after the last forward, of "
          f"{args.prefix + args.tokens - 1}, mean over windows; SnapKV evicts once, after the prefill; "
          f"{time.perf_counter() - start:.0f} s)")
    result = {"machine": info, "command": " ".join(sys.argv), "model": engine.source.name,
              "weights": args.weights, "windows": args.windows, "prefix": args.prefix, "tokens": args.tokens,
              "block_size": args.block_size, "repack": repack, "full_ppl": round(full_ppl, 4),
              "wall_s": round(time.perf_counter() - start, 1), "rows": rows}
    path = write_result("ppl", result)
    print("wrote", path)
    png = plot([r for r in rows if r["policy"] != "full"], full_ppl, path.with_suffix(".png"))
    if png is not None:
        print("wrote", png)


if __name__ == "__main__":
    main()
