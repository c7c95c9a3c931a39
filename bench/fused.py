"""Fused projections (kernels/fused.py) against the same model running each projection alone, in one process.

The model is loaded once, as users get it (its attention blocks' q / k / v and its MLPs' gate / up run as
one product each); the "separate" runner takes the fused products out of every block (each projection then
runs its own product, on the very same arrays) and the "fused" runner puts them back, in turn, the order
swapped every round, so that this VM's drift between minutes hits both alike. Per round and runner:
greedy decode tokens/s after the first token (`plain_tokens`, pipelined as `generate`) and the time of a
prefill of --prefill tokens (forwards of 256). Reported: medians, the per-round ratio fused / separate
(median, min, max) and a paired bootstrap 95% interval; whether the greedy tokens were the same.

Usage: python bench/fused.py [--model PATH] [--rounds 12] [--max-tokens 96] [--prefill 443]
Prints a table and writes bench/results/fused-*.json.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import bootstrap_ratio, machine, machine_line, write_result  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_infer.generation.decode import plain_tokens  # noqa: E402
from mlx_infer.generation.sampling import SamplingParams  # noqa: E402
from mlx_infer.kernels.fused import FusedLinear  # noqa: E402

PROMPT = "Explain to a ten-year-old why the sky is blue, and then tell a short story about a dragon."
LONG = "The history of the printing press begins in East Asia, where woodblock printing spread widely. "
#: Tokens per prefill forward.
PREFILL_CHUNK = 256


def fused_slots(model) -> list:
    """(block, attribute, FusedLinear) for every block of `model` that runs a fused product."""
    slots = []
    for _, module in model.named_modules():
        for attr in ("qkv", "gate_up"):
            fused = getattr(module, attr, None)
            if isinstance(fused, FusedLinear):
                slots.append((module, attr, fused))
    return slots


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF / MLX dir / repo id (default: the embedded default model)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prefill", type=int, default=443, help="prompt tokens of the prefill timing (0: none)")
    args = ap.parse_args()

    engine = mlx_infer.load(args.model)
    slots = fused_slots(engine.model)
    if not slots:
        sys.exit(f"error: {engine.source.name} runs no fused products here (kernels: {engine.source.kernels})")
    ids = engine.encode(PROMPT)  # (the chat template where the model has one)
    long_ids = engine.encode(LONG * (args.prefill // 12 + 1), chat_template=False)[:args.prefill]
    params = SamplingParams(temperature=0.0)

    def use(fused: bool) -> None:
        for module, attr, product in slots:
            setattr(module, attr, product if fused else None)

    def run(fused: bool) -> dict:
        use(fused)
        tokens = plain_tokens(engine.model, ids, params, args.max_tokens)
        first = next(tokens)
        start = time.perf_counter()
        rest = list(tokens)
        decode_s = time.perf_counter() - start
        prefill_s = 0.0
        if long_ids:
            cache = make_prompt_cache(engine.model)
            start = time.perf_counter()
            for i in range(0, len(long_ids), PREFILL_CHUNK):
                mx.eval(engine.model(mx.array([long_ids[i:i + PREFILL_CHUNK]]), cache=cache))
            prefill_s = time.perf_counter() - start
        return {"tokens": [first] + rest, "decoded": len(rest), "decode_s": decode_s, "prefill_s": prefill_s}

    run(True), run(False)  # warm-up
    rounds = {True: [], False: []}
    for r in range(args.rounds):
        for fused in ((True, False) if r % 2 == 0 else (False, True)):
            rounds[fused].append(run(fused))
    use(True)

    same = all(a["tokens"] == b["tokens"] for a, b in zip(rounds[True], rounds[False]))
    tps = {k: [x["decoded"] / x["decode_s"] for x in v] for k, v in rounds.items()}
    ratios = sorted(f / s for f, s in zip(tps[True], tps[False]))
    low, high = bootstrap_ratio([((f["decoded"], f["decode_s"]), (s["decoded"], s["decode_s"]))
                                 for f, s in zip(rounds[True], rounds[False])])
    result = {"machine": machine(), "model": engine.source.name, "kernels": engine.source.kernels,
              "fused_blocks": len(slots), "rounds": args.rounds, "max_tokens": args.max_tokens,
              "prefill_tokens": len(long_ids), "same_tokens": same,
              "decode_tps": {"fused": tps[True], "separate": tps[False]},
              "decode_ratio_median": statistics.median(ratios), "decode_ratio_min": ratios[0],
              "decode_ratio_max": ratios[-1], "decode_ratio_bootstrap95": [low, high]}
    print(f"model: {engine.source.name}; kernels: {engine.source.kernels}; {len(slots)} fused products; "
          f"{args.rounds} alternated rounds")
    print(machine_line(result["machine"]))
    print(f"decode tok/s ({args.max_tokens} tokens): separate {statistics.median(tps[False]):.1f}, fused "
          f"{statistics.median(tps[True]):.1f}; fused / separate per round: median {statistics.median(ratios):.3f} "
          f"(min {ratios[0]:.3f}, max {ratios[-1]:.3f}), pooled 95% interval {low:.3f}-{high:.3f}")
    if long_ids:
        pre = {k: [x["prefill_s"] for x in v] for k, v in rounds.items()}
        pr = sorted(f / s for f, s in zip(pre[True], pre[False]))
        result.update({"prefill_s": {"fused": pre[True], "separate": pre[False]},
                       "prefill_time_ratio_median": statistics.median(pr)})
        print(f"prefill of {len(long_ids)} tokens: separate {statistics.median(pre[False]):.3f} s, fused "
              f"{statistics.median(pre[True]):.3f} s; time fused / separate per round: median "
              f"{statistics.median(pr):.3f} (min {pr[0]:.3f}, max {pr[-1]:.3f})")
    print(f"same greedy tokens: {same}")
    print(f"wrote {write_result('fused', result)}")


if __name__ == "__main__":
    main()
