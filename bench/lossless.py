"""The full greedy lossless matrix on a real model: every prompt x mode x gamma gives the same token ids
as plain decoding.

Prompts: the four bench sets (bench/prompts, 10 each) plus the first --extra prompts of the shipped
drafter's training prompts (models/smollm2-135m-dflash/prompts.jsonl), so >= 50 by default. Modes:
lookup, draft (a model cut from the target's first --draft-layers layers), layerskip, and dflash / dspark
when a drafter is registered for the target (models/registry.json), and auto (lookup + that drafter).
Gamma: --gammas, pinned (a block drafter's gamma is capped at its block size - 1) and "auto" (the
scheduler chooses each round).

Where an output differs, the first differing position and the target's top-2 logit margin there are
reported (a float32 model should have none).

The KV cache can be quantized or paged (--kv-bits 4 / 8 / k8v4, --kv-scheme affine / kivi, --kv-cache
paged): verify forwards must write and read the same K/V rows as one-token steps there too.

Usage: python bench/lossless.py [--model PATH] [--max-tokens 24] [--modes lookup,draft,layerskip,dflash,auto]
       [--gammas 1,2,4,8,auto] [--start N] [--kv-bits 4] [--kv-scheme kivi] [--kv-cache paged]
Exit status 1 when any output differs. Writes bench/results/lossless-*.json.
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import PROMPT_SETS, load_prompts, machine, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def prompts(extra: int) -> list:
    out = [p for s in PROMPT_SETS for p in load_prompts(s, 10)]
    train = ROOT / "models" / "smollm2-135m-dflash" / "prompts.jsonl"
    if extra and train.is_file():
        out += [json.loads(line)["prompt"] for line in train.read_text().splitlines()[:extra]]
    return out


def top2_margin(engine, ids) -> float:
    """The target's top-1 minus top-2 logit after the context `ids` (float)."""
    import mlx.core as mx

    logits = engine.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:]
    return float((top[1] - top[0]).item())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--extra", type=int, default=12, help="training prompts added to the 40 bench prompts")
    ap.add_argument("--modes", default="lookup,draft,layerskip,dflash,auto")
    ap.add_argument("--gammas", default="1,2,4,8,auto",
                    help="pinned draft lengths, and 'auto' (the scheduler, which also launches plain rounds ahead)")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--start", type=int, default=1, help="first prompt to run (1-based), to finish a stopped run")
    ap.add_argument("--kv-bits", default=None, help="quantized KV: 8, 4 or k8v4 (default: float)")
    ap.add_argument("--kv-scheme", default="affine", help="quantized KV scheme: affine or kivi")
    ap.add_argument("--kv-cache", default="dense", help="dense or paged")
    args = ap.parse_args()

    from mlx_infer.paths import cache_dir
    from mlx_infer.speculative import cut_draft_model

    engine = mlx_infer.load(args.model, kv_cache=args.kv_cache, kv_bits=args.kv_bits, kv_scheme=args.kv_scheme)
    draft_dir = cache_dir() / "bench-draft" / f"{engine.source.mlx_dir.name}-{args.draft_layers}"
    if not (draft_dir / "config.json").is_file():
        cut_draft_model(engine.source.mlx_dir, draft_dir, args.draft_layers)
    modes = args.modes.split(",")
    gammas = [g if g == "auto" else int(g) for g in args.gammas.split(",")]
    todo = prompts(args.extra)
    t0 = time.perf_counter()
    runs, diffs = 0, []
    for i, prompt in enumerate(todo):
        if i + 1 < args.start:
            continue
        ids = engine.encode(prompt)
        plain = engine.generate(ids, max_tokens=args.max_tokens, temperature=0.0).token_ids
        for mode in modes:
            for g in gammas:
                r = engine.generate(ids, max_tokens=args.max_tokens, temperature=0.0, speculative=mode,
                                    draft_model=str(draft_dir) if mode == "draft" else None, max_draft=g)
                runs += 1
                if r.token_ids != plain:
                    k = next((j for j, (a, b) in enumerate(zip(r.token_ids, plain)) if a != b),
                             min(len(plain), len(r.token_ids)))
                    diffs.append({"prompt": i, "mode": mode, "gamma": g, "position": k,
                                  "margin": top2_margin(engine, list(ids) + plain[:k])})
        print(f"[{i + 1}/{len(todo)}] {runs} runs, {len(diffs)} differ, {time.perf_counter() - t0:.0f} s", flush=True)
    info = machine()
    kv = f"KV {args.kv_cache}, {args.kv_bits or 'float'}" + (f" {args.kv_scheme}" if args.kv_bits else "")
    print(f"model: {engine.source.name} ({engine.source.weights} weights), {kv}; prompts {args.start}-{len(todo)} x modes {modes} x "
          f"gamma {gammas}, {args.max_tokens} new tokens: {runs} runs, {len(diffs)} differ from plain decoding")
    for d in diffs:
        print(f"  prompt {d['prompt']} {d['mode']} gamma {d['gamma']}: first difference at token {d['position']}, "
              f"top-2 margin {d['margin']:.4f}")
    path = write_result("lossless", {"machine": info, "args": vars(args), "prompts": len(todo) - args.start + 1, "runs": runs,
                                     "differences": diffs, "seconds": time.perf_counter() - t0})
    print(f"wrote {path}")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
