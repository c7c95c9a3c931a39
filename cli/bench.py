"""`mlx-infer bench`: TTFT, prefill and decode speed of a model, plain and speculative, side by side.

A quick check of one model on this machine, as llama.cpp's llama-bench is; the reproducible comparisons
against the peers (mlx-lm, llama.cpp, mlx-dspark) are bench/decode.py and bench/spec.py in the repo.
"""

import json
import statistics
import sys
import time
from typing import Annotated, List, Optional

import typer
from rich.console import Console
from rich.table import Table

from mlx_infer.defaults import SPEC_MODEL_MODES as MODEL_MODES, SPEC_MODES as MODES
from mlx_infer.errors import MlxInferError

from .errors import user_errors
from .options import (
    DraftModelOpt, KVBitsOpt, MaxDraftOpt, ModelOpt, RmmOpt, VerboseOpt, Weights, WeightsOpt, check_rmm, spec_kwargs,
)
from .progress import load_engine

DEFAULT_PROMPT = ("Repeat this list, then add two more fruits to it: apples, bananas, cherries, dates, "
                  "elderberries, figs, grapes.")


def bench(
    prompt: Annotated[str, typer.Argument(help="The prompt to time.")] = DEFAULT_PROMPT,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Tokens generated per trial.")] = 64,
    trials: Annotated[int, typer.Option("--trials", "-t", help="Trials per mode; the median is reported.")] = 3,
    spec: Annotated[Optional[List[str]], typer.Option(
        "--spec", metavar="MODE",
        help=f"A mode to compare (repeatable): {', '.join(MODES)}; default: off and auto.")] = None,
    draft_model: DraftModelOpt = None,
    max_draft: MaxDraftOpt = "auto",
    weights: WeightsOpt = Weights.auto,
    rmm: RmmOpt = None,
    kv_bits: KVBitsOpt = None,
    concurrency: Annotated[Optional[int], typer.Option(
        "--concurrency", "-c", min=1,
        help="Time N copies of PROMPT decoded together (continuous batching) against the same N one after "
             "another, instead of the --spec modes.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Time greedy generation of PROMPT in each --spec mode, interleaved, and print a table.

    Columns: TTFT (s), prefill and decode tokens/s, tau (committed tokens per target forward) and speed
    relative to plain decoding. Outputs are checked to be identical to plain decoding. With --rmm every mode
    runs on the reduced model (its plain decoding is the reference); with --kv-bits every mode decodes over
    the quantized KV cache.
    """
    from mlx_infer.kv.quant_options import kv_quant

    with user_errors(verbose):
        for flag, value in (("--trials", trials), ("--max-tokens", max_tokens)):
            if value < 1:
                raise MlxInferError(f"{flag} must be >= 1, got {value}")
        kv_quant(kv_bits)  # a bad --kv-bits fails before the model loads
        if concurrency is not None:
            if spec or draft_model:
                raise MlxInferError("--concurrency times plain batched decoding: drop --spec / --draft-model")
            checked = check_rmm(rmm, "bench --concurrency", "bench without --concurrency")
            engine = load_engine(model, weights.value, verbose, checked)
            engine.configure_kv(kv_bits=kv_bits)
            return show_concurrency(engine, prompt, concurrency, max_tokens, trials, as_json)
        modes = [m.strip().lower() for m in spec] if spec else ["off", "auto"]
        kwargs = {m: spec_kwargs(m, draft_model if m in MODEL_MODES else None, max_draft) for m in modes}
        if draft_model and not any(m in MODEL_MODES for m in modes):
            raise MlxInferError(f"--draft-model needs a --spec that uses it ({', '.join(MODEL_MODES)})")
        engine = load_engine(model, weights.value, verbose, check_rmm(rmm))
        engine.configure_kv(kv_bits=kv_bits)
        runs = {m: [] for m in modes}
        for m in modes:  # warm-up (compile; measure the verify cost curve once)
            engine.generate(prompt, max_tokens=4, **kwargs[m])
        for _ in range(trials):
            for m in modes:
                engine.reset()  # every run prefills the whole prompt (TTFT and prefill tok/s mean that)
                runs[m].append(engine.generate(prompt, max_tokens=max_tokens, **kwargs[m]))
        rows = []
        base = statistics.median(r.stats.total_s / max(1, len(r.token_ids)) for r in runs[modes[0]])
        reference = runs[modes[0]][0].token_ids
        for m in modes:
            stats = [r.stats for r in runs[m]]
            per_token = statistics.median(s.total_s / max(1, s.generated_tokens) for s in stats)
            rows.append({
                "mode": m,
                "used": stats[-1].spec_mode or "off",
                "ttft_s": statistics.median(s.ttft_s for s in stats),
                "prefill_tps": statistics.median(s.prefill_tps for s in stats),
                "decode_tps": statistics.median(s.decode_tps for s in stats),
                "tau": statistics.median(s.tau for s in stats) if stats[-1].rounds else 1.0,
                "speed_vs_first": base / per_token,
                "identical": all(r.token_ids == reference for r in runs[m]),
                "tokens": stats[-1].generated_tokens,
            })
        if as_json:
            sys.stdout.write(json.dumps({**json_header(engine, trials), "rows": rows}) + "\n")
            return
        table = Table(title=f"{title(engine)}, median of {trials}")
        for col in ("mode (used)", "TTFT s", "prefill tok/s", "decode tok/s", "tau", f"vs {modes[0]}", "same output"):
            table.add_column(col, justify="left" if col.startswith("mode") else "right")
        for r in rows:
            table.add_row(f"{r['mode']} ({r['used']})", f"{r['ttft_s']:.3f}", f"{r['prefill_tps']:.1f}",
                          f"{r['decode_tps']:.1f}", f"{r['tau']:.2f}", f"{r['speed_vs_first']:.2f}x",
                          "yes" if r["identical"] else "NO")
        Console(highlight=False).print(table)


def json_header(engine, trials: int) -> dict:
    """What a --json result says of the run: model, weights, RMM retention, KV quantization, trials."""
    return {"model": engine.source.name, "weights": engine.source.weights, "rmm": engine.source.rmm,
            "kv_bits": engine.kv_bits, "trials": trials}


def title(engine) -> str:
    """'default (native weights)', with ', rmm attn=0.5' for a reduced model and ', 4-bit KV' (', KV k8v4') for a
    quantized KV cache."""
    rmm = f", rmm {engine.source.rmm}" if engine.source.rmm is not None else ""
    bits = engine.kv_bits
    kv = "" if bits is None else f", {bits}-bit KV" if bits.isdigit() else f", KV {bits}"
    return f"{engine.source.name} ({engine.source.weights} weights{rmm}{kv})"


def show_concurrency(engine, prompt: str, n: int, max_tokens: int, trials: int, as_json: bool) -> None:
    """`bench --concurrency N`: N copies of the prompt through Engine.generate_batch and the same N through
    Engine.generate one after another, interleaved; total tokens/s (all tokens / wall seconds, prefill
    included), the median of `trials`."""
    ids = engine.encode(prompt)

    def batched():
        start = time.perf_counter()
        out = engine.generate_batch([ids] * n, max_tokens=max_tokens)
        return time.perf_counter() - start, [r.token_ids for r in out]

    def sequential():
        start, out = time.perf_counter(), []
        for _ in range(n):
            engine.reset()
            out.append(engine.generate(ids, max_tokens=max_tokens).token_ids)
        return time.perf_counter() - start, out

    runners = {"batched": batched, "one after another": sequential}
    for run in runners.values():  # warm-up
        run()
    runs = {name: [] for name in runners}
    for _ in range(trials):
        for name, run in runners.items():
            runs[name].append(run())
    rows = []
    for name, results in runs.items():
        wall = statistics.median(w for w, _ in results)
        tokens = sum(len(t) for t in results[0][1])
        rows.append({"system": name, "requests": n, "tokens": tokens, "wall_s": wall, "total_tps": tokens / wall,
                     "identical": all(r[1] == runs["one after another"][0][1] for r in results)})
    for r in rows:
        r["speedup"] = r["total_tps"] / rows[1]["total_tps"]
    if as_json:
        sys.stdout.write(json.dumps({**json_header(engine, trials), "rows": rows}) + "\n")
        return
    table = Table(title=f"{title(engine)}, {n} requests, median of {trials}")
    for col in ("system", "tokens", "wall s", "total tok/s", "speedup", "same output"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        table.add_row(r["system"], str(r["tokens"]), f"{r['wall_s']:.2f}", f"{r['total_tps']:.1f}",
                      f"{r['speedup']:.2f}x", "yes" if r["identical"] else "NO")
    Console(highlight=False).print(table)
