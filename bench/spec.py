"""Speculative decoding against plain decoding and the peers, per prompt set, in one run, interleaved.

For each prompt set in bench/prompts/ (chat, code, math, copy-heavy editing) and each temperature
(greedy and 0.7), every system runs every prompt in turn (A B C ..., prompt after prompt):

  plain (mlx-infer)      Engine.generate, speculative="off"
  plain (mlx-lm)         mlx_lm.stream_generate
  lookup / draft / layerskip / dflash / dspark / auto
                         Engine.generate with that drafter, max_draft auto (or --max-draft N); dflash and
                         dspark use the drafter registered for the target (models/registry.json)
  mlx-lm speculative     mlx_lm.stream_generate(draft_model=...) with the same draft model
  mlx-dspark lookup      mlx_dspark's lookup_generate, when the package imports

Each prompt runs --repeats times per system (interleaved, each repeat starting one system later:
A B C .., B C .. A, ..) and the fastest run
counts, except the two slow peer rows, which run once. Reported per set and temperature: tokens/s
(greedy: generated tokens / wall time of the request, prefill included, and beside it the speedup of
decode tokens/s after the first token, prefill excluded; sampling: decode tokens/s after
the first token, because sampled answers differ in length and a short one carries more prefill), speedup over our plain decoding, tau (committed tokens per target forward), the per-position
acceptance of the drafts (in the JSON) and, greedy only, whether every output is token-identical to plain
decoding.

The draft model is cut from the target (its first --draft-layers layers + final norm + head); no
smaller sibling of the default model exists here.

Usage: python bench/spec.py [--model PATH] [--limit 4] [--max-tokens 48] [--sets chat,code,math,copy] [--repeats 2]
       [--modes lookup,draft,layerskip,dflash,auto] [--per-prompt]
Prints a table per temperature and writes bench/results/spec-*.json.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import machine, write_result  # noqa: E402

PROMPTS = Path(__file__).parent / "prompts"
SETS = ("chat", "code", "math", "copy")
#: The slow peer rows run each prompt once, whatever --repeats (they are 2-4x slower than the rest).
PEERS_ONCE = ("draft (mlx-lm speculative)", "lookup (mlx-dspark)")


def load_prompts(name: str, limit: int) -> list:
    lines = (PROMPTS / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:limit]


def mean_by_position(lists: list) -> list:
    """Mean of each position over the lists that reach it (per-position acceptance over prompts)."""
    width = max((len(x) for x in lists), default=0)
    cols = [[x[i] for x in lists if len(x) > i] for i in range(width)]
    return [round(sum(c) / len(c), 3) for c in cols]


def ours(engine, mode, draft_dir, max_draft):
    def run(prompt_ids, temp, max_tokens, seed):
        r = engine.generate(prompt_ids, max_tokens=max_tokens, temperature=temp, seed=seed, speculative=mode,
                            draft_model=str(draft_dir) if mode in ("draft",) else None, max_draft=max_draft)
        return {"tokens": r.token_ids, "seconds": r.stats.total_s, "first_s": r.stats.ttft_s,
                "tau": r.stats.tau if mode != "off" else 1.0,
                "spec_mode": r.stats.spec_mode, "acceptance": r.stats.acceptance or []}

    return run


def mlx_lm_plain(engine):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    def run(prompt_ids, temp, max_tokens, seed):
        import mlx.core as mx

        mx.random.seed(seed)
        start = time.perf_counter()
        toks, first = [], None
        for r in stream_generate(engine.model, engine.tokenizer, prompt_ids, max_tokens=max_tokens,
                                 sampler=make_sampler(temp=temp)):
            first = first or time.perf_counter()
            if r.finish_reason != "stop":
                toks.append(r.token)
        return {"tokens": toks, "seconds": time.perf_counter() - start, "first_s": (first or start) - start, "tau": 1.0}

    return run


def mlx_lm_spec(engine, draft_engine, num_draft):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    def run(prompt_ids, temp, max_tokens, seed):
        import mlx.core as mx

        mx.random.seed(seed)
        start = time.perf_counter()
        toks, from_draft, first = [], 0, None
        for r in stream_generate(engine.model, engine.tokenizer, prompt_ids, max_tokens=max_tokens,
                                 draft_model=draft_engine.model, num_draft_tokens=num_draft,
                                 sampler=make_sampler(temp=temp)):
            first = first or time.perf_counter()
            if r.finish_reason == "stop":
                break
            toks.append(r.token)
            from_draft += bool(r.from_draft)
        target_steps = max(1, len(toks) - from_draft)
        return {"tokens": toks, "seconds": time.perf_counter() - start, "first_s": (first or start) - start,
                "tau": len(toks) / target_steps}

    return run


def dspark_lookup(engine):
    """mlx-dspark's lookup_generate on the same MLX directory, as a peer row (None when it does not import)."""
    try:
        from mlx_dspark.load import load_target
        from mlx_dspark.lookup import lookup_generate
    except ImportError:
        return None
    target, tokenizer = load_target(str(engine.source.mlx_dir))

    def run(prompt_ids, temp, max_tokens, seed):
        start = time.perf_counter()
        r = lookup_generate(target, tokenizer, prompt_ids=list(prompt_ids), max_new_tokens=max_tokens,
                            temperature=temp, seed=seed)
        toks = [t for t in r.token_ids if t not in engine.tokenizer.eos_token_ids]
        return {"tokens": toks, "seconds": time.perf_counter() - start, "tau": r.mean_accept_len}

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--limit", type=int, default=4, help="prompts per set (the files hold 10)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--max-draft", default="auto", help="'auto' or an int")
    ap.add_argument("--modes", default="lookup,draft,layerskip,dflash,auto")
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each prompt per system, interleaved; the fastest counts (peers: one run)")
    ap.add_argument("--per-prompt", action="store_true",
                    help="also print each prompt's speedups (with prefill / d: decode only) and tau")
    args = ap.parse_args()
    max_draft = args.max_draft if args.max_draft == "auto" else int(args.max_draft)

    from mlx_infer.paths import cache_dir
    from mlx_infer.speculative import cut_draft_model

    engine = mlx_infer.load(args.model)
    draft_dir = cache_dir() / "bench-draft" / f"{engine.source.mlx_dir.name}-{args.draft_layers}"
    if not (draft_dir / "config.json").is_file():
        cut_draft_model(engine.source.mlx_dir, draft_dir, args.draft_layers)
    draft_engine = mlx_infer.load(str(draft_dir), weights=engine.source.weights)

    systems = {"plain (mlx-infer)": ours(engine, "off", draft_dir, max_draft),
               "plain (mlx-lm)": mlx_lm_plain(engine)}
    for mode in args.modes.split(","):
        systems[f"{mode} (mlx-infer)"] = ours(engine, mode, draft_dir, max_draft)
    systems["draft (mlx-lm speculative)"] = mlx_lm_spec(engine, draft_engine, 4)
    if (peer := dspark_lookup(engine)) is not None:
        systems["lookup (mlx-dspark)"] = peer

    # warm-up: compile, page in, measure cost curves and calibrations once
    warm = engine.encode("Hello")
    for run in systems.values():
        run(warm, 0.0, 4, 0)

    results = {}
    for temp in [float(t) for t in args.temps.split(",")]:
        for set_name in args.sets.split(","):
            rows = {name: {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_s": 0.0, "taus": [],
                           "identical": True, "modes": set(), "acc": []}
                    for name in systems}
            for i, prompt in enumerate(load_prompts(set_name, args.limit)):
                prompt_ids = engine.encode(prompt)
                reference = None
                best = {}  # system -> its fastest run of this prompt
                names = list(systems)
                for rep in range(args.repeats):
                    # each repeat starts one system later, so that no system always runs after the same one
                    for name in names[rep % len(names):] + names[: rep % len(names)]:
                        if rep and name in PEERS_ONCE:
                            continue
                        out = systems[name](prompt_ids, temp, args.max_tokens, 1000 + i)
                        if reference is None:
                            reference = out["tokens"]
                        elif temp == 0 and out["tokens"] != reference:
                            rows[name]["identical"] = False
                        if name not in best or out["seconds"] < best[name]["seconds"]:
                            best[name] = out
                if args.per_prompt:
                    base = best["plain (mlx-infer)"]
                    print(f"{set_name} #{i} ({len(base['tokens'])} tokens, temp {temp}): " + ", ".join(
                        f"{name.replace(' (mlx-infer)', '')} {base['seconds'] / out['seconds']:.2f}x"
                        + (f"/d{(base['seconds'] - base['first_s']) / (out['seconds'] - out['first_s']):.2f}x"
                           if out.get("first_s") is not None else "") + f" t{out['tau']:.2f}"
                        for name, out in best.items() if name != "plain (mlx-infer)"), flush=True)
                for name, out in best.items():
                    row = rows[name]
                    row["tokens"] += len(out["tokens"])
                    row["seconds"] += out["seconds"]
                    if out.get("first_s") is not None and len(out["tokens"]) > 1:
                        row["decode_tokens"] += len(out["tokens"]) - 1
                        row["decode_s"] += out["seconds"] - out["first_s"]
                    row["taus"].append(out["tau"])
                    row["modes"].add(out.get("spec_mode") or "")
                    row["acc"].append(out.get("acceptance") or [])
            def rate(row, metric):
                """"wall": tokens / wall time (prefill included; greedy systems all make the same tokens).
                "decode": decode tokens/s after the first token, for sampling, where answers differ in
                length and a shorter one would carry more of the prefill."""
                if metric == "wall":
                    return row["tokens"] / row["seconds"] if row["seconds"] else 0.0
                return row["decode_tokens"] / row["decode_s"]

            plain = rows["plain (mlx-infer)"]
            for name, row in rows.items():
                metric = "wall" if (temp == 0 or not row["decode_s"]) else "decode"  # no first-token time: wall
                tps = rate(row, metric)
                decode_speedup = (rate(row, "decode") / rate(plain, "decode")
                                  if row["decode_s"] and plain["decode_s"] else None)
                results.setdefault(str(temp), {}).setdefault(set_name, {})[name] = {
                    "tokens_per_s": tps, "speedup": tps / rate(plain, metric), "decode_speedup": decode_speedup,
                    "tau": sum(row["taus"]) / len(row["taus"]), "metric": metric,
                    "tokens": row["tokens"],
                    "identical_to_plain": row["identical"] if temp == 0 else None,
                    "spec_modes_used": sorted(m for m in row["modes"] if m),
                    "acceptance": mean_by_position(row["acc"]),
                }

    info = machine()
    print(f"model: {engine.source.name} ({engine.source.weights} weights); draft model: first {args.draft_layers} layers; "
          f"{args.limit} prompts per set, {args.max_tokens} new tokens; max_draft {args.max_draft}; "
          f"fastest of {args.repeats} runs per prompt (peers: 1)")
    print(f"machine: {info['platform']}, {info['cpus']} CPUs, MLX {info['mlx']} ({info['backend']}), BLAS: {info['blas']}")
    for temp, sets in results.items():
        print(f"\ntemperature {temp}")
        names = list(systems)
        greedy = float(temp) == 0
        width = 29 if greedy else 22  # greedy cells add the decode speedup
        print(f"{'system':<28}" + "".join(f"{s:>{width}}" for s in sets))
        for name in names:
            cells = []
            for s in sets:
                r = sets[s][name]
                same = "" if r["identical_to_plain"] is None else (" =" if r["identical_to_plain"] else " !")
                wall = "*" if (r["metric"] == "wall" and float(temp) > 0) else ""
                decode = (f" d{r['decode_speedup']:4.2f}x" if r["decode_speedup"] else " " * 7) if greedy else ""
                cells.append(f"{r['tokens_per_s']:6.1f}{wall} {r['speedup']:4.2f}x{decode} t{r['tau']:4.2f}{same}")
            print(f"{name:<28}" + "".join(f"{c:>{width}}" for c in cells))
    print("\ncells: tokens/s, speedup over plain (mlx-infer), tau; '=' greedy output identical to plain, '!' not.\n"
          "greedy: tokens / wall time, prefill included, then 'd': the speedup of decode tokens/s after the first\n"
          "token (prefill excluded); sampling: decode tokens/s after the first token\n"
          "(sampled answers differ in length), '*' where no first-token time exists (wall time, against plain's)")
    path = write_result("spec", {"machine": info, "args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
