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
  plain / lookup (llama.cpp)
                         llama-cpp-python on the same GGUF (when it is installed and the model is one), every
                         request a whole prefill of the same token ids: plain decoding, and its prompt-lookup
                         speculative decoding (LlamaPromptLookupDecoding, its default 10 draft tokens, n-grams
                         up to 2). llama.cpp computes with int8 activations, so its greedy tokens may differ
                         from mlx-infer's: its '=' compares its lookup row with its own plain row

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

--policy instead measures the draft-length policy, greedy, on every set: plain decoding; lookup with max_draft
auto (the scheduler), twice (the second copy is an A/A control: the same code, so its spread is the run's
noise floor); lookup with max_draft auto without the scheduler's check of speculation against plain
decoding (schedule.ARM_WINDOW out of reach for its requests); lookup with each fixed draft length of
--fixed; dflash (the registered drafter) with max_draft
auto. Each configuration is an Engine of its own over the one loaded model, every request starts from an
empty KV cache, and every prompt runs --repeats times per configuration, interleaved, the order rotated per
repeat. Every run counts: per set, decode tokens/s after the first token and tokens/s with prefill, the ratio
to plain pooled over the runs, its min/max over repeats and a paired bootstrap 95% interval; the scheduler
against the best fixed length; the A/A control against its twin, with a verdict from the interval. Writes
bench/results/spec-policy-*.json (every run's numbers included). (At commit 3239a1f it also switched off,
one at a time, the scheduler's curve correction, probe back-off, delayed first probe and memory across
requests; none showed a benefit beyond the noise, and they were removed: docs/benchmarks.md.)

Usage: python bench/spec.py [--model PATH] [--limit 4] [--max-tokens 48] [--sets chat,code,math,copy] [--repeats 2]
       [--modes lookup,draft,layerskip,dflash,auto] [--per-prompt]
Prints a table per temperature and writes bench/results/spec-*.json.
       python bench/spec.py --policy [--limit 2] [--max-tokens 48] [--repeats 2] [--fixed 1,2,3,4,6,8]
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import bootstrap_ratio, machine, machine_line, prompt_set, write_result  # noqa: E402
from mlx_infer.engine import Engine  # noqa: E402
from mlx_infer.speculative import schedule  # noqa: E402
from mlx_infer.speculative.schedule import ARM_WINDOW  # noqa: E402

SETS = ("chat", "code", "math", "copy")
#: The slow peer rows run each prompt once, whatever --repeats (they are 2-4x slower than the rest).
PEERS_ONCE = ("draft (mlx-lm speculative)", "lookup (mlx-dspark)")


def load_prompts(name: str, limit: int) -> list:
    """The first `limit` prompts of set `name` (common.prompt_set)."""
    return prompt_set(name)[:limit]


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


def llama_cpp_rows(engine) -> dict:
    """{name: run} for plain decoding and prompt lookup on llama.cpp (llama-cpp-python), on the engine's
    GGUF; {} when llama-cpp-python is not installed or the model is not a GGUF."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return {}
    if engine.source.kind not in ("gguf", "default"):
        return {}
    eos = set(engine.tokenizer.eos_token_ids)

    def runner(llm):
        forwards = [0]
        evaluate = llm.eval

        def counted(tokens):
            forwards[0] += 1
            return evaluate(tokens)

        llm.eval = counted  # generate() calls self.eval once per forward: tau = tokens per forward after prefill

        def run(prompt_ids, temp, max_tokens, seed):
            llm.reset()  # a whole prefill, as every other row
            llm.set_seed(seed)
            forwards[0] = 0
            start = time.perf_counter()
            toks, first, seen = [], None, 0
            for t in llm.generate(list(prompt_ids), temp=temp, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                first = first or time.perf_counter()
                seen += 1  # EOS included: the forward that produced it counts
                if t in eos:
                    break
                toks.append(int(t))
                if len(toks) >= max_tokens:
                    break
            return {"tokens": toks, "seconds": time.perf_counter() - start, "first_s": (first or start) - start,
                    "tau": (seen - 1) / max(1, forwards[0] - 1)}  # the first token comes from the prefill

        return run

    path, threads = str(engine.source.path), os.cpu_count()
    plain = Llama(model_path=path, n_ctx=4096, n_threads=threads, verbose=False)
    lookup = Llama(model_path=path, n_ctx=4096, n_threads=threads, verbose=False,
                   draft_model=LlamaPromptLookupDecoding())
    return {"plain (llama.cpp)": runner(plain), "lookup (llama.cpp)": runner(lookup)}


# -- --policy: the draft scheduler against fixed draft lengths and against its own A/A twin --

#: --policy defaults, sized to finish in about 20 minutes on a shared 2-core CPU machine: 10 configurations x
#: 4 sets x POLICY_LIMIT prompts x POLICY_REPEATS repeats = 160 requests of POLICY_MAX_TOKENS tokens, ~2-10 s
#: each there depending on the other jobs' load.
POLICY_LIMIT = 2
POLICY_REPEATS = 2
POLICY_MAX_TOKENS = 32
POLICY_FIXED = "1,2,3,4,6,8"
PLAIN = "plain"
NAME_W = 34  # width of the configuration column


@dataclass(frozen=True)
class PolicyConfig:
    """One row of --policy: an Engine of its own and the request options."""

    name: str
    engine: Engine
    mode: str
    max_draft: Union[str, int]
    #: the configuration this one is compared with (the A/A control's twin; None: none)
    baseline: Optional[str] = None
    #: DraftScheduler's check of speculation against plain decoding (schedule.ARM_WINDOW); False: never
    #: compared, speculation decides by the cost curve alone
    plain_check: bool = True


def policy_configs(base, fixed: Sequence[int]) -> List[PolicyConfig]:
    """Every configuration of --policy, each with its own Engine over the one loaded model."""

    def engine() -> Engine:
        return Engine(base.model, base.tokenizer, base.config, base.source)

    configs = [PolicyConfig(PLAIN, engine(), "off", "auto"), PolicyConfig("lookup auto", engine(), "lookup", "auto"),
               PolicyConfig("lookup auto (A/A twin)", engine(), "lookup", "auto", "lookup auto")]
    configs.append(PolicyConfig("lookup auto, no plain check", engine(), "lookup", "auto", "lookup auto",
                                plain_check=False))
    configs += [PolicyConfig(f"lookup fixed {g}", engine(), "lookup", g) for g in fixed]
    configs.append(PolicyConfig("dflash auto", engine(), "dflash", "auto"))
    return configs


def run_cell(config: PolicyConfig, prompt_ids: List[int], max_tokens: int) -> dict:
    """One greedy request of a configuration, from an empty KV cache (every request prefills its prompt)."""
    config.engine.reset()
    schedule.ARM_WINDOW = ARM_WINDOW if config.plain_check else sys.maxsize  # read when a scheduler is made
    try:
        r = config.engine.generate(prompt_ids, max_tokens=max_tokens, temperature=0.0, speculative=config.mode,
                                   max_draft=config.max_draft)
    finally:
        schedule.ARM_WINDOW = ARM_WINDOW
    s = r.stats
    return {"token_ids": r.token_ids, "tokens": len(r.token_ids), "total_s": s.total_s, "ttft_s": s.ttft_s,
            "tau": s.tau if config.mode != "off" else 1.0, "rounds": s.rounds, "spec_mode": s.spec_mode or "off"}


def cell_rate(cell: dict, metric: str) -> Tuple[float, float]:
    """(tokens, seconds) of a cell: "decode" counts tokens after the first and time after the first token;
    "wall" all tokens and the whole request, prefill included."""
    if metric == "wall":
        return float(cell["tokens"]), cell["total_s"]
    if cell["tokens"] < 2:
        return 0.0, 0.0
    return float(cell["tokens"] - 1), cell["total_s"] - cell["ttft_s"]


def pooled(cells: Sequence[dict], metric: str) -> float:
    """tokens/s pooled over cells (sum of tokens / sum of seconds)."""
    n = sum(cell_rate(c, metric)[0] for c in cells)
    s = sum(cell_rate(c, metric)[1] for c in cells)
    return n / s if s > 0 else 0.0


def paired(cells: Dict[tuple, dict], a: str, b: str, keys: Sequence[tuple], metric: str) -> dict:
    """Ratio of configuration a's rate to b's over the cells `keys` ((set, prompt, repeat) each): pooled,
    min/max over repeats (each repeat pooled over its prompts) and a paired bootstrap 95% interval."""
    ratio = (pooled([cells[k + (a,)] for k in keys], metric) /
             max(pooled([cells[k + (b,)] for k in keys], metric), 1e-12))
    per_rep = []
    for rep in sorted({k[2] for k in keys}):
        ks = [k for k in keys if k[2] == rep]
        pa, pb = pooled([cells[k + (a,)] for k in ks], metric), pooled([cells[k + (b,)] for k in ks], metric)
        if pb > 0:
            per_rep.append(pa / pb)
    low, high = bootstrap_ratio([(cell_rate(cells[k + (a,)], metric), cell_rate(cells[k + (b,)], metric))
                                 for k in keys])
    return {"ratio": ratio, "rep_min": min(per_rep, default=float("nan")),
            "rep_max": max(per_rep, default=float("nan")), "ci95": [low, high]}


def verdict(p: dict) -> str:
    """What a ratio (a configuration / its twin) says, from its bootstrap interval: for the A/A control
    anything but "not distinguishable" means the interval understates the run's noise."""
    low, high = p["ci95"]
    if high < 1.0:
        return "slower (beyond the interval)"
    if low > 1.0:
        return "faster (beyond the interval)"
    return "not distinguishable"


def policy_main(args) -> None:
    """--policy: run every configuration on every prompt of every set, interleaved and repeated, greedy."""
    limit = args.limit or POLICY_LIMIT
    repeats = args.repeats or POLICY_REPEATS
    max_tokens = args.max_tokens or POLICY_MAX_TOKENS
    fixed = [int(g) for g in args.fixed.split(",")]
    sets = args.sets.split(",")
    started = time.perf_counter()
    base = mlx_infer.load(args.model)
    configs = policy_configs(base, fixed)
    names = [c.name for c in configs]
    by_name = {c.name: c for c in configs}

    # warm-up: compile, page in, load the drafter, measure (or read) cost curves and calibrations once
    warm = base.encode("Hello")
    for c in configs:
        run_cell(c, warm, 4)

    cells: Dict[tuple, dict] = {}  # (set, prompt, repeat, config) -> cell
    for set_name in sets:
        for i, prompt in enumerate(load_prompts(set_name, limit)):
            prompt_ids = base.encode(prompt)
            for rep in range(repeats):
                shift = rep * len(names) // repeats  # each repeat starts elsewhere in the order
                for name in names[shift:] + names[:shift]:
                    cells[(set_name, i, rep, name)] = run_cell(by_name[name], prompt_ids, max_tokens)
            reference = cells[(set_name, i, 0, PLAIN)]["token_ids"]
            for rep in range(repeats):
                for name in names:
                    cell = cells[(set_name, i, rep, name)]
                    cell["identical"] = cell["token_ids"] == reference
            print(f"  {set_name} #{i} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)

    results = {}
    groups = {s: [k[:3] for k in cells if k[0] == s and k[3] == PLAIN] for s in sets}
    groups["all"] = [k for s in sets for k in groups[s]]
    for group, keys in groups.items():
        rows = {}
        for name in names:
            cs = [cells[k + (name,)] for k in keys]
            rows[name] = {
                "decode_tps": pooled(cs, "decode"), "wall_tps": pooled(cs, "wall"),
                "vs_plain_decode": paired(cells, name, PLAIN, keys, "decode"),
                "vs_plain_wall": paired(cells, name, PLAIN, keys, "wall"),
                "tau": sum(c["tau"] for c in cs) / len(cs),
                "identical_to_plain": all(c["identical"] for c in cs),
                "spec_modes_used": sorted({c["spec_mode"] for c in cs}),
            }
            if by_name[name].baseline:
                rows[name]["vs_baseline_decode"] = paired(cells, name, by_name[name].baseline, keys, "decode")
                rows[name]["vs_baseline_wall"] = paired(cells, name, by_name[name].baseline, keys, "wall")
        best = max((f"lookup fixed {g}" for g in fixed), key=lambda n: rows[n]["decode_tps"])
        results[group] = {"rows": rows, "best_fixed": best,
                          "auto_vs_best_fixed_decode": paired(cells, "lookup auto", best, keys, "decode"),
                          "auto_vs_best_fixed_wall": paired(cells, "lookup auto", best, keys, "wall")}
    elapsed = time.perf_counter() - started

    info = machine()
    print(f"model: {base.source.name} ({base.source.weights} weights); greedy; {limit} prompts per set, "
          f"{max_tokens} new tokens, {repeats} repeats (interleaved, order rotated per repeat); {elapsed:.0f} s")
    print(f"{machine_line(info)}; load average {os.getloadavg()[0]:.2f} at the end")

    def ratio_cell(p: dict) -> str:
        return f"{p['ratio']:5.2f}x [{p['rep_min']:4.2f}-{p['rep_max']:4.2f}] ({p['ci95'][0]:4.2f}-{p['ci95'][1]:4.2f})"

    for group, res in results.items():
        print(f"\n{group}" + (" (every set pooled)" if group == "all" else ""))
        print(f"{'configuration':<{NAME_W}}{'dec tok/s':>10}{'vs plain (decode)':>34}{'wall tok/s':>11}"
              f"{'vs plain (wall)':>34}{'tau':>6}  same  modes")
        for name, r in res["rows"].items():
            print(f"{name:<{NAME_W}}{r['decode_tps']:10.1f}{ratio_cell(r['vs_plain_decode']):>34}{r['wall_tps']:11.1f}"
                  f"{ratio_cell(r['vs_plain_wall']):>34}{r['tau']:6.2f}  {'=' if r['identical_to_plain'] else '!':>4}"
                  f"  {','.join(r['spec_modes_used'])}")
        print(f"best fixed: {res['best_fixed']}; lookup auto / best fixed: decode "
              f"{ratio_cell(res['auto_vs_best_fixed_decode'])}, wall {ratio_cell(res['auto_vs_best_fixed_wall'])}")

    print("\nA/A control: rate of the twin / rate of lookup auto (decode tokens/s; wall in the JSON): the noise floor")
    print(f"{'configuration':<{NAME_W}}" + "".join(f"{g:>34}" for g in results) + "  verdict (all sets)")
    for name in names:
        if not by_name[name].baseline:
            continue
        line = "".join(f"{ratio_cell(results[g]['rows'][name]['vs_baseline_decode']):>34}" for g in results)
        print(f"{name:<{NAME_W}}{line}  {verdict(results['all']['rows'][name]['vs_baseline_decode'])}")
    print("\ncells: ratio pooled over prompts and repeats [min-max over repeats] (paired bootstrap 95% interval over "
          "the prompt x repeat cells);\n'decode': tokens/s after the first token; 'wall': tokens / request time, prefill "
          "included; tau: committed tokens per target forward;\n'=': every greedy output identical to plain decoding's, "
          "'!': not. 'lookup auto (A/A twin)' runs the same code as 'lookup auto',\nso its spread is the run's "
          "noise floor. The best fixed length is picked on the same data\n"
          "(an optimistic choice).")
    payload = {"machine": info, "args": {**vars(args), "limit": limit, "repeats": repeats, "max_tokens": max_tokens},
               "elapsed_s": elapsed, "results": results,
               "cells": [{"set": k[0], "prompt": k[1], "repeat": k[2], "config": k[3],
                          **{f: v for f, v in c.items() if f != "token_ids"}} for k, c in cells.items()]}
    path = write_result("spec-policy", payload)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF / MLX dir / repo id (default: the embedded default model)")
    ap.add_argument("--limit", type=int, default=None,
                    help="prompts per set (the files hold 10; default 4, --policy: %d)" % POLICY_LIMIT)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 48 (--policy: %d)" % POLICY_MAX_TOKENS)
    ap.add_argument("--sets", default=",".join(SETS), help="prompt sets of bench/prompts/, comma-separated")
    ap.add_argument("--temps", default="0,0.7", help="temperatures, comma-separated (0: greedy)")
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="layers of the target cut into the draft model of the draft rows")
    ap.add_argument("--max-draft", default="auto", help="'auto' or an int")
    ap.add_argument("--modes", default="lookup,draft,layerskip,dflash,auto",
                    help="mlx-infer speculative modes to run, comma-separated")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each prompt per system, interleaved; the fastest counts (peers: one run); "
                         "default 2 (--policy: %d, each counts)" % POLICY_REPEATS)
    ap.add_argument("--per-prompt", action="store_true",
                    help="also print each prompt's speedups (with prefill / d: decode only) and tau")
    ap.add_argument("--policy", action="store_true",
                    help="measure the draft-length policy instead (greedy; see the module docstring)")
    ap.add_argument("--fixed", default=POLICY_FIXED, help="--policy: the fixed lookup draft lengths to compare")
    args = ap.parse_args()
    if args.policy:
        policy_main(args)
        return
    args.limit = args.limit or 4
    args.max_tokens = args.max_tokens or 48
    args.repeats = args.repeats or 2
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
    systems.update(llama_cpp_rows(engine))

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
                reference = {}  # family (llama.cpp or the MLX systems) -> the first greedy tokens seen
                best = {}  # system -> its fastest run of this prompt
                names = list(systems)
                for rep in range(args.repeats):
                    # each repeat starts one system later, so that no system always runs after the same one
                    for name in names[rep % len(names):] + names[: rep % len(names)]:
                        if rep and name in PEERS_ONCE:
                            continue
                        out = systems[name](prompt_ids, temp, args.max_tokens, 1000 + i)
                        family = "llama.cpp" in name
                        if family not in reference:
                            reference[family] = out["tokens"]
                        elif temp == 0 and out["tokens"] != reference[family]:
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
    print(machine_line(info))
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
    print("\ncells: tokens/s, speedup over plain (mlx-infer), tau; '=' greedy output identical to plain, '!' not\n"
          "(llama.cpp rows: to plain (llama.cpp)).\n"
          "greedy: tokens / wall time, prefill included, then 'd': the speedup of decode tokens/s after the first\n"
          "token (prefill excluded); sampling: decode tokens/s after the first token\n"
          "(sampled answers differ in length), '*' where no first-token time exists (wall time, against plain's)")
    path = write_result("spec", {"machine": info, "args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
