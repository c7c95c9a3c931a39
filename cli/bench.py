"""`mlx-infer bench`: TTFT, prefill and decode speed of a model, plain and speculative, side by side.

A quick check of one model on this machine, as llama.cpp's llama-bench is. With --suite it runs the
benchmark suites of mlx_infer.benchmark against mlx-lm (and llama.cpp when found) on the same weights, and
--report DIR writes report.md, results.json, machine.json and PNG plots: the measuring is the library's,
this module only parses flags and draws the progress.
"""

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, List, Optional, Sequence

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mlx_infer.benchmark.defaults import BATCH_SIZES, LONG_CONTEXTS, PREFILL_LENGTHS, SUITES
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
    suite: Annotated[Optional[str], typer.Option(
        "--suite", metavar="SUITES",
        help=f"Run benchmark suites instead (comma-separated: {', '.join(SUITES)}, or all), each against mlx-lm "
             "on the same weights (and llama.cpp when found), interleaved; PROMPT is not used.")] = None,
    report: Annotated[Optional[Path], typer.Option(
        "--report", metavar="DIR", help="With --suite: write report.md, results.json, machine.json and plots "
                                        "(matplotlib: pip install 'mlx-infer\\[bench]') into DIR.")] = None,
    lengths: Annotated[str, typer.Option(
        "--lengths", metavar="N,N", help="Prompt lengths (tokens) of the prefill suite.")] = ",".join(map(str, PREFILL_LENGTHS)),
    contexts: Annotated[str, typer.Option(
        "--contexts", metavar="N,N", help="Contexts (tokens) of the long suite.")] = ",".join(map(str, LONG_CONTEXTS)),
    batch_sizes: Annotated[str, typer.Option(
        "--batch-sizes", metavar="N,N", help="Requests decoded together in the batch suite.")] = ",".join(map(str, BATCH_SIZES)),
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
        if suite is not None:
            return run_suites(suite, model, weights, rmm, kv_bits, spec, draft_model, concurrency, trials, max_tokens,
                              (lengths, contexts, batch_sizes), report, as_json, verbose)
        if report is not None:
            raise MlxInferError("--report writes the results of --suite: add --suite decode (or another suite)")
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


def int_list(text: str, flag: str) -> List[int]:
    """'128,512' -> [128, 512].

    Raises:
        MlxInferError: an entry that is not an integer >= 1 (naming the flag)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise MlxInferError(f"{flag} takes comma-separated integers >= 1 (such as 128,512), got {text!r}")
    return values


def run_suites(suite: str, model, weights, rmm, kv_bits, spec: Optional[Sequence[str]], draft_model, concurrency,
               trials: int, max_tokens: int, lists, report: Optional[Path], as_json: bool, verbose: bool) -> None:
    """`bench --suite ...`: check the flags, load the model, run the suites with a progress bar on stderr, print
    the tables (or --json) and write the --report folder."""
    from mlx_infer.benchmark.options import BenchOptions, parse_suites

    names = parse_suites(suite)
    if concurrency is not None or draft_model:
        raise MlxInferError("--suite runs its own concurrency levels and modes: drop --concurrency / --draft-model "
                            "(--batch-sizes and --spec choose them)")
    modes = [m.strip().lower() for m in spec] if spec else None
    for m in modes or []:
        if m not in MODES or m in ("draft",):
            raise MlxInferError(f"--spec {m!r} cannot run in the spec suite: use {', '.join(x for x in MODES if x != 'draft')}")
    lengths, contexts, sizes = (int_list(text, flag) for text, flag in
                                zip(lists, ("--lengths", "--contexts", "--batch-sizes")))
    options = BenchOptions(trials=trials, max_tokens=max_tokens, lengths=lengths, contexts=contexts,
                           batch_sizes=sizes, kv_bits_after=kv_bits, **({"modes": modes} if modes else {}))
    from mlx_infer.benchmark import suites as bench_suites

    engine = load_engine(model, weights.value, verbose, check_rmm(rmm))
    engine.configure_kv(kv_bits=kv_bits)
    with SuiteProgress() as progress:
        results = bench_suites.run_suites(engine, names, options, progress)
    if as_json:
        sys.stdout.write(json.dumps(results) + "\n")
    else:
        from mlx_infer.benchmark.report import suite_table

        for one in results["suites"].values():
            sys.stdout.write("\n".join(suite_table(one)) + "\n")
    if report is not None:
        write_report(report, results, engine)


def write_report(folder: Path, results: dict, engine) -> None:
    """The --report folder: the machine (mlx_infer.benchmark.machine and the kernels `doctor` reports), the
    tables, results.json and the plots (skipped, with the reason in report.md, without matplotlib)."""
    from mlx_infer.benchmark.machine import describe
    from mlx_infer.benchmark.report import write_report as write

    from .doctor import collect

    info = collect()
    machine = {**describe(), "kernels": kernels_line(info), "kernel_threads": info["kernel_threads"],
               "quantized_layers": engine.source.kernels or "MLX"}
    try:
        from mlx_infer.benchmark.plots import write_plots
        plotter, note = write_plots, None
    except ImportError as e:
        plotter, note = None, f"matplotlib is not installed ({e}): pip install 'mlx-infer[bench]'"
    command = "mlx-infer " + " ".join(sys.argv[1:])
    files = write(folder, results, machine, command, plotter, note)
    stderr_console.print(f"wrote {', '.join(str(f) for f in files)}" + (f"\n{note}" if note else ""), markup=False)


def kernels_line(info: dict) -> str:
    """Which kernels run, from `doctor`'s collect(): the quantized matmul, attention, RMM, paged KV, layers."""
    if info["kernels_missing"]:
        return f"CPU kernels off: {info['kernels_missing']}"
    layers = info["layer_kernels"]
    return (f"quantized matmul {info['kernels']}, quantized-KV attention {info['attention_kernel']}, RMM "
            f"{info['rmm_kernel']}, paged attention {info['paged_kv_kernels']['attention']}, RMSNorm / RoPE / SwiGLU "
            f"{layers['rms_norm']} / {layers['rope']} / {layers['swiglu']}")


stderr_console = Console(stderr=True, highlight=False)


class SuiteProgress:
    """The suites' progress callback (suite, runs done, runs in it): a rich progress bar per suite on stderr."""

    def __init__(self):
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=stderr_console, transient=False)
        self.tasks: dict = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def __call__(self, suite: str, done: int, total: int) -> None:
        if suite not in self.tasks:
            self.tasks[suite] = self.progress.add_task(f"bench {suite}", total=total)
        self.progress.update(self.tasks[suite], completed=done, total=total)
