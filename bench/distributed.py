"""One model over 2 ranks on this machine against one process, and a scaling model for 2 / 4 Macs (issue 50).

    python bench/distributed.py                        # default model: one process, tensor and pipeline at 2 ranks
    python bench/distributed.py --model m.gguf --layers mlx --tokens 32
    python bench/distributed.py --model-only           # the Mac scaling model alone (no runs)
    python bench/distributed.py --spec lookup          # speculative (prompt lookup) against plain lockstep, 2 ranks

Each configuration runs `mlx.launch -n 2 --backend ring` on 127.0.0.1 (one process: the same worker without
a launcher) and greedy-decodes the same prompt. The worker measures, on rank 0:
- the decode step (forward + pick + the token's broadcast), tokens/s;
- the collectives of one decode forward and of one prefill chunk, counted as they are called (op, bytes:
  mx.distributed's functions wrapped in the worker), and their cost: the same ops on the same shapes run
  alone, each evaluated by itself (its latency on this link), times their count per step; its share of the
  step is the share of a step spent in (or waiting at) collectives.
On this machine both ranks share its 2 cores, so no speedup is expected: what transfers to Macs is the
bytes and the count of collectives per token, which the scaling model (`scaling`) combines with each link's
bandwidth and latency (docs/distributed.md states its inputs).

`--spec lookup` measures instead, in each configuration (default tensor and pipeline), plain lockstep decoding
(generate.lockstep_tokens) against speculative decoding with prompt lookup (speculative.spec_lockstep_tokens)
on SPEC_PROMPTS (chat template applied, greedy, ending at EOS or --tokens), alternating the two --spec-repeats
times after a warm-up of each in the same ranks: decode tokens/s (rank 0, first token to last, median), tau
(committed tokens per decode forward), draft tokens verified and kept, rank 0's drafting time per round, the
round's broadcast per forward (plain / lookup: one int32 all_sum each, including the wait for the other ranks),
and whether the tokens are the same.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


#: --spec's prompts: one whose answer copies the prompt (prompt lookup's case), one that does not.
SPEC_PROMPTS = {
    "copy": "Repeat the following paragraph word for word: The lighthouse stood at the end of the rocky point, "
            "its white tower striped with red. Every night the keeper climbed the one hundred and twelve steps, "
            "lit the lamp, and wrote the weather in a small blue notebook.",
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def spec_worker(args, group, shard) -> dict:
    """--spec lookup on every rank: for each of SPEC_PROMPTS, plain lockstep and speculative decoding alternated
    (a warm-up of each, then --spec-repeats of each); rank 0's measurements."""
    import statistics

    from mlx_infer.distributed import LockstepStats, lockstep_tokens
    from mlx_infer.distributed.speculative import SpecLockstepStats, spec_lockstep_tokens
    from mlx_infer.generation.prompt import PromptCodec
    from mlx_infer.generation.sampling import SamplingParams
    from mlx_infer.speculative.target import output_vocab

    params = SamplingParams(max_tokens=args.tokens)
    eos = shard.tokenizer.eos_token_ids
    out = {}
    for name, text in SPEC_PROMPTS.items():
        ids = PromptCodec(shard.tokenizer, output_vocab(shard.model)).encode(text, None, True) if group.is_root \
            else None
        runs = {"plain": [], "lookup": []}
        for rep in range(args.spec_repeats + 1):
            for mode in runs:
                stats = SpecLockstepStats() if mode == "lookup" else LockstepStats()
                gen = (spec_lockstep_tokens(shard, ids, params, eos, stats, max_draft=args.max_draft) if mode == "lookup"
                       else lockstep_tokens(shard, ids, params, eos, stats))
                tokens, times = [], []
                for token in gen:
                    tokens.append(token)
                    times.append(time.perf_counter())
                if rep:
                    runs[mode].append((tokens, (len(tokens) - 1) / (times[-1] - times[0]), stats))
        plain_tps = statistics.median(r[1] for r in runs["plain"])
        spec_tps = statistics.median(r[1] for r in runs["lookup"])
        spec, plain = runs["lookup"][-1][2], runs["plain"][-1][2]
        out[name] = {"tokens": len(runs["plain"][0][0]), "plain_tps": plain_tps, "lookup_tps": spec_tps,
                     "ratio": spec_tps / plain_tps, "tau": spec.tau, "rounds": spec.rounds, "drafted": spec.drafted,
                     "accepted": spec.accepted, "acceptance": spec.acceptance,
                     "draft_us_per_round": 1e6 * spec.draft_s / max(spec.rounds, 1),
                     "lookup_broadcast_ms_per_forward": 1e3 * spec.broadcast_s / max(spec.rounds + 1, 1),
                     "plain_broadcast_ms_per_forward": 1e3 * plain.broadcast_s / max(len(plain.step_s) + 1, 1),
                     "plain_tps_runs": [r[1] for r in runs["plain"]], "lookup_tps_runs": [r[1] for r in runs["lookup"]],
                     "same_tokens": all(r[0] == runs["plain"][0][0] for r in runs["plain"] + runs["lookup"])}
    return {"parallel": shard.parallel, "ranks": group.size, "detail": shard.detail, "spec": out}


def worker(args) -> None:
    """Runs on every rank (or alone): writes rank 0's measurements to args.worker (JSON)."""
    import mlx_infer  # noqa: F401  (first: the optimized BLAS)
    import mlx.core as mx
    from mlx_infer.distributed import LockstepStats, init_group, load_sharded, lockstep_tokens
    from mlx_infer.distributed.watchdog import on_terminate
    from mlx_infer.generation.sampling import SamplingParams
    from mlx_lm.models.cache import make_prompt_cache

    group = init_group("any")
    on_terminate(group.rank)
    shard = load_sharded(None if args.model == "default" else args.model, group, args.parallel, layers=args.layers)
    if args.spec != "off":
        result = spec_worker(args, group, shard)
        if group.is_root:
            Path(args.worker).write_text(json.dumps(result))
        return
    ids = shard.tokenizer.encode(args.prompt)
    calls = []
    real = {name: getattr(mx.distributed, name) for name in ("all_sum", "all_gather", "send", "recv_like")}

    def counting(name):
        def op(x, *a, **k):  # (send and recv_like: one "hop", so that both ends count the same op)
            calls.append(("hop" if name in ("send", "recv_like") else name, x.nbytes, tuple(x.shape), str(x.dtype)))
            return real[name](x, *a, **k)
        return op

    def collectives_of(tokens, cache):
        calls.clear()
        for name in real:
            setattr(mx.distributed, name, counting(name))
        try:
            mx.eval(shard.model(mx.array([tokens], dtype=mx.uint32), cache=cache))
        finally:
            for name, fn in real.items():
                setattr(mx.distributed, name, fn)
        return list(calls)

    mx.eval(shard.model(mx.array([ids[:1]], dtype=mx.uint32), cache=make_prompt_cache(shard.model)))  # (first forward: pipeline's dtype agreement)
    cache = make_prompt_cache(shard.model)
    prefill_calls = collectives_of(ids[:args.chunk] if len(ids) >= 2 else ids, cache) if group.size > 1 else []
    decode_calls = collectives_of([ids[-1]], cache) if group.size > 1 else []
    cost = op_latency(group, decode_calls, args.repeats) if group.size > 1 else {}
    for _ in range(2):  # warm-up and the measured run
        stats = LockstepStats()
        tokens = list(lockstep_tokens(shard, ids if group.is_root else None, SamplingParams(max_tokens=args.tokens),
                                      stats=stats))
    compute_s = compute_only(shard, ids, args.repeats) if group.size > 1 else 0.0
    steps = sorted(stats.step_s)
    step = steps[len(steps) // 2]
    collective_s = sum(cost.get((n, b, s, d), 0.0) for n, b, s, d in decode_calls)
    if group.is_root:
        Path(args.worker).write_text(json.dumps({
            "parallel": shard.parallel, "ranks": group.size, "detail": shard.detail, "tokens": tokens,
            "step_ms": 1e3 * step, "tokens_per_s": 1 / step, "broadcast_ms": 1e3 * stats.broadcast_s / len(steps),
            "decode_collectives": len(decode_calls), "decode_bytes": sum(c[1] for c in decode_calls),
            "prefill_chunk_tokens": min(args.chunk, len(ids)), "prefill_collectives": len(prefill_calls),
            "prefill_bytes": sum(c[1] for c in prefill_calls),
            "collective_ms_per_step": 1e3 * collective_s,
            "collective_share": collective_s / step if step else 0.0,
            "compute_only_ms": 1e3 * compute_s, "waiting_share": 1 - compute_s / step if compute_s else 0.0,
            "op_latency_us": {f"{n} {list(s)} {d}": 1e6 * t for (n, b, s, d), t in cost.items()},
        }))


def compute_only(shard, ids, repeats: int) -> float:
    """Seconds of this rank's decode forward with every collective replaced by its input (all ranks at once,
    as in a step, each on its own): the step's own work; the rest of a step is waiting at collectives."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    real = {name: getattr(mx.distributed, name) for name in ("all_sum", "all_gather", "send", "recv_like")}
    for name in real:
        setattr(mx.distributed, name, lambda x, *a, **k: x)
    try:
        cache = make_prompt_cache(shard.model)
        mx.eval(shard.model(mx.array([ids], dtype=mx.uint32), cache=cache))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(shard.model(mx.array([[ids[-1]]], dtype=mx.uint32), cache=cache))
            times.append(time.perf_counter() - t)
    finally:
        for name, fn in real.items():
            setattr(mx.distributed, name, fn)
    times.sort()
    return times[len(times) // 2]


def op_latency(group, calls, repeats: int) -> dict:
    """Seconds of each distinct collective of `calls` run alone on its shape (the median of `repeats`
    evaluations, each op evaluated by itself, as a decode step's ops are: each waits for the layer before)."""
    import mlx.core as mx

    out = {}
    for name, nbytes, shape, dtype in sorted(set(calls)):
        x = mx.zeros(shape, dtype=getattr(mx, dtype.split(".")[-1]))
        times = []
        for _ in range(repeats):
            if name == "all_sum":
                y = mx.distributed.all_sum(x, group=group.group)
            elif name == "all_gather":
                y = mx.distributed.all_gather(x, group=group.group)
            else:  # a hop: ranks 0 and 1 send it there and back (recv_like takes x as a template only)
                peer = 1 - group.rank
                first = (lambda: mx.distributed.send(x, peer, group=group.group)) if group.rank == 0 else \
                    (lambda: mx.distributed.recv_like(x, peer, group=group.group))
                second = (lambda: mx.distributed.recv_like(x, peer, group=group.group)) if group.rank == 0 else \
                    (lambda: mx.distributed.send(x, peer, group=group.group))
                t = time.perf_counter()
                mx.eval(first())
                mx.eval(second())
                times.append(time.perf_counter() - t)
                continue
            t = time.perf_counter()
            mx.eval(y)
            times.append(time.perf_counter() - t)
        times.sort()
        per = times[len(times) // 2] / (2 if name == "hop" else 1)  # a one-way hop
        out[(name, nbytes, shape, dtype)] = per
    return out


def run(config: str, args) -> dict:
    """One configuration: "one", "tensor" or "pipeline" (2 ranks)."""
    out = Path(tempfile.mkdtemp(prefix="mlxi-dist-")) / "result.json"
    worker_args = [str(HERE), "--worker", str(out), "--model", args.model, "--tokens", str(args.tokens),
                   "--prompt", args.prompt, "--chunk", str(args.chunk), "--repeats", str(args.repeats),
                   "--layers", args.layers, "--parallel", "auto" if config == "one" else config,
                   "--spec", args.spec, "--max-draft", str(args.max_draft), "--spec-repeats", str(args.spec_repeats)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if config == "one":
        cmd = [sys.executable, *worker_args]
    else:
        launcher = Path(sys.executable).parent / "mlx.launch"
        cmd = [str(launcher), "-n", str(args.ranks), "--backend", "ring", "--python", sys.executable, "--", *worker_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if not out.exists():
        sys.exit(f"error: the {config} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


# The scaling model's inputs. "published": from the vendor's or project's own page, as cited in
# docs/distributed.md; "assumed": this bench's assumption, stated there.
MODELS = {  # Llama-3 shapes (published configs); 4-bit weights with group-64 scales / biases: 4.5 bits a weight
    "8B": {"params": 8.0e9, "layers": 32, "hidden": 4096},
    "70B": {"params": 70.6e9, "layers": 80, "hidden": 8192},
}
BITS_PER_WEIGHT = 4.5
MAC_BANDWIDTH = 819e9  # bytes/s, M3 Ultra memory bandwidth (published, Apple)
BANDWIDTH_EFFICIENCY = 0.7  # share of it a decode step's weight reads reach (assumed)
LINKS = {  # (bytes/s, one-way latency s of a small collective hop)
    "Thunderbolt 5 RDMA (JACCL)": (80e9 / 8, 10e-6),  # 80 Gb/s (published); latency assumed from RDMA figures
    "10 GbE TCP (ring)": (10e9 / 8, 60e-6),  # 10 Gb/s (published); latency of a TCP hop assumed
}
ACT_BYTES = 2  # float16 activations on a Mac (the hidden state each collective moves)


def scaling(n_macs: int, model: str, link: str) -> dict:
    """Decode tokens/s of one stream on n_macs Macs, tensor and pipeline parallel (see docs/distributed.md).

    One Mac: t1 = weight bytes / (bandwidth * efficiency). Tensor parallel: each Mac reads 1/n of the weights,
    then 2 all-reduces per layer of the hidden state; a ring all-reduce takes 2 (n - 1) hops, each a latency
    plus payload / n over the link: t = t1 / n + 2 L * 2 (n - 1) * (lat + D * b / n / bw), + one hop for the
    token. Pipeline parallel: the layers run one Mac after the other (t1 in all) plus n - 1 hops of the
    hidden state and the gather: t = t1 + n * (lat + D * b / bw)."""
    m = MODELS[model]
    bw, lat = LINKS[link]
    weights = m["params"] * BITS_PER_WEIGHT / 8
    t1 = weights / (MAC_BANDWIDTH * BANDWIDTH_EFFICIENCY)
    payload = m["hidden"] * ACT_BYTES
    allreduce = 2 * (n_macs - 1) * (lat + payload / n_macs / bw)
    tp_comm = 2 * m["layers"] * allreduce + lat
    tp = t1 / n_macs + tp_comm
    pp = t1 + n_macs * (lat + payload / bw)
    budget = t1 / 1.7 - t1 / n_macs  # what collectives may take for 1.7x
    need_lat = budget / (2 * m["layers"] * 2 * (n_macs - 1)) - payload / n_macs / bw
    return {"one_mac_tps": 1 / t1, "tensor_tps": 1 / tp, "tensor_speedup": t1 / tp, "tensor_comm_ms": 1e3 * tp_comm,
            "pipeline_tps": 1 / pp, "latency_for_1_7x_us": 1e6 * need_lat,
            "tensor_bytes_per_token": 2 * m["layers"] * payload}


def print_model() -> None:
    print("\nScaling model (decode, one stream; inputs: docs/distributed.md)")
    print(f"{'model':5} {'link':28} {'Macs':>4} {'1 Mac tok/s':>11} {'TP tok/s':>9} {'TP x':>5} {'TP comm ms':>10} "
          f"{'PP tok/s':>8} {'lat for 1.7x us':>15}")
    for model in MODELS:
        for link in LINKS:
            for n in (2, 4):
                r = scaling(n, model, link)
                print(f"{model:5} {link:28} {n:>4} {r['one_mac_tps']:>11.1f} {r['tensor_tps']:>9.1f} "
                      f"{r['tensor_speedup']:>5.2f} {r['tensor_comm_ms']:>10.2f} {r['pipeline_tps']:>8.1f} "
                      f"{r['latency_for_1_7x_us']:>15.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a message in a bottle.")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk whose collectives are counted")
    p.add_argument("--repeats", type=int, default=50, help="evaluations of each collective timed alone")
    p.add_argument("--layers", default="kernels", choices=("kernels", "mlx"), help="tensor parallel's layers")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--configs", default=None, help="default: one,tensor,pipeline (--spec lookup: tensor,pipeline)")
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--spec", default="off", choices=("off", "lookup"),
                   help="lookup: speculative decoding with prompt lookup against plain lockstep decoding")
    p.add_argument("--max-draft", type=int, default=8, help="--spec lookup's draft tokens per round")
    p.add_argument("--spec-repeats", type=int, default=3, help="--spec: measured runs of each mode")
    p.add_argument("--parallel", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.configs is None:
        args.configs = "tensor,pipeline" if args.spec != "off" else "one,tensor,pipeline"
    if args.spec != "off":
        return print_spec({c: run(c, args) for c in args.configs.split(",")}, args)
    if not args.model_only:
        rows = {c: run(c, args) for c in args.configs.split(",")}
        base = rows.get("one")
        print(f"{'config':9} {'tok/s':>6} {'step ms':>8} {'compute ms':>10} {'waiting':>7} {'coll/step':>9} "
              f"{'B/token':>8} {'coll ms':>8} {'share':>6} {'bcast ms':>8} {'prefill B/chunk':>15}  same tokens")
        for c, r in rows.items():
            same = "" if base is None else ("yes" if r["tokens"] == base["tokens"] else "NO")
            print(f"{c:9} {r['tokens_per_s']:>6.1f} {r['step_ms']:>8.2f} {r['compute_only_ms']:>10.2f} "
                  f"{r['waiting_share']:>7.1%} {r['decode_collectives']:>9} "
                  f"{r['decode_bytes']:>8} {r['collective_ms_per_step']:>8.2f} {r['collective_share']:>6.1%} "
                  f"{r['broadcast_ms']:>8.2f} {r['prefill_bytes']:>15}  {same}  {r['detail']}")
        for c, r in rows.items():
            if r["op_latency_us"]:
                print(f"{c}: " + ", ".join(f"{k}: {v:.0f} us" for k, v in r["op_latency_us"].items()))
    print_model()


def print_spec(rows: dict, args) -> None:
    """--spec's table: per configuration and prompt, decode tokens/s plain and lookup, their ratio, tau."""
    print(f"--spec {args.spec}, --max-draft {args.max_draft}, {args.spec_repeats} runs of each (median), up to "
          f"{args.tokens} tokens, greedy")
    print(f"{'config':9} {'prompt':6} {'tokens':>6} {'plain tok/s':>11} {'lookup tok/s':>12} {'ratio':>6} "
          f"{'tau':>5} {'rounds':>6} {'kept/drafted':>12} {'draft us':>8} {'bcast ms':>11}  same tokens")
    for c, r in rows.items():
        for name, m in r["spec"].items():
            print(f"{c:9} {name:6} {m['tokens']:>6} {m['plain_tps']:>11.2f} {m['lookup_tps']:>12.2f} "
                  f"{m['ratio']:>6.2f} {m['tau']:>5.2f} {m['rounds']:>6} {m['accepted']:>5}/{m['drafted']:<6} "
                  f"{m['draft_us_per_round']:>8.0f} {m['plain_broadcast_ms_per_forward']:>5.1f}/"
                  f"{m['lookup_broadcast_ms_per_forward']:<5.1f}  "
                  f"{'yes' if m['same_tokens'] else 'NO'}  {r['detail']}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
