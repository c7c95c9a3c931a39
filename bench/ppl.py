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

Quantized KV (`--kv-bits`): the same teacher-forced core on mlx-lm's float KVCache and on mlx-infer's
QuantKVCache (kv/quant_cache.py, with the attention hook: attention reads the packed K/V through the fused
kernel, as the engine does), from the first token (kv_quant_start 0) and during the prefill too. Per window
length L (`--lengths`), `--windows` windows of L tokens: L - T prefilled, the last T (default 64) scored one
forward each. Per setting: PPL, its difference from float KV's (absolute, and %), the mean KL divergence
KL(p_float || p_quant) of the next-token distribution over the scored positions (nats; float KV run on the
same window with the same inputs), greedy agreement with float KV, and the KV bytes per token.
`--kivi-residuals` adds KIVI's float window swept at one length (`--residual-length`), for each group size
of `--residual-groups` that divides it (KIVI flushes whole groups of tokens: a residual is a multiple of the
group size).

    python bench/ppl.py --kv-bits float,8,4,k8v4,kivi-4,kivi-8 --lengths 512,2048,4096 --windows 2,1,1 \
        --kivi-residuals 32,64,128 --residual-length 2048

Writes bench/results/ppl-kv-*.json and a PNG next to it: mean KL against the window length per setting.
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
from common import WIKITEXT, machine, machine_line, positive_ints, pyplot, wikitext_text, write_result  # noqa: E402

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_infer.kv.attention_hook import install as install_attention_hook  # noqa: E402
from mlx_infer.kv.defaults import KIVI_RESIDUAL, KV_GROUP_SIZE  # noqa: E402
from mlx_infer.kv.options import EvictSpec, parse_evict  # noqa: E402
from mlx_infer.kv.quant_cache import kv_bytes_per_token, make_quant_cache  # noqa: E402
from mlx_infer.kv.quant_options import KVQuant, kv_quant  # noqa: E402
from mlx_infer.kv.session import KVRequest, PagedKV, release  # noqa: E402



def wikitext_windows(tokenizer, n_windows: int, length: int, path: Path = WIKITEXT) -> List[List[int]]:
    """`n_windows` windows of `length` token ids each from wikitext-2 test (the whole file tokenized once),
    starting at evenly spaced offsets, not overlapping.

    Raises:
        SystemExit: the file holds fewer than n_windows * length tokens.
    """
    ids = list(tokenizer.encode(wikitext_text() if path == WIKITEXT else path.read_text()))
    if n_windows * length > len(ids):
        raise SystemExit(f"wikitext-2 test has {len(ids)} tokens, {n_windows} windows of {length} asked for")
    stride = len(ids) // n_windows
    return [ids[i * stride:i * stride + length] for i in range(n_windows)]


def window_nll(model: nn.Module, tokens: Sequence[int], prefix_len: int, make_cache: Callable[[], list],
               on_step: Optional[Callable[[list], None]] = None,
               logp_out: Optional[list] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Teacher-forced next-token NLL of one window through a cache.

    Args:
        model: an mlx-lm model (logits [1, L, vocab] for input ids [1, L]).
        tokens: the window, N int token ids, N > prefix_len.
        prefix_len: P >= 1, tokens prefilled in one forward; then tokens[P .. N-2] go in one per forward.
        make_cache: called once before the prefill: the per-layer caches (mlx-lm's prompt_cache protocol,
            e.g. `lambda: make_prompt_cache(model)`, a paged cache, a quantized one).
        on_step: called with the caches after every forward but the last, before the next one (where a
            lossy cache evicts); None: nothing.
        logp_out: a list that receives each scored position's log-softmax (float32 numpy [vocab]), for
            divergences between two caches (`mean_kl`); None: not kept.

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
        if logp_out is not None:
            logp = logits - mx.logsumexp(logits)
            mx.eval(n, a, logp)
            logp_out.append(np.array(logp))
        else:
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


def parse_kv_setting(text: str) -> Tuple[str, Optional[KVQuant]]:
    """A `--kv-bits` entry as (label, KVQuant or None): "float" (mlx-lm's float KVCache); "8", "4", "k8v4"
    (the affine scheme); "kivi-4", "kivi-8", "kivi-k8v4" (KIVI, its default residual window); a suffix
    "@rN" sets KIVI's residual to N tokens (e.g. "kivi-4@r32"); "@gN" the group size; "@rot" / "@norot"
    rotates every affine store / none (the default rotates the 4-bit ones; "@norot": MLX's plain codes, as
    mlx-lm stores them)."""
    label = text.strip().lower()
    base, *extras = label.split("@")
    if base in ("float", "none", "off", "16"):
        return "float", None
    scheme, bits = ("kivi", base[5:]) if base.startswith("kivi-") else ("affine", base)
    options = {"kv_residual": KIVI_RESIDUAL, "kv_group_size": KV_GROUP_SIZE}
    for extra in extras:
        if extra in ("rot", "norot"):
            options["kv_rotate"] = extra == "rot"
            continue
        key = {"r": "kv_residual", "g": "kv_group_size"}.get(extra[:1])
        if key is None or not extra[1:].isdigit():
            raise SystemExit(f"--kv-bits: {text!r}: a suffix is @rN (KIVI residual), @gN (group size), @rot or @norot")
        options[key] = int(extra[1:])
    quant = kv_quant(bits, scheme, **options)
    return label, quant


def kv_cache_factory(model: nn.Module, quant: Optional[KVQuant]) -> Callable[[], list]:
    """window_nll's make_cache for a KV setting: mlx-lm's float caches, or the quantized ones (the attention
    hook installed, so attention reads the packed K/V through the fused kernel, as the engine does)."""
    if quant is None:
        return lambda: make_prompt_cache(model)
    install_attention_hook(model)
    return lambda: make_quant_cache(model, quant)


def mean_kl(ref_logp: Sequence[np.ndarray], logp: Sequence[np.ndarray]) -> np.ndarray:
    """KL(p_ref || p) in nats per scored position, float64 [T], from log-softmaxes [vocab] (window_nll's
    logp_out of the reference run and of the compared one, same window)."""
    out = []
    for r, q in zip(ref_logp, logp):
        r64, q64 = r.astype(np.float64), q.astype(np.float64)
        out.append(float(np.sum(np.exp(r64) * (r64 - q64))))
    return np.array(out, np.float64)


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


def kv_run(model: nn.Module, window: Sequence[int], prefix_len: int, quant: Optional[KVQuant]) -> dict:
    """One window teacher-forced through one KV setting: nll, argmax, log-softmaxes, KV bytes per token of
    the cache it ended with, seconds."""
    made = []
    factory = kv_cache_factory(model, quant)

    def make():
        made.append(factory())
        return made[-1]

    logp: list = []
    t = time.perf_counter()
    nll, top = window_nll(model, window, prefix_len, make, logp_out=logp)
    return {"nll": nll, "top": top, "logp": logp, "bytes_per_token": kv_bytes_per_token(made[-1]),
            "seconds": time.perf_counter() - t}


def kv_rows(model: nn.Module, windows: List[List[int]], prefix_len: int, settings: List[Tuple[str, Optional[KVQuant]]],
            log, runs_of: Optional[dict] = None) -> List[dict]:
    """Float KV first, then every setting, on the same windows; each setting's row scored against the float
    run of the same window (delta ppl, mean KL, greedy agreement). `runs_of`: runs already made, by
    (KVQuant or None, prefix_len, number of windows), reused and added to (the same windows)."""
    runs_of = {} if runs_of is None else runs_of

    def runs(quant, label="float"):
        key = (quant, prefix_len, len(windows))
        if key not in runs_of:
            runs_of[key] = [kv_run(model, w, prefix_len, quant) for w in windows]
            log(f"{label}, window {len(windows[0])}: {sum(r['seconds'] for r in runs_of[key]):.0f} s")
        return runs_of[key]

    ref = runs(None)
    ref_nll = np.concatenate([r["nll"] for r in ref])
    ref_ppl = ppl(ref_nll)
    rows = []
    for label, quant in settings:
        got = runs(quant, label)
        nll = np.concatenate([r["nll"] for r in got])
        kl = np.concatenate([mean_kl(f["logp"], r["logp"]) for f, r in zip(ref, got)])
        agree = np.concatenate([r["top"] == f["top"] for f, r in zip(ref, got)])
        p = ppl(nll)
        rows.append({
            "setting": label, "scheme": quant.scheme if quant else "float",
            "k_bits": quant.k_bits if quant else None, "v_bits": quant.v_bits if quant else None,
            "group_size": quant.group_size if quant else None, "residual": quant.residual if quant else None,
            "ppl": round(p, 4), "delta": round(p - ref_ppl, 4), "delta_pct": round(100 * (p / ref_ppl - 1), 2),
            "kl_mean": round(float(kl.mean()), 6), "kl_max": round(float(kl.max()), 5),
            "agreement": round(float(agree.mean()), 4), "mean_nll": round(float(nll.mean()), 5),
            "window_ppl": [round(ppl(r["nll"]), 4) for r in got],
            "kv_bytes_per_token": round(got[0]["bytes_per_token"], 1),
            "seconds": round(sum(r["seconds"] for r in got), 1),
        })
    return rows


def print_kv_table(rows: List[dict], length: int, prefix_len: int, n_windows: int) -> None:
    print(f"window {length} tokens ({prefix_len} prefilled + {length - prefix_len} scored) x {n_windows}:")
    print(f"  {'KV':<16}{'B/token':>9}{'ppl':>10}{'delta':>10}{'delta %':>9}{'KL nats':>11}{'agree':>8}{'s':>7}")
    for r in rows:
        print(f"  {r['setting']:<16}{r['kv_bytes_per_token']:>9.0f}{r['ppl']:>10.3f}{r['delta']:>+10.3f}"
              f"{r['delta_pct']:>+9.2f}{r['kl_mean']:>11.5f}{r['agreement']:>8.3f}{r['seconds']:>7.0f}")


def plot_kv(tables: List[dict], path: Path) -> Optional[Path]:
    """Mean KL vs float KV against the window length, one line per setting (log-log); the PNG's path or None."""
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = dict.fromkeys(r["setting"] for t in tables for r in t["rows"] if r["setting"] != "float")
    for label in labels:
        pts = [(t["length"], r["kl_mean"]) for t in tables for r in t["rows"] if r["setting"] == label]
        pts = sorted(p for p in pts if p[1] > 0)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("window (tokens of context)")
    ax.set_ylabel("mean KL(float KV || quantized KV), nats")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kv_main(args) -> None:
    """--kv-bits: quantized KV settings against float KV, per window length."""
    settings = [parse_kv_setting(x) for x in args.kv_bits.split(",")]
    if settings[0][1] is not None:
        settings.insert(0, ("float", None))
    lengths = args.lengths
    counts = [int(x) for x in str(args.windows).split(",")]
    counts = counts + [counts[-1]] * (len(lengths) - len(counts))
    tokens = args.tokens or 64
    engine = mlx_infer.load(weights=args.weights or "auto")
    info = machine()
    print(f"model: {engine.source.name} (weights {args.weights or 'auto'}, {engine.source.kernels or 'MLX ops'}); "
          f"{tokens} teacher-forced tokens scored per window, the rest of the window prefilled")
    print(machine_line(info), flush=True)
    start = time.perf_counter()

    def log(msg):
        print(f"    {msg} ({time.perf_counter() - start:.0f} s)", flush=True)

    tables, runs_of = [], {}
    for length, n in zip(lengths, counts):
        windows = wikitext_windows(engine.tokenizer, n, length)
        rows = kv_rows(engine.model, windows, length - tokens, settings, log, runs_of)
        tables.append({"length": length, "prefix": length - tokens, "tokens": tokens, "windows": n, "rows": rows})
        print_kv_table(rows, length, length - tokens, n)
    residual = None
    if args.kivi_residuals:
        length = args.residual_length
        n = counts[lengths.index(length)] if length in lengths else counts[-1]
        windows = wikitext_windows(engine.tokenizer, n, length)
        sweep = [parse_kv_setting(f"kivi-{args.residual_bits}@r{r}@g{g}") for g in args.residual_groups.split(",")
                 for r in args.kivi_residuals.split(",") if int(r) % int(g) == 0]
        rows = kv_rows(engine.model, windows, length - tokens, sweep, log, runs_of)
        residual = {"length": length, "prefix": length - tokens, "tokens": tokens, "windows": n,
                    "bits": args.residual_bits, "rows": rows}
        print(f"KIVI residual window (kivi-{args.residual_bits}; @rN: N recent tokens in float, @gN: group size):")
        print_kv_table(rows, length, length - tokens, n)
    wall = time.perf_counter() - start
    print(f"(KL: mean over scored positions of KL(p_float || p_quant) of the next-token distribution; agree: "
          f"greedy agreement with float KV on the same inputs; B/token: KV bytes per token over all layers; "
          f"{wall:.0f} s)")
    result = {"machine": info, "command": " ".join(sys.argv), "model": engine.source.name,
              "weights": args.weights or "auto", "kernels": engine.source.kernels, "tokens": tokens,
              "wall_s": round(wall, 1), "tables": tables, "kivi_residual": residual}
    path = write_result("ppl-kv", result)
    print("wrote", path)
    png = plot_kv(tables, path.with_suffix(".png"))
    if png is not None:
        print("wrote", png)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", default="2", help="wikitext windows (--kv-bits: per window length, a comma "
                    "list matched to --lengths, the last repeated)")
    ap.add_argument("--prefix", type=int, default=256, help="P: tokens prefilled per window")
    ap.add_argument("--tokens", type=int, default=None,
                    help="T: reference tokens scored per window (default 128; --kv-bits: 64)")
    ap.add_argument("--policies", default="h2o,scissorhands,streaming,snapkv,random")
    ap.add_argument("--ratios", default="0.3,0.5,0.7", help="eviction ratios (fraction of tokens evicted)")
    ap.add_argument("--repack", choices=("on", "off"), default="on", help="off: Naive-Evict (same logits)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weights", default=None, help="default float32 (--kv-bits: auto, the engine's default)")
    kv = ap.add_argument_group("quantized KV (--kv-bits)")
    kv.add_argument("--kv-bits", default=None,
                    help="compare KV settings with float KV instead of eviction policies: a comma list of float, 8, "
                         "4, k8v4, kivi-4, kivi-8, ... (@rN: KIVI residual, @gN: group size)")
    kv.add_argument("--lengths", type=positive_ints, default=[512, 2048, 4096], help="window lengths (tokens, prefix + scored)")
    kv.add_argument("--kivi-residuals", default="", help="KIVI residual windows to sweep, e.g. 32,64,128")
    kv.add_argument("--residual-length", type=int, default=2048, help="window length of the residual sweep")
    kv.add_argument("--residual-bits", default="4", help="bits of the residual sweep's KIVI setting")
    kv.add_argument("--residual-groups", default="32,64",
                    help="group sizes of the residual sweep (a residual must be a multiple of the group size)")
    args = ap.parse_args()
    if args.kv_bits:
        return kv_main(args)
    args.windows = int(args.windows)
    args.tokens = args.tokens or 128
    args.weights = args.weights or "float32"
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
