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
Every mlx-infer run starts from an empty KV cache (`reset()`), so TTFT is a whole prefill; llama-cpp-python
keeps the evaluated prompt between calls, so its TTFT after the first trial is not comparable.

Usage: python bench/decode.py [--model PATH] [--trials 5] [--max-tokens 64]
Prints a table and writes bench/results/decode-*.json.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
from common import interleaved, machine, machine_line, median, time_tokens, write_result  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_map_with_path  # noqa: E402
from mlx_lm import load as mlx_lm_load, stream_generate  # noqa: E402

from mlx_infer.kernels.rms_norm import KernelRMSNorm  # noqa: E402
from mlx_infer.kernels.rope import KernelRoPE  # noqa: E402

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
    """`model` (in place) with mlx-infer's RMSNorm / RoPE kernel layers swapped back for mlx.nn's own (same
    weights); the quantized products stay on the kernel."""
    def swap(_, m):
        if isinstance(m, KernelRMSNorm):
            plain = nn.RMSNorm(m.weight.shape[0], eps=m.eps)
            plain.weight = m.weight
            return plain
        if isinstance(m, KernelRoPE):
            return nn.RoPE(m.dims, traditional=m.traditional, base=m.base, scale=m.scale)
        return m

    model.update_modules(tree_map_with_path(swap, model.leaf_modules(), is_leaf=nn.Module.is_module))
    return model


def llama_cpp_runner(gguf_path, prompt, max_tokens):
    """llama.cpp through llama-cpp-python (None when it is not installed)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(gguf_path), n_ctx=2048, n_threads=os.cpu_count(), verbose=False)

    def run():
        messages = [{"role": "user", "content": prompt}]
        return time_tokens(llm.create_chat_completion(messages, max_tokens=max_tokens, temperature=0.0, stream=True))

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF / MLX dir / repo id (default: the embedded default model)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
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
        peer = llama_cpp_runner(native.source.path, PROMPT, args.max_tokens)
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
    print(f"{'path':<42}{'TTFT s':>9}{'prefill tok/s':>15}{'decode tok/s':>14}{'vs mlx-lm':>11}")
    for r in rows:
        ratio = f"{r['decode_vs_mlx_lm']:.2f}x" if r["decode_vs_mlx_lm"] else "-"
        print(f"{r['name']:<42}{r['ttft_s']:>9.3f}{r['prefill_tps']:>15.1f}{r['decode_tps']:>14.1f}{ratio:>11}")
    path = write_result("decode", {"machine": info, "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens,
                                   "trials": args.trials, "rows": rows, "raw": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
