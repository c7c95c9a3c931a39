"""TTFT and decode tokens/s of mlx-infer against mlx_lm.stream_generate, in one run, interleaved.

Rows (same GGUF, same prompt, greedy, same process):
  mlx-lm (native)       mlx_lm.stream_generate on the model as stored (Q4_1 -> MLX 4-bit), loaded by mlx_lm.load
                        (MLX's own quantized matmul)
  mlx-infer (native)    the same weights through mlx-infer's Engine: on the CPU its quantized layers run on
                        mlx-infer's kernel (what weights="auto" picks when the kernel is available)
  mlx-infer (native, MLX's RMSNorm / RoPE)
                        the same, with the model's RMSNorm and RoPE on MLX's own mx.fast ops (which MLX's CPU
                        backend runs as 11 and 29 operations) instead of mlx-infer's CPU kernels
  mlx-lm (float32)      mlx_lm.stream_generate on the dequantized float32 model
  mlx-infer (float32)   the float32 CPU path (what weights="auto" picks without the kernel, with OpenBLAS)
  llama.cpp             llama-cpp-python on the same GGUF, when it is installed, with as many threads as
                        this machine has cores (mlx-infer's kernel uses them all)
Every run starts from an empty KV cache (mlx-infer's `reset()`, llama-cpp-python's `reset()`, mlx-lm's
fresh cache), so TTFT is a whole prefill of the same prompt.

Then the verify cost curve (unless --curve-rounds 0): the seconds of one forward of width w = 1..--max-width
tokens over a COST_CONTEXT-token cache, all logits computed and read back (what a verify of w - 1 draft
tokens costs), for mlx-infer's kernel path, its float32 path and llama.cpp (a Llama with logits_all, its
KV cache cut back to the context after each forward). Each round times every width of every path, the paths
in turn, keeping the fastest of COST_REPEATS per width (mlx-infer's `measure_cost_curve`); the kernel path
twice, each forward built by the model's Python and replayed as a compiled graph ("replayed": what its
speculative loop runs and prices rounds with); the table gives the median over rounds and each width's cost
against width 1. mlx-lm's native path (MLX's quantized matmul, a per-row loop on the CPU) is left out: its
curve alone would take minutes.

Usage: python bench/decode.py [--model PATH] [--trials 5] [--max-tokens 64] [--curve-rounds 3] [--max-width 16]
Prints the tables and writes bench/results/decode-*.json and decode-*.png (the cost curves).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import interleaved, machine, machine_line, median, pyplot, time_tokens, write_result  # noqa: E402
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_map_with_path  # noqa: E402
from mlx_lm import load as mlx_lm_load, stream_generate  # noqa: E402

from mlx_lm.models import gemma3_text  # noqa: E402

from mlx_infer.kernels.rms_norm import KernelOffsetRMSNorm, KernelRMSNorm  # noqa: E402
from mlx_infer.kernels.rope import KernelRoPE  # noqa: E402
from mlx_infer.speculative.cost import COST_CONTEXT, COST_REPEATS, measure_cost_curve  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def mlx_lm_runner(model, tokenizer, prompt_ids, max_tokens):
    def run():
        return time_tokens(r.token for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens))

    return run


def mlx_infer_runner(engine, prompt_ids, max_tokens):
    def run():
        engine.reset()  # a whole prefill every time, as mlx-lm's runs
        return time_tokens(s for s in engine.stream_steps(prompt_ids, max_tokens=max_tokens) if s.token is not None)

    return run


def with_mlx_layers(model: nn.Module) -> nn.Module:
    """`model` (in place) with mlx-infer's RMSNorm / RoPE kernel layers swapped back for mlx.nn's own (Gemma's
    norm for mlx-lm's; same weights); the quantized products stay on the kernel."""
    def swap(_, m):
        if isinstance(m, KernelRMSNorm):
            plain = nn.RMSNorm(m.weight.shape[0], eps=m.eps)
            plain.weight = m.weight
            return plain
        if isinstance(m, KernelOffsetRMSNorm):  # Gemma's (the same formula in every Gemma module of mlx-lm)
            plain = gemma3_text.RMSNorm(m.weight.shape[0], eps=m.eps)
            plain.weight = m.weight
            return plain
        if isinstance(m, KernelRoPE):
            return nn.RoPE(m.dims, traditional=m.traditional, base=m.base, scale=m.scale)
        return m

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def llama_cpp_runner(gguf_path, prompt_ids, max_tokens):
    """llama.cpp through llama-cpp-python (None when it is not installed), given the very token ids the
    other rows decode from (mlx-infer's chat-templated prompt): llama-cpp-python's own chat handler gave
    Gemma-3's GGUF an empty answer."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf_path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)

    def run():
        llm.reset()  # else it keeps the evaluated prompt and the next TTFT is no prefill
        return time_tokens(llm.create_completion(list(prompt_ids), max_tokens=max_tokens, temperature=0.0,
                                                 stream=True))

    return run


def llama_cpp_curve(gguf_path, max_width: int):
    """A callable timing llama.cpp's forward of each width 1..max_width over a COST_CONTEXT-token context
    ({width: seconds}, the fastest of COST_REPEATS after one untimed pass), or None without llama-cpp-python.
    logits_all: every position's logits are computed and copied out, as a verify needs them."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf_path), n_ctx=512, n_threads=os.cpu_count(), logits_all=True, verbose=False)
    tokens = [int(t) for t in mx.random.randint(0, llm.n_vocab(), (COST_CONTEXT + max_width,),
                                                  key=mx.random.key(0)).tolist()]
    llm.eval(tokens[:COST_CONTEXT])

    def run():
        seconds = {w: float("inf") for w in range(1, max_width + 1)}
        for rep in range(COST_REPEATS + 1):
            for w in range(1, max_width + 1):
                llm.n_tokens = COST_CONTEXT  # eval() drops the KV cache past n_tokens first
                start = time.perf_counter()
                llm.eval(tokens[COST_CONTEXT:COST_CONTEXT + w])
                if rep:
                    seconds[w] = min(seconds[w], time.perf_counter() - start)
        return seconds

    return run


def cost_curves(curves: dict, rounds: int) -> dict:
    """{path: {width: median seconds}} over `rounds` rounds, each timing every path in turn."""
    raw = {name: [] for name in curves}
    for _ in range(rounds):
        for name, run in curves.items():
            raw[name].append(run())
    return {name: {w: statistics.median(r[w] for r in runs) for w in runs[0]} for name, runs in raw.items()}


def plot_curves(curves: dict, path: Path, title: str):
    """Cost curves as a PNG: forward ms against width, and each width's cost against width 1."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (ms, rel) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, secs in curves.items():
        widths = sorted(secs)
        ms.plot(widths, [secs[w] * 1e3 for w in widths], marker="o", ms=3, label=name)
        rel.plot(widths, [secs[w] / secs[1] for w in widths], marker="o", ms=3, label=name)
    rel.axhline(1.5, color="grey", ls="--", lw=0.8)
    rel.text(1, 1.53, "1.5x width 1", color="grey", fontsize=8)
    ms.set(xlabel="forward width (tokens: 1 + draft tokens)", ylabel="ms per forward", title="verify cost")
    rel.set(xlabel="forward width (tokens)", ylabel="cost / cost of width 1", title="relative to one token")
    for ax in (ms, rel):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF / MLX dir / repo id (default: the embedded default model)")
    ap.add_argument("--trials", type=int, default=5, help="interleaved trials of every path (the median counts)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per trial (greedy)")
    ap.add_argument("--curve-rounds", type=int, default=3, help="rounds of the verify cost curve (0: none)")
    ap.add_argument("--max-width", type=int, default=16, help="widest forward of the cost curve")
    args = ap.parse_args()

    native = mlx_infer.load(args.model, weights="native")
    fast = mlx_infer.load(args.model, weights="float32")
    mlx_layers = mlx_infer.load(args.model, weights="native")
    with_mlx_layers(mlx_layers.model)
    prompt_ids = native.encode(PROMPT)
    plain_model, plain_tokenizer = mlx_lm_load(str(native.source.mlx_dir))  # MLX's own quantized matmul
    runners = {
        "mlx-lm (native)": mlx_lm_runner(plain_model, plain_tokenizer, prompt_ids, args.max_tokens),
        f"mlx-infer (native, {native.source.kernels or 'MLX qmm'})": mlx_infer_runner(native, prompt_ids,
                                                                                      args.max_tokens),
        "mlx-infer (native, MLX's RMSNorm / RoPE)": mlx_infer_runner(mlx_layers, prompt_ids, args.max_tokens),
        "mlx-lm (float32)": mlx_lm_runner(fast.model, fast.tokenizer, prompt_ids, args.max_tokens),
        "mlx-infer (float32)": mlx_infer_runner(fast, prompt_ids, args.max_tokens),
    }
    if native.source.kind in ("gguf", "default"):
        peer = llama_cpp_runner(native.source.path, prompt_ids, args.max_tokens)
        if peer is not None:
            runners["llama.cpp"] = peer
    for run in runners.values():  # warm-up: compile, page in weights
        run()
    results = interleaved(runners, args.trials)

    rows = []
    base = {"native": median(results["mlx-lm (native)"], "decode_tps"),
            "float32": median(results["mlx-lm (float32)"], "decode_tps")}
    for name, trials in results.items():
        kind = "float32" if "float32" in name else "native"
        row = {
            "name": name,
            "ttft_s": median(trials, "ttft_s"),
            "prefill_tps": len(prompt_ids) / median(trials, "ttft_s"),
            "decode_tps": median(trials, "decode_tps"),
            "tokens": median(trials, "tokens"),
            "decode_vs_mlx_lm": median(trials, "decode_tps") / base[kind] if name != "llama.cpp" else None,
        }
        rows.append(row)

    info = machine()
    print(f"model: {native.source.name} ({native.source.path.name}); prompt {len(prompt_ids)} tokens; "
          f"{args.max_tokens} new tokens; median of {args.trials} interleaved trials")
    print(machine_line(info))
    print(f"{'path':<42}{'TTFT s':>9}{'prefill tok/s':>15}{'tokens':>8}{'decode tok/s':>14}{'vs mlx-lm':>11}")
    for r in rows:
        ratio = f"{r['decode_vs_mlx_lm']:.2f}x" if r["decode_vs_mlx_lm"] else "-"
        print(f"{r['name']:<42}{r['ttft_s']:>9.3f}{r['prefill_tps']:>15.1f}{r['tokens']:>8.0f}{r['decode_tps']:>14.1f}"
              f"{ratio:>11}")
    curves = {}
    if args.curve_rounds > 0:
        vocab = native.tokenizer.vocab_size
        kernels = native.source.kernels or "MLX qmm"
        runners = {
            f"mlx-infer (native, {kernels})":
                lambda: measure_cost_curve(native.model, args.max_width, vocab, pipelined=False).seconds,
            f"mlx-infer (native, {kernels}, replayed)":
                lambda: measure_cost_curve(native.model, args.max_width, vocab, pipelined=False,
                                           compiled=native.spec.forward()).seconds,
            "mlx-infer (float32)": lambda: measure_cost_curve(fast.model, args.max_width, vocab, pipelined=False).seconds,
        }
        peer = llama_cpp_curve(native.source.path, args.max_width) if native.source.kind in ("gguf", "default") else None
        if peer is not None:
            runners["llama.cpp"] = peer
        curves = cost_curves(runners, args.curve_rounds)
        widths = [w for w in (1, 2, 4, 9, 16) if w <= args.max_width]
        print(f"\nverify cost: ms per forward of w tokens over a {COST_CONTEXT}-token cache (median of "
              f"{args.curve_rounds} rounds, each the fastest of {COST_REPEATS}); (xN) = against width 1")
        print(f"{'path':<42}" + "".join(f"{'w' + str(w):>15}" for w in widths))
        for name, secs in curves.items():
            print(f"{name:<42}" + "".join(f"{secs[w] * 1e3:>8.1f} ({secs[w] / secs[1]:.2f}x)" for w in widths))
    path = write_result("decode", {"machine": info, "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens,
                                   "trials": args.trials, "rows": rows, "raw": results,
                                   "cost_context": COST_CONTEXT, "cost_curve_rounds": args.curve_rounds,
                                   "cost_curves_s": {n: {str(w): s for w, s in c.items()} for n, c in curves.items()}})
    png = plot_curves(curves, path.with_suffix(".png"), f"{native.source.path.name}; {info['cpus']} CPUs, MLX {info['mlx']} ({info['backend']}), kernels "
                      f"{native.source.kernels or 'none'}") if curves else None
    print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
