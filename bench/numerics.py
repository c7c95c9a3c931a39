"""Greedy identity of speculative decoding in float32, float16 and bfloat16 (issue 11).

A verify forward over w rows and w single-row decode steps compute the same logits with different kernels
(matmul with M = w vs M = 1, attention over a block vs one query), so in reduced precision they can differ
in the last bits and a near-tie between the top-2 tokens can flip. This measures, on the default model:

1. Noise, without the loop: for K contexts (each prompt and a prefix of its plain answer), the max
   |logit difference| (float32-cast logits, over the vocabulary) between one verify forward over w rows
   (w = 2..9, the next tokens of the plain answer) and the same positions decoded one row at a time.
2. The loop: greedy plain decoding (Engine.generate, speculative="off") vs speculative="lookup" with
   max_draft 2, 4, 8 and speculative="draft" (a model cut from the target's first --draft-layers layers,
   cast like the target, max_draft 4); per run whether the ids differ, the first differing position and
   plain decoding's top-2 logit margin there (from a reproduction of mlx-lm's generate_step that records
   every step's margin; it is checked against Engine.generate's plain ids).
3. A mitigation prototype (here, not in the library): the same greedy loop as
   mlx_infer/speculative/loop.py, except that when a verify row that decides acceptance (rows 0..n, n the
   accepted count) has a top-2 margin below the dtype's threshold (--noise-factor x the max |difference|
   of step 1), the round commits only the rows before it and the next round is a plain single-row step,
   which decides that token. Reported: whether its ids equal plain decoding's, and its extra rounds.
   With no measured noise (threshold 0) the prototype is the library's loop and is not run again.
4. --margins: plain decoding's top-2 margins only, per dtype, and the share of steps below a range of
   thresholds: the mitigation's cost on a backend (Metal) whose verify-vs-step noise needs that threshold.
5. --simulate EPS: no backend here has verify-vs-step noise in float16 / bfloat16, so the mitigation is
   also tried on float32 with uniform +-EPS noise added to every multi-row verify's logits.

Models: the default model loaded with weights="float32" (the GGUF's Q4_1 weights dequantized), then cast
with model.set_dtype: float16 / bfloat16 weights and activations, what a Metal user gets from a float16 /
bfloat16 model (mlx-lm computes in the weights' dtype; the default model's native quantized layers keep
float16 scales, so its activations are float16 too). MLX's CPU backend runs float16 / bfloat16 slowly
(a float16 step ~0.8 s, prefill ~0.3 s/token here), hence the small prompt counts.

Usage: python bench/numerics.py [--dtypes float32,float16,bfloat16] [--prompts 8,4,6] [--max-tokens 32]
       [--gammas 2,4,8] [--draft-gamma 4] [--noise-factor 2] [--contexts 2] [--seed 0]
       python bench/numerics.py --margins [--dtypes ...] [--prompts ...]   (plain decoding's top-2 margins only)
       python bench/numerics.py --simulate EPS [--prompts N]   (float32, +-EPS noise on verify rows: mitigation)
Prints a table and writes bench/results/numerics-*.json.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # noqa: E402

from common import PROMPT_SETS, load_prompts, machine, write_result  # noqa: E402
from mlx_infer.defaults import PREFILL_STEP_SIZE  # noqa: E402
from mlx_infer.generation.sampling import SamplingParams  # noqa: E402
from mlx_infer.paths import cache_dir  # noqa: E402
from mlx_infer.speculative import DraftModelDrafter, LookupDrafter, cut_draft_model  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
WIDTHS = range(2, 10)
MARGIN_THRESHOLDS = (1e-4, 1e-3, 0.01, 0.03, 0.1, 0.3)


def round_robin(n: int) -> list:
    """The first n prompts taking one from each set in turn (chat, code, math, copy, chat, ...)."""
    sets = [load_prompts(s, 10) for s in PROMPT_SETS]
    return [sets[i % len(sets)][i // len(sets)] for i in range(n)]


def top2(logits: mx.array) -> mx.array:
    """[R, V] float32 logits -> [R] top-1 minus top-2."""
    top = mx.topk(logits, 2, axis=-1)  # [R, 2], unordered
    return mx.abs(top[:, 0] - top[:, 1])


def prefill(model, ids: list) -> list:
    """A fresh cache holding ids[:-1] (chunks of PREFILL_STEP_SIZE, as generate_step and the loop do)."""
    cache = make_prompt_cache(model)
    body = ids[:-1]
    for s in range(0, len(body), PREFILL_STEP_SIZE):
        model(mx.array(body[s : s + PREFILL_STEP_SIZE])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def rewind(cache: list, offset: int) -> None:
    trim_prompt_cache(cache, cache[0].offset - offset)


def plain_greedy(model, cache, ids: list, max_tokens: int):
    """mlx-lm generate_step, greedy, on a cache holding ids[:-1]: one row per step, log-softmax in the
    model's dtype, argmax. Returns (tokens, margins [float32 top-2 margin per step], ties [steps whose argmax
    in the model dtype's log-softmax differs from the float32 argmax]). The cache is rewound afterwards."""
    base = cache[0].offset
    y, out, margins, ties = ids[-1], [], [], []
    for k in range(max_tokens):
        logits = model(mx.array([[y]], dtype=mx.uint32), cache=cache)[:, -1, :]  # [1, V] model dtype
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        tok, f32tok = mx.argmax(logprobs, axis=-1), mx.argmax(logits.astype(mx.float32), axis=-1)
        margin = top2(logits.astype(mx.float32))
        mx.eval(tok, f32tok, margin)
        y = int(tok.item())
        out.append(y)
        margins.append(float(margin.item()))
        if y != int(f32tok.item()):
            ties.append(k)
    rewind(cache, base)
    return out, margins, ties


def spec_greedy(model, cache, ids: list, max_tokens: int, drafter, gamma: int, threshold: float,
                noise_eps: float = 0.0):
    """The greedy loop of mlx_infer/speculative/loop.py with a fixed gamma, plus the mitigation: a verify row
    that decides acceptance (0..n) with a float32 top-2 margin below `threshold` ends the round before it, and
    the next round is a single-row step (threshold 0: the library's loop). Returns (tokens, rounds, stops:
    rounds the mitigation ended early). The cache (holding ids[:-1]) is rewound afterwards. noise_eps > 0
    (--simulate): every multi-row verify's logits get uniform noise in [-eps, eps] (seeded by round), a
    stand-in for a backend whose verify rows differ from single-row steps."""
    base = cache[0].offset
    drafter.begin(ids, SamplingParams(temperature=0.0))
    history, produced, rounds, stops, force_plain = list(ids), 0, 0, 0, False
    while produced < max_tokens:
        g = 0 if force_plain else max(0, min(gamma, max_tokens - produced - 1))
        tokens = list(drafter.propose(history, g).tokens[:g]) if g else []
        g, force_plain = len(tokens), False
        block = mx.array([history[-1]] + tokens, dtype=mx.uint32)  # [g+1]
        logits = model(block[None], cache=cache)[0].astype(mx.float32)  # [g+1, V]
        if noise_eps and g:
            logits = logits + mx.random.uniform(-noise_eps, noise_eps, logits.shape, key=mx.random.key(rounds))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.argmax(logprobs, axis=-1)  # [g+1]
        margins = top2(logits) if g and threshold > 0 else mx.zeros((0,))
        mx.eval(targets, margins)
        targets = targets.tolist()
        n = next((i for i in range(g) if tokens[i] != targets[i]), g)
        rounds += 1
        low = next((i for i, m in enumerate(margins.tolist()[: n + 1]) if m < threshold), None)
        if low is not None:  # rows before `low` are kept; a single-row step decides the token at `low`
            stops += 1
            committed = tokens[:low]
            trim_prompt_cache(cache, g + 1 - low)
            force_plain = True
        else:
            committed = targets[: n + 1]
            trim_prompt_cache(cache, g - n)
        committed = committed[: max_tokens - produced]
        history.extend(committed)
        produced += len(committed)
    rewind(cache, base)
    return history[len(ids):], rounds, stops


def noise(model, cache, ids: list, answer: list, rng: random.Random) -> dict:
    """Verify-forward-vs-single-step logits on one context: ids + answer[:c] (c random, leaving 9 answer
    tokens), widths 2..9. Returns {w: {"max_abs": float, "flips": argmax rows that differ}}."""
    base = cache[0].offset
    seq = list(ids) + list(answer)
    c = rng.randint(0, max(0, min(16, len(answer) - 9)))
    ctx_end = len(ids) - 1 + c  # the cache will hold seq[:ctx_end]; block = seq[ctx_end : ctx_end + 9]
    if c:
        model(mx.array(seq[base:ctx_end])[None], cache=cache)
        mx.eval([x.state for x in cache])
    block = seq[ctx_end : ctx_end + 9]
    steps = []
    for t in block:
        steps.append(model(mx.array([[t]], dtype=mx.uint32), cache=cache)[0].astype(mx.float32))  # [1, V]
        mx.eval(steps[-1])
    steps = mx.concatenate(steps, axis=0)  # [9, V]
    rewind(cache, ctx_end)
    out = {}
    for w in WIDTHS:
        rows = model(mx.array(block[:w], dtype=mx.uint32)[None], cache=cache)[0].astype(mx.float32)  # [w, V]
        diff = mx.max(mx.abs(rows - steps[:w]))
        flips = mx.sum(mx.argmax(rows, axis=-1) != mx.argmax(steps[:w], axis=-1))
        mx.eval(diff, flips)
        out[w] = {"max_abs": float(diff.item()), "flips": int(flips.item())}
        rewind(cache, ctx_end)
    rewind(cache, base)
    return out


def first_diff(a: list, b: list) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_dtype(name: str, n_prompts: int, args, draft_dir: Path, rng: random.Random) -> dict:
    dtype = DTYPES[name]
    engine = mlx_infer.load(weights="float32")
    engine.model.set_dtype(dtype)
    draft = mlx_infer.load(str(draft_dir), weights="float32")
    draft.model.set_dtype(dtype)
    configs = [("lookup", g) for g in args.gammas] + [("draft", args.draft_gamma)]
    prompts = round_robin(n_prompts)
    rec = {"prompts": n_prompts, "noise": [], "runs": [], "plain_checks": [], "ties_fp32": 0, "steps": 0}
    t0 = time.perf_counter()
    # Pass 1: plain decoding and the noise on every prompt's context (the threshold needs all of it).
    plains = []
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt)
        cache = prefill(engine.model, ids)
        tokens, margins, ties = plain_greedy(engine.model, cache, ids, args.max_tokens)
        rec["ties_fp32"] += len(ties)
        rec["steps"] += len(tokens)
        if i == 0:  # the reproduction against the library's plain decoding
            lib = engine.generate(ids, max_tokens=args.max_tokens, temperature=0.0).token_ids
            rec["plain_checks"].append(lib == tokens[: len(lib)])
        for _ in range(args.contexts):
            rec["noise"].append(noise(engine.model, cache, ids, tokens, rng))
        plains.append((ids, cache, tokens, margins))
        print(f"  {name} plain+noise {i + 1}/{n_prompts}: {time.perf_counter() - t0:.0f} s", flush=True)
    max_abs = max(v["max_abs"] for ctx in rec["noise"] for v in ctx.values())
    threshold = args.noise_factor * max_abs
    rec["max_abs"], rec["threshold"] = max_abs, threshold
    # Pass 2: the library's speculative decoding and the mitigation prototype.
    for i, (ids, cache, plain, margins) in enumerate(plains):
        for mode, g in configs:
            r = engine.generate(ids, max_tokens=args.max_tokens, temperature=0.0, speculative=mode,
                                draft_model=draft if mode == "draft" else None, max_draft=g)
            if threshold > 0:
                drafter = DraftModelDrafter(draft.model) if mode == "draft" else LookupDrafter()
                mit, rounds, stops = spec_greedy(engine.model, cache, ids, args.max_tokens, drafter, g, threshold)
            else:  # no measured noise: the mitigation never triggers, the prototype is the library's loop
                mit, rounds, stops = r.token_ids, r.stats.rounds, 0
            row = {"prompt": i, "mode": mode, "gamma": g, "differs": r.token_ids != plain[: len(r.token_ids)],
                   "rounds": r.stats.rounds, "mitigated_differs": mit != plain[: len(mit)], "mitigated_rounds": rounds,
                   "mitigated_stops": stops}
            if row["differs"]:
                k = first_diff(r.token_ids, plain)
                row.update(position=k, plain_margin=margins[k], near_tie=margins[k] < threshold)
            if row["mitigated_differs"]:
                k = first_diff(mit, plain)
                row.update(mitigated_position=k, mitigated_plain_margin=margins[k])
            rec["runs"].append(row)
        print(f"  {name} spec {i + 1}/{n_prompts}: {time.perf_counter() - t0:.0f} s", flush=True)
    rec["seconds"] = time.perf_counter() - t0
    return rec


def margin_spread(args, names: list, counts: list) -> None:
    """--margins: plain decoding's top-2 margins per dtype, and the share of steps below each threshold: what
    the mitigation would cost (a verify row below the threshold costs one extra single-row round) on a
    backend whose verify-vs-step noise needs that threshold."""
    out = {}
    for name, n in zip(names, counts):
        engine = mlx_infer.load(weights="float32")
        engine.model.set_dtype(DTYPES[name])
        margins = []
        for prompt in round_robin(n):
            ids = engine.encode(prompt)
            margins += plain_greedy(engine.model, prefill(engine.model, ids), ids, args.max_tokens)[1]
        share = {t: sum(m < t for m in margins) / len(margins) for t in MARGIN_THRESHOLDS}
        out[name] = {"steps": len(margins), "min": min(margins), "exact_ties": sum(m == 0 for m in margins),
                     "share_below": share, "margins": margins}
        print(f"{name:9}{len(margins):5d} steps, min margin {min(margins):.2e}, exact ties {out[name]['exact_ties']}; "
              + ", ".join(f"<{t:g}: {100 * v:.1f}%" for t, v in share.items()), flush=True)
    print(f"wrote {write_result('numerics-margins', {'machine': machine(), 'args': vars(args), 'results': out})}")


def simulate(args, eps: float, n: int, draft_dir: Path) -> None:
    """--simulate EPS: float32, with uniform noise of +-EPS added to every multi-row verify's logits (what a
    backend whose verify rows differ from steps would do), the library's loop (threshold 0) vs the
    mitigation (threshold 2 EPS): runs that differ from plain decoding, rounds, mitigation stops."""
    engine = mlx_infer.load(weights="float32")
    draft = mlx_infer.load(str(draft_dir), weights="float32")
    out = []
    for i, prompt in enumerate(round_robin(n)):
        ids = engine.encode(prompt)
        cache = prefill(engine.model, ids)
        plain, margins, _ = plain_greedy(engine.model, cache, ids, args.max_tokens)
        for mode, g in [("lookup", args.draft_gamma), ("draft", args.draft_gamma)]:
            for threshold in (0.0, 2 * eps):
                drafter = DraftModelDrafter(draft.model) if mode == "draft" else LookupDrafter()
                toks, rounds, stops = spec_greedy(engine.model, cache, ids, args.max_tokens, drafter, g, threshold, eps)
                k = first_diff(toks, plain) if toks != plain else None
                out.append({"prompt": i, "mode": mode, "gamma": g, "threshold": threshold, "differs": k is not None,
                            "position": k, "plain_margin": margins[k] if k is not None else None,
                            "rounds": rounds, "stops": stops})
        print(f"  simulate {i + 1}/{n}", flush=True)
    print(f"simulated verify noise +-{eps}, float32, {args.max_tokens} new tokens, {n} prompts")
    for mode in ("lookup", "draft"):
        for threshold in (0.0, 2 * eps):
            rows = [r for r in out if r["mode"] == mode and r["threshold"] == threshold]
            bad = [r for r in rows if r["differs"]]
            print(f"  {mode} g{args.draft_gamma} threshold {threshold:g}: {len(bad)}/{len(rows)} differ "
                  f"(first pos, plain margin: {[(r['position'], round(r['plain_margin'], 3)) for r in bad]}), "
                  f"rounds {sum(r['rounds'] for r in rows)}, stops {sum(r['stops'] for r in rows)}")
    print(f"wrote {write_result('numerics-simulated', {'machine': machine(), 'args': vars(args), 'eps': eps, 'runs': out})}")


def table(results: dict, args) -> None:
    print(f"\nnoise: max |logit difference|, verify forward over w rows vs w single-row steps (contexts per dtype)")
    print(f"{'dtype':9}" + "".join(f"{'w=' + str(w):>10}" for w in WIDTHS) + f"{'flips':>7}")
    for name, rec in results.items():
        cells = [max(ctx[w]["max_abs"] for ctx in rec["noise"]) for w in WIDTHS]
        flips = sum(ctx[w]["flips"] for ctx in rec["noise"] for w in WIDTHS)
        print(f"{name:9}" + "".join(f"{c:10.1e}" for c in cells) + f"{flips:7d}  ({len(rec['noise'])} contexts)")
    print(f"\ngreedy speculative vs plain decoding, {args.max_tokens} new tokens; mitigation threshold = "
          f"{args.noise_factor} x max |difference|")
    print(f"{'dtype':9}{'config':12}{'runs':>5}{'differ':>7}{'near-tie':>9}{'1st pos':>10}{'margins':>18}"
          f"{'mitig. differ':>14}{'rounds':>8}{'mitig.':>8}{'stops':>6}")
    for name, rec in results.items():
        keys = sorted({(r["mode"], r["gamma"]) for r in rec["runs"]})
        for mode, g in keys:
            rows = [r for r in rec["runs"] if (r["mode"], r["gamma"]) == (mode, g)]
            bad = [r for r in rows if r["differs"]]
            pos = ",".join(str(r["position"]) for r in bad) or "-"
            mar = ",".join(f"{r['plain_margin']:.3f}" for r in bad) or "-"
            print(f"{name:9}{mode + ' g' + str(g):12}{len(rows):5d}{len(bad):7d}"
                  f"{sum(r['near_tie'] for r in bad):9d}{pos:>10}{mar:>18}"
                  f"{sum(r['mitigated_differs'] for r in rows):14d}{sum(r['rounds'] for r in rows):8d}"
                  f"{sum(r['mitigated_rounds'] for r in rows):8d}{sum(r['mitigated_stops'] for r in rows):6d}")
        print(f"{name:9}threshold {rec['threshold']:.1e}; plain steps whose {name} log-softmax argmax differs "
              f"from the float32 argmax: {rec['ties_fp32']}/{rec['steps']}; plain reproduction == Engine: "
              f"{all(rec['plain_checks'])}; {rec['seconds']:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--prompts", default="8,4,6", help="prompts per dtype (round robin over the 4 sets)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--gammas", default="2,4,8", help="lookup's pinned draft lengths")
    ap.add_argument("--draft-gamma", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--noise-factor", type=float, default=2.0)
    ap.add_argument("--contexts", type=int, default=2, help="noise contexts per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", type=float, default=0.0,
                    help="EPS: float32 with +-EPS noise on verify rows, library loop vs mitigation (prompts: first count)")
    ap.add_argument("--margins", action="store_true",
                    help="only plain decoding's top-2 margin spread per dtype (the mitigation's cost vs threshold)")
    args = ap.parse_args()
    args.gammas = [int(g) for g in args.gammas.split(",")]
    names = args.dtypes.split(",")
    counts = [int(n) for n in args.prompts.split(",")]
    counts += [counts[-1]] * (len(names) - len(counts))

    if args.margins:
        return margin_spread(args, names, counts)
    source = mlx_infer.load(weights="float32").source
    draft_dir = cache_dir() / "bench-draft" / f"{source.mlx_dir.name}-{args.draft_layers}"
    if not (draft_dir / "config.json").is_file():
        cut_draft_model(source.mlx_dir, draft_dir, args.draft_layers)
    if args.simulate:
        return simulate(args, args.simulate, counts[0], draft_dir)
    rng = random.Random(args.seed)
    results = {}
    for name, n in zip(names, counts):
        results[name] = run_dtype(name, n, args, draft_dir, rng)
        table(results, args)
    path = write_result("numerics", {"machine": machine(), "args": vars(args), "model": source.name,
                                     "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
