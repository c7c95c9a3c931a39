"""The paged KV cache's core, measured on the default model (issue 13, first part).

    python bench/kv_core.py --write       # a pool write costs O(new tokens), not a copy of the pool
    python bench/kv_core.py --memory      # repacking + shrinking: pool bytes in use and MLX active memory
    python bench/kv_core.py --overhead    # decode step: mlx-lm KVCache vs paged (views) vs paged (gather)
    python bench/kv_core.py --observe     # attention statistics: cost per decode step
    python bench/kv_core.py --retained    # Naive-Evict vs vToken repacking, H2O / Scissorhands at 0.5
    python bench/kv_core.py --batched     # batched decode: gather + masked SDPA vs the paged-attention kernel
    python bench/kv_core.py --generate    # Engine.generate on the dense vs the paged cache: decode tok/s, TTFT

--overhead, --observe and --batched interleave the systems (A B C, A B C, ...) and report medians; the machine
may be shared, so only the ratios of one run mean much. --batched: for each context (`--contexts`, wikitext
tokens per request) and batch (`--batches`), B requests prefilled alone, then `--tokens` decode steps per
system and repeat (`--repeats`), the systems taking turns step by step on the same caches (the context grows
by one token per step for both): BatchStep(fused=False) (one `mx.take` per layer and K/V + mlx-lm's masked
attention), BatchStep(fused=True) (the kernel reads the pool in place), and at B = 1 the lone request's own
PagedKVCache (what the scheduler runs for one request: a view of contiguous slots + mlx-lm's attention).
Decode tokens/s = B / median step time (forward, greedy argmax, eval). --retained feeds a wikitext window through the model teacher-forced,
`--chunk` tokens per forward, evicting after each forward; Naive-Evict is a shadow token table that gets the
same appends and the same evictions (the pairing is exact) and never repacks. --generate: a dense and a paged
Engine over one loaded model (mlx_infer.load()'s default weights), the prompts of bench/prompts/<--prompt-set>
with `--spec` decoding, `--tokens` each, the engines alternating prompt by prompt and the order flipped every
pass (`--repeats` passes), each request from an empty cache (reset): decode tokens/s over all requests
(tokens after the first / decode time), median TTFT, and how many requests gave the same greedy tokens.
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import mlx_infer  # noqa: F401  (first: the optimized BLAS)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROMPTS, interleaved, machine, positive_ints, wikitext_text  # noqa: E402

from mlx_infer.engine import Engine  # noqa: E402
from mlx_infer.kernels.paged_attention import paged_attention_backend  # noqa: E402
from mlx_infer.kv import BlockPool, PagedSequence, TokenTable, make_paged_cache, make_pool  # noqa: E402
from mlx_infer.kv.attention_hook import install as install_attention_hook  # noqa: E402
from mlx_infer.kv.quant_options import kv_quant  # noqa: E402
from mlx_infer.kv.batch import BatchStep  # noqa: E402
from mlx_infer.kv.cache import PagedKVCache  # noqa: E402
from mlx_infer.kv.evict import EvictionController  # noqa: E402
from mlx_infer.kv.observe import AttentionObserver, QueryTap  # noqa: E402
from mlx_infer.kv.policies import make_policy  # noqa: E402
from mlx_infer.kv.repack import Repacker  # noqa: E402



def wikitext_ids(tokenizer, n: int, skip_chars: int = 0):
    """The first n token ids of wikitext-2's test split from character skip_chars on.

    Raises:
        SystemExit: (one line) the file is missing, or the text there gives fewer than n tokens."""
    text = wikitext_text()[skip_chars:skip_chars + 40 * n]
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"bench: wikitext-2 from character {skip_chars} gave {len(ids)} tokens, {n} asked for "
                         f"(fewer or shorter prompts)")
    return ids[:n]


def bench_write(args):
    rows = []
    for blocks in (64, 1024, 8192):
        pool = BlockPool(1, initial_blocks=blocks)
        pool.configure(3, 64, 64, mx.float16)
        pool.allocate(1)
        k = mx.ones((3, 1, 64), mx.float16)
        mx.eval(k)
        pool.write(0, pool.rows(np.array([0])), k, k)
        mx.eval(pool.arrays())
        times = []
        for i in range(200):
            t = time.perf_counter()
            pool.write(0, pool.rows(np.array([i % 16])), k, k)
            mx.eval(pool.layer_kv(0))
            times.append(time.perf_counter() - t)
        rows.append({"pool_blocks": blocks, "pool_mb": round(pool.nbytes / 1e6, 1),
                     "write_us_median": round(statistics.median(times) * 1e6, 1)})
    return rows


def bench_memory(args):
    """A request of `--window` tokens in a pool laid out as the default model's (30 layers, 3 KV heads of 64,
    float32), 3 of every 4 tokens evicted (every block keeps 4 of 16: Naive-Evict frees nothing), then one
    repack and a pool shrink: pool bytes in use and MLX active memory at each stage."""
    layers, n_kv, d = 30, 3, 64
    pool = BlockPool(layers, initial_blocks=1)
    seq = PagedSequence(pool, layers)
    caches = [PagedKVCache(seq, i) for i in range(layers)]
    kv = mx.random.normal((1, n_kv, args.window, d))
    for c in caches:
        c.update_and_fetch(kv, kv)
    rows = []

    def stage(name):
        mx.eval(pool.arrays())
        gc.collect()
        rows.append({"stage": name, "blocks_in_use": pool.blocks_in_use,
                     "pool_mb_in_use": round(pool.bytes_in_use / 1e6, 1), "pool_capacity_blocks": pool.capacity,
                     "active_mb": round(mx.get_active_memory() / 1e6, 1)})

    stage("filled")
    seq.evict(np.setdiff1d(np.arange(args.window), np.arange(0, args.window, 4)))
    stage("evicted 75% (Naive-Evict)")
    t = time.perf_counter()
    Repacker(low_watermark=None).maybe_repack(seq)
    mx.eval(pool.arrays())
    repack_s = time.perf_counter() - t
    stage("repacked")
    pool.shrink()
    stage("shrunk")
    return {"tokens": args.window, "repack_s": round(repack_s, 4), "stages": rows}


def bench_overhead(args, engine):
    """Decode steps of mlx-lm's KVCache, the paged cache (live slots contiguous: views) and the paged cache
    with one hole (one gather per layer and K/V), each prefilled with the same `--context` tokens; then
    `--tokens` rounds of one step each, the systems in turn (per-step interleaving: load drift hits all
    alike), each step a forward + eval. Medians of the step time and of the graph-building (host) time."""
    model = engine.model
    prompt = wikitext_ids(engine.tokenizer, args.context)
    caches = {"dense": make_prompt_cache(model), "paged": make_paged_cache(model, make_pool(model)),
              "gather": make_paged_cache(model, make_pool(model))}
    for c in caches.values():
        mx.eval(model(mx.array(prompt)[None], cache=c))
    caches["gather"][0].sequence.evict([1])
    token = mx.array([[prompt[-1]]])
    step = {k: [] for k in caches}
    build = {k: [] for k in caches}
    for _ in range(args.tokens * args.repeats):
        for k, c in caches.items():
            t0 = time.perf_counter()
            out = model(token, cache=c)
            t1 = time.perf_counter()
            mx.eval(out)
            step[k].append(time.perf_counter() - t0)
            build[k].append(t1 - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in step.items()}
    return {"context": args.context, "steps_each": len(step["dense"]),
            "step_ms_median": {k: round(v, 3) for k, v in med.items()},
            "build_ms_median": {k: round(statistics.median(v) * 1e3, 3) for k, v in build.items()},
            "overhead_paged_pct": round(100 * (med["paged"] / med["dense"] - 1), 2),
            "overhead_gather_pct": round(100 * (med["gather"] / med["dense"] - 1), 2)}


def bench_generate(args, engine):
    """Engine.generate on the dense vs the paged cache (see the module docstring, --generate)."""
    engines = {"dense": engine, "paged": Engine(engine.model, engine.tokenizer, engine.config, engine.source,
                                                kv_cache="paged")}
    lines = (PROMPTS / f"{args.prompt_set}.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    for e in engines.values():
        e.prepare(args.spec)
        e.generate(prompts[0], max_tokens=4, speculative=args.spec)
    decode_s, tokens, ttft, outs = ({k: [] for k in engines} for _ in range(4))
    for rep in range(args.repeats):
        for prompt in prompts:
            for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                engines[name].reset()
                r = engines[name].generate(prompt, max_tokens=args.tokens, speculative=args.spec)
                decode_s[name].append(r.stats.total_s - r.stats.ttft_s)
                tokens[name].append(len(r.token_ids) - 1)
                ttft[name].append(r.stats.ttft_s)
                outs[name].append(r.token_ids)
    tps = {k: sum(tokens[k]) / sum(decode_s[k]) for k in engines}
    return {"prompt_set": args.prompt_set, "spec": args.spec, "requests_each": len(outs["dense"]),
            "decode_tps": {k: round(v, 2) for k, v in tps.items()},
            "paged_over_dense": round(tps["paged"] / tps["dense"], 3),
            "ttft_ms_median": {k: round(statistics.median(v) * 1e3, 1) for k, v in ttft.items()},
            "same_tokens": sum(a == b for a, b in zip(outs["dense"], outs["paged"]))}


def bench_observe(args, engine):
    """Decode steps with the query tap and an observation every `period` steps (no eviction), against the
    same decode without them, interleaved; plus the time inside the observer alone."""
    model = engine.model
    prompt = wikitext_ids(engine.tokenizer, args.context)

    def run(observe):
        cache = make_paged_cache(model, make_pool(model))
        model(mx.array(prompt)[None], cache=cache)
        mx.eval([c.state for c in cache])
        token = mx.array([[prompt[-1]]])
        with QueryTap(model) as tap:
            obs = AttentionObserver(tap.scales, cache)
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                logits = model(token, cache=cache)
                token = mx.argmax(logits[:, -1:], axis=-1)
                mx.eval(token)
                if observe:
                    obs.record(tap.rows())
                    if obs.due():
                        obs.stats()
            dt = time.perf_counter() - t0
        return {"step_ms": 1000 * dt / args.tokens, "observer_ms_per_step": 1000 * obs.seconds / args.tokens}

    run(False)
    res = interleaved({"plain": lambda: run(False), "observed": lambda: run(True)}, args.repeats)
    med = {k: statistics.median(r["step_ms"] for r in v) for k, v in res.items()}
    return {"context": args.context, "tokens": args.tokens, "repeats": args.repeats,
            "step_ms_median": {k: round(v, 3) for k, v in med.items()},
            "observer_ms_per_step_median": round(
                statistics.median(r["observer_ms_per_step"] for r in res["observed"]), 3),
            "overhead_pct": round(100 * (med["observed"] / med["plain"] - 1), 2)}


def decode_step(model, caches, tokens, system):
    """One decode forward of `tokens` (B lists of one id) over the requests' caches: a BatchStep gathering
    ("gather") or fused ("kernel"), or the only request's own PagedKVCache ("lone"). Returns (last-column
    logits [B, V], the BatchStep or None)."""
    if system == "lone":
        return model(mx.array(tokens), cache=caches[0])[:, -1], None
    step = BatchStep([c[0].sequence for c in caches], [1] * len(caches), fused=system == "kernel")
    return model(step.inputs(tokens), cache=step.caches())[:, -1], step


def bench_batched(args, engine):
    """Batched decode steps, gather vs kernel (and the lone PagedKVCache at B = 1); see the module docstring."""
    model = engine.model
    install_attention_hook(model)
    rows = []
    for context, B, bits in ((c, b, k) for c in args.contexts for b in args.batches
                             for k in args.kv_bits.split(",")):  # --kv-bits 8: quantized blocks
        pool = make_pool(model, kv_quant(bits))
        caches = []
        for b in range(B):  # distinct wikitext windows, one per request
            cache = make_paged_cache(model, pool)
            mx.eval(model(mx.array(wikitext_ids(engine.tokenizer, context, skip_chars=9000 * b))[None],
                          cache=cache))
            caches.append(cache)
        tokens = [[0] for _ in caches]
        times = {k: [] for k in ["gather", "kernel"] + (["lone"] if B == 1 else [])}
        for i in range(args.tokens * args.repeats + 2):
            for name, ts in times.items():
                t0 = time.perf_counter()
                logits, step = decode_step(model, caches, tokens, name)
                sampled = mx.argmax(logits, axis=-1)  # [B]
                mx.eval(sampled)
                if step is not None:
                    step.done()
                if i >= 2:  # the first two rounds warm up
                    ts.append(time.perf_counter() - t0)
                tokens = [[t] for t in sampled.tolist()]
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"context": context, "batch": B, "kv_bits": bits, "steps_each": len(times["gather"]),
               "step_ms_median": {k: round(v * 1e3, 2) for k, v in med.items()},
               "decode_tps": {k: round(B / v, 1) for k, v in med.items()},
               "kernel_speedup": round(med["gather"] / med["kernel"], 3)}
        if B == 1:
            row["kernel_vs_lone"] = round(med["lone"] / med["kernel"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
        for c in caches:
            c[0].sequence.release()
    return {"backend": paged_attention_backend(), "kernels": engine.source.kernels, "weights": engine.source.weights,
            "tokens": args.tokens, "repeats": args.repeats, "rows": rows}


def bench_retained(args, engine):
    model = engine.model
    ids = wikitext_ids(engine.tokenizer, args.window, skip_chars=args.skip)
    out = {"window": args.window, "chunk": args.chunk, "ratio": args.ratio, "prefill": args.prefill}
    for name in args.policies.split(","):
        pool = make_pool(model)
        cache = make_paged_cache(model, pool)
        seq = cache[0].sequence
        shadow_pool = BlockPool(1)
        shadow_pool.configure(1, 1, 1, mx.float16)
        naive = TokenTable(shadow_pool)
        naive_blocks = []
        t0 = time.perf_counter()
        with QueryTap(model) as tap:
            obs = AttentionObserver(tap.scales, cache, period=1, window=args.chunk)
            repacker = Repacker(low_watermark=None)
            ctl = EvictionController(seq, make_policy(name), args.ratio, obs, repacker)
            bounds = [0, args.prefill] + list(range(args.prefill + args.chunk, args.window, args.chunk)) + [args.window]
            for a, b in zip(bounds[:-1], bounds[1:]):
                mx.eval(model(mx.array(ids[a:b])[None], cache=cache))
                naive.append(b - a)
                ctl.step(tap.rows())
                naive.evict(np.setdiff1d(naive.live_tokens(), seq.table.live_tokens()))
                naive_blocks.append(len(naive.blocks))
        mx.eval(pool.arrays())
        gc.collect()
        active_before = mx.get_active_memory()
        shrank = pool.shrink()
        gc.collect()
        steps = len(naive_blocks) - 1  # forwards after the prefill
        mean = lambda xs: sum(xs[1:]) / steps  # noqa: E731  (time average over the decode forwards)
        vt, nv = ctl.record.blocks, naive_blocks
        out[name] = {
            "forwards": steps, "live_end": ctl.record.live[-1], "evicted": ctl.record.evicted,
            "naive_blocks_mean": round(mean(nv), 1), "vtoken_blocks_mean": round(mean(vt), 1),
            "naive_blocks_end": nv[-1], "vtoken_blocks_end": vt[-1],
            "fewer_blocks_mean_pct": round(100 * (1 - mean(vt) / mean(nv)), 1),
            "fewer_blocks_end_pct": round(100 * (1 - vt[-1] / nv[-1]), 1),
            "naive_waste_end": round(naive.waste(), 3), "vtoken_waste_end": round(seq.table.waste(), 3),
            "repacks": repacker.repacks, "repack_s": round(repacker.repack_s, 3),
            "observer_s": round(obs.seconds, 2), "wall_s": round(time.perf_counter() - t0, 1),
            "pool_bytes_in_use": pool.bytes_in_use, "pool_peak_blocks": pool.peak_blocks,
            "shrank": shrank, "active_mb_before_shrink": round(active_before / 1e6, 1),
            "active_mb_after_shrink": round(mx.get_active_memory() / 1e6, 1),
        }
        print(json.dumps({name: out[name]}), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("--write", "--memory", "--overhead", "--observe", "--retained", "--batched", "--generate"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens (--overhead, --observe)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per run (--overhead, --observe, --batched)")
    ap.add_argument("--contexts", type=positive_ints, default=[100, 1500], help="wikitext tokens per request (--batched)")
    ap.add_argument("--batches", type=positive_ints, default=[1, 4, 8], help="requests decoding together (--batched)")
    ap.add_argument("--kv-bits", default="float", help="KV blocks, comma-separated: float, 8, 4, k8v4 (--batched)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--window", type=int, default=2048, help="wikitext tokens (--retained)")
    ap.add_argument("--skip", type=int, default=0, help="characters of wikitext skipped (--retained)")
    ap.add_argument("--prefill", type=int, default=64, help="first forward's tokens (--retained)")
    ap.add_argument("--chunk", type=int, default=8, help="teacher-forced tokens per forward (--retained)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--policies", default="h2o,scissorhands")
    ap.add_argument("--prompt-set", default="chat", help="bench/prompts/<name>.jsonl (--generate)")
    ap.add_argument("--spec", default="auto", help="speculative mode of each request (--generate)")
    ap.add_argument("--weights", default=None,
                    help="float32 (default), native, ...; --batched / --generate alone: mlx_infer.load()'s default")
    args = ap.parse_args()
    result = {"machine": machine(), "command": " ".join(sys.argv)}
    if args.write:
        result["write"] = bench_write(args)
    if args.memory:
        result["memory"] = bench_memory(args)
    if args.overhead or args.observe or args.retained or args.batched or args.generate:
        only_batched = (args.batched or args.generate) and not (args.overhead or args.observe or args.retained)
        weights = args.weights or (None if only_batched else "float32")
        engine = mlx_infer.load() if weights is None else mlx_infer.load(weights=weights)
        result["weights"] = engine.source.weights
        if args.batched:
            result["batched"] = bench_batched(args, engine)
        if args.generate:
            result["generate"] = bench_generate(args, engine)
        if args.overhead:
            result["overhead"] = bench_overhead(args, engine)
        if args.observe:
            result["observe"] = bench_observe(args, engine)
        if args.retained:
            result["retained"] = bench_retained(args, engine)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
