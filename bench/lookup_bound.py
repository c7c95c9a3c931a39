"""The most prompt lookup can gain on a prompt set with this model on this machine: an oracle bound.

For each prompt the target's greedy answer is decoded once (plain decoding; its TTFT is kept). Then the
answer is replayed with the lookup drafter as `--spec lookup` runs it (proposals from the prompt and the
answer so far, at most --max-draft tokens), but with an oracle cut: each round verifies exactly the
proposed tokens that will be accepted, never one that is rejected, and a round with nothing to verify
costs a pipelined plain step. Round costs come from the target's measured verify cost curve (the one
`--max-draft auto` uses, cached under ~/.cache/mlx-infer/cost/). No real scheduler can do better with
these proposals, so the printed speedups bound what lookup can reach:

    decode-only bound = plain step * (answer tokens - 1) / sum of the oracle rounds' costs
    with-prefill bound = the same with each prompt's TTFT added to both sides

Usage: python bench/lookup_bound.py [--sets copy] [--limit 10] [--max-tokens 48] [--max-draft 8,16]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import load_prompts, machine  # noqa: E402

from mlx_infer.speculative.drafters.lookup import LookupDrafter  # noqa: E402


def oracle_seconds(drafter, prompt_ids, answer, max_draft, curve) -> float:
    """Seconds of decoding `answer` after its first token with oracle-cut lookup rounds (see above)."""
    context, j, seconds = list(prompt_ids) + answer[:1], 1, 0.0
    while j < len(answer):
        proposal = drafter.propose(context, min(max_draft, len(answer) - j - 1)).tokens
        k = 0
        while k < len(proposal) and proposal[k] == answer[j + k]:
            k += 1
        seconds += curve(k + 1) if k else curve.plain()
        context += answer[j : j + k + 1]
        j += k + 1
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sets", default="copy")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-draft", default="8,16", help="comma-separated draft limits to bound")
    args = ap.parse_args()
    limits = [int(x) for x in args.max_draft.split(",")]
    engine = mlx_infer.load(args.model)
    curve = engine.spec.curve(9)  # the curve --max-draft auto uses; wider rounds extrapolate its slope
    m = machine()
    print(f"model: {engine.source.name} ({engine.source.weights} weights); BLAS: {m['blas']}")
    print("cost curve ms: " + ", ".join(f"w{w} {s * 1e3:.1f}" for w, s in sorted(curve.seconds.items()))
          + f"; pipelined plain step {curve.plain() * 1e3:.1f}")
    engine.generate("Hello", max_tokens=2)  # warm-up
    for set_name in args.sets.split(","):
        answers = []
        for prompt in load_prompts(set_name, args.limit):
            ids = engine.encode(prompt)
            result = engine.generate(ids, max_tokens=args.max_tokens)
            answers.append((ids, list(result.token_ids), result.stats.ttft_s))
        plain = sum(curve.plain() * (len(a) - 1) for _, a, _ in answers)
        prefill = sum(t for _, _, t in answers)
        for limit in limits:
            spec = sum(oracle_seconds(LookupDrafter(), ids, a, limit, curve) for ids, a, _ in answers)
            print(f"{set_name}: {len(answers)} prompts, {sum(len(a) for _, a, _ in answers)} tokens, "
                  f"max draft {limit}: decode-only bound {plain / spec:.2f}x, "
                  f"with-prefill bound {(plain + prefill) / (spec + prefill):.2f}x")


if __name__ == "__main__":
    main()
