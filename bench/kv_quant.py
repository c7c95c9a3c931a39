"""Quantized KV cache: KV bytes per token, peak memory, TTFT and decode tokens/s against the context length, in
one run, interleaved.

Rows (the default model, its weights as the engine loads them by default: Q4_1 on mlx-infer's CPU kernels;
greedy; the prompt is token ids of wikitext-2 test, passed directly, no chat template):
  float           mlx-infer's Engine, float KV (mlx-lm's KVCache; the model's float32 activations)
  8, 4, k8v4      Engine.configure_kv(kv_bits=...): the affine scheme (K and V per token, groups of 64 along
                  head_dim), quantized from the first token (kv_quant_start 0); attention reads the packed
                  K/V through the fused kernel
  kivi-4          kv_scheme="kivi" (keys per channel, values per token, the last 64 tokens in float)
  mlx-lm-8/-4     mlx-lm's own path on the same loaded model (`engine.model`, so the weights run on the same
                  kernels): mlx_lm.generate.generate_step(kv_bits=8/4, kv_group_size=64,
                  quantized_kv_start=0), i.e. its QuantizedKVCache (the first prefill chunk of up to 2048
                  tokens runs on float KV, then the cache is converted) and mx.fast.quantized attention
  mlx-lm-float    (not in the default --settings) generate_step without kv_bits: mlx-lm's loop, float KV
  llama.cpp f16 / q8_0 / q4_0
                  llama-cpp-python on the same GGUF (-ctk/-ctv f16, q8_0, q4_0; flash attention on, which
                  llama.cpp needs for a quantized V cache), as many threads as cores, when it is installed;
                  else a line says so. Its KV bytes per token are computed from the ggml block sizes (f16 2
                  bytes, q8_0 34 per 32 values, q4_0 18 per 32), its peak memory is not measured.
Every run starts from an empty cache (Engine.reset(); llama.cpp: Llama.reset()), so TTFT is a whole prefill.
KV bytes per token: over all layers, K and V with their scales and biases (mlx-infer: GenerationStats
.kv_bytes_per_token, packed tokens; mlx-lm: the cache's arrays / their capacity). Peak memory: MLX's peak
(mx.get_peak_memory after mx.reset_peak_memory; the weights included) during the request. "same": the
fraction of generated tokens equal to the float row's at that context, position by position (llama.cpp's
rows: to its own f16 row).

    python bench/kv_quant.py                                      # 512 and 2k, 2 trials: ~12 min on 2 cores
    python bench/kv_quant.py --contexts 512,2048,4096,8192 --trials 3   # the long run: ~4 h on 2 cores
                                        # (a 4k prefill takes ~100 s, an 8k one ~5 min, per row and trial)
    python bench/kv_quant.py --contexts 4096 --trials 1 --settings float,8,kivi-4 --no-llama-cpp

A context of c tokens is a prompt of c tokens (at most the model's window less --max-tokens + 1). Prints one
table per context, writes bench/results/kv_quant-*.json and a PNG next to it (decode tokens/s against the
context, one line per setting). The machine may be shared: single numbers are indicative, ratios within a
trial less so affected (interleaved: every setting once per trial, in turn).
"""

import argparse
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
from common import (interleaved, machine, machine_line, median, positive_ints, pyplot, time_tokens,  # noqa: E402
                    wikitext_text, write_result)
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

DEFAULT_SETTINGS = "float,8,4,k8v4,kivi-4,mlx-lm-8,mlx-lm-4"
#: llama.cpp KV types: (ggml type id in llama_cpp, bytes per value).
LLAMA_TYPES = {"f16": ("GGML_TYPE_F16", 2.0), "q8_0": ("GGML_TYPE_Q8_0", 34 / 32), "q4_0": ("GGML_TYPE_Q4_0", 18 / 32)}


def engine_kv(setting: str) -> dict:
    """configure_kv keywords of an engine setting: float, 8, 4, k8v4, kivi-4, kivi-8, kivi-k8v4."""
    if setting == "float":
        return {"kv_bits": None}
    if setting.startswith("kivi-"):
        return {"kv_bits": setting[5:], "kv_scheme": "kivi"}
    return {"kv_bits": setting}


def engine_runner(engine, setting: str, ids: List[int], max_tokens: int) -> Callable[[], dict]:
    options = engine_kv(setting)

    def run():
        engine.configure_kv(**options)  # also resets: a whole prefill every time
        r = engine.generate(ids, max_tokens=max_tokens, temperature=0)
        engine.reset()
        s = r.stats
        return {"ttft_s": s.ttft_s, "decode_tps": s.decode_tps, "tokens": s.generated_tokens,
                "peak_memory_bytes": s.peak_memory_bytes, "kv_bytes_per_token": s.kv_bytes_per_token,
                "token_ids": list(r.token_ids)}

    return run


def cache_bytes_per_token(cache: list) -> float:
    """KV bytes per token of mlx-lm caches (KVCache, QuantizedKVCache): each layer's K/V arrays (packed
    values, scales, biases) over their capacity along the token axis."""
    total = 0.0
    for c in cache:
        leaves = [a for _, a in tree_flatten((c.keys, c.values))] if getattr(c, "keys", None) is not None else []
        if leaves:
            total += sum(a.nbytes for a in leaves) / leaves[0].shape[2]
    return total


def mlx_lm_runner(model, ids: List[int], max_tokens: int, bits: Optional[int]) -> Callable[[], dict]:
    prompt = mx.array(ids, mx.int32)

    def run():
        mx.reset_peak_memory()
        cache = make_prompt_cache(model)
        token_ids = []

        def tokens():
            for token, _ in generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=cache, kv_bits=bits,
                                          kv_group_size=64, quantized_kv_start=0):
                token_ids.append(int(token))
                yield token

        out = time_tokens(tokens())
        out.update(peak_memory_bytes=int(mx.get_peak_memory()), kv_bytes_per_token=cache_bytes_per_token(cache),
                   token_ids=token_ids)
        return out

    return run


def llama_cpp_runner(llm, ids: List[int], max_tokens: int, bytes_per_token: float) -> Callable[[], dict]:
    def run():
        llm.reset()  # no reuse of the previous prompt: a whole prefill
        token_ids = []

        def tokens():
            for t in itertools.islice(llm.generate(ids, temp=0.0, top_k=1, reset=True), max_tokens):
                token_ids.append(int(t))
                yield t

        out = time_tokens(tokens())
        out.update(peak_memory_bytes=None, kv_bytes_per_token=bytes_per_token, token_ids=token_ids)
        return out

    return run


def llama_cpp_models(gguf: Path, n_ctx: int, kinds: List[str]):
    """{kind: Llama} with that KV type for K and V, or (None, why) when llama-cpp-python is missing."""
    try:
        import llama_cpp
    except ImportError:
        return None, "llama-cpp-python is not installed (pip install llama-cpp-python): no llama.cpp rows"
    out = {}
    for kind in kinds:
        t = getattr(llama_cpp, LLAMA_TYPES[kind][0])
        out[kind] = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=os.cpu_count(),
                                    n_threads_batch=os.cpu_count(), n_batch=512, type_k=t, type_v=t,
                                    flash_attn=True, verbose=False)
    return out, f"llama-cpp-python {llama_cpp.__version__}"


def kv_values_per_token(model) -> int:
    """K and V values one token adds over all full-attention layers (n_layers * n_kv_heads * (D + Dv))."""
    cache = make_prompt_cache(model)
    attn = model.layers[0].self_attn
    n_kv = attn.n_kv_heads
    head_dim = getattr(attn, "head_dim", None) or model.args.hidden_size // model.args.num_attention_heads
    return len(cache) * n_kv * 2 * head_dim


def plot(rows: List[dict], path: Path) -> Optional[Path]:
    plt = pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in dict.fromkeys(r["setting"] for r in rows):
        pts = sorted((r["context"], r["decode_tps"]) for r in rows if r["setting"] == name)
        style = "--" if name.startswith("llama.cpp") else ("-." if name.startswith("mlx-lm") else "-")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=positive_ints, default=[512, 2048], help="prompt lengths (tokens), e.g. 512,2048,4096,8192")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32, help="decode tokens per run")
    ap.add_argument("--settings", default=DEFAULT_SETTINGS,
                    help="float, 8, 4, k8v4, kivi-4, kivi-8 (the engine), mlx-lm-8, mlx-lm-4, mlx-lm-float")
    ap.add_argument("--llama-cpp", default="f16,q8_0,q4_0", help="llama.cpp KV types (-ctk / -ctv)")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--model", default=None, help="GGUF / MLX dir (default: the embedded default model)")
    args = ap.parse_args()

    engine = mlx_infer.load(args.model)
    settings = args.settings.split(",")
    ids_all = list(engine.tokenizer.encode(wikitext_text()[:45 * max(args.contexts)]))
    contexts = [min(c, engine.context_length - args.max_tokens - 1) for c in args.contexts]
    if len(ids_all) < max(contexts):
        raise SystemExit(f"wikitext gave {len(ids_all)} tokens, {max(contexts)} asked for")
    info = machine()
    values = kv_values_per_token(engine.model)

    peers, peer_note = {}, "llama.cpp rows off (--no-llama-cpp)"
    kinds = [k for k in args.llama_cpp.split(",") if k] if not args.no_llama_cpp else []
    if kinds and engine.source.kind in ("gguf", "default"):
        peers, peer_note = llama_cpp_models(engine.source.path, max(contexts) + args.max_tokens + 8, kinds)
        peers = peers or {}
    elif kinds:
        peer_note = "llama.cpp rows need a GGUF model"

    runners: Dict[str, Callable[[], dict]] = {}
    warm: Dict[str, Callable[[], dict]] = {}
    for ctx in contexts:
        ids = ids_all[:ctx]
        for s in settings:
            if s.startswith("mlx-lm-"):
                bits = None if s == "mlx-lm-float" else int(s[len("mlx-lm-"):])
                make = lambda i, n, b=bits: mlx_lm_runner(engine.model, i, n, b)  # noqa: E731
            else:
                make = lambda i, n, s=s: engine_runner(engine, s, i, n)  # noqa: E731
            runners[f"{ctx}|{s}"] = make(ids, args.max_tokens)
            warm.setdefault(s, make(ids_all[:128], 4))
        for kind, llm in peers.items():
            name = f"llama.cpp {kind}"
            runners[f"{ctx}|{name}"] = llama_cpp_runner(llm, ids, args.max_tokens, values * LLAMA_TYPES[kind][1])
            warm.setdefault(name, llama_cpp_runner(llm, ids_all[:128], 4, 0.0))

    print(f"model: {engine.source.name} ({engine.source.kernels or 'MLX ops'}); contexts {contexts} prompt tokens; "
          f"{args.max_tokens} decode tokens; median of {args.trials} interleaved trials; {peer_note}")
    print(machine_line(info), flush=True)
    start = time.perf_counter()
    for run in warm.values():  # kernels built / compiled, weights paged in
        run()
    results = {}
    for trial in range(args.trials):
        for name, trials in interleaved(runners, 1).items():
            results.setdefault(name, []).extend(trials)
        print(f"  trial {trial + 1}/{args.trials} done ({time.perf_counter() - start:.0f} s)", flush=True)

    rows = []
    for name, trials in results.items():
        ctx, setting = name.split("|")
        ctx = int(ctx)
        ref_name = f"{ctx}|llama.cpp f16" if setting.startswith("llama.cpp") else f"{ctx}|float"
        ref = results.get(ref_name, [{}])[0].get("token_ids")
        got = trials[0]["token_ids"]
        n = min(len(got), len(ref)) if ref else 0
        peak = [t["peak_memory_bytes"] for t in trials if t["peak_memory_bytes"] is not None]
        rows.append({
            "context": ctx, "setting": setting,
            "kv_bytes_per_token": round(trials[0]["kv_bytes_per_token"], 1),
            "kv_mib_at_context": round(trials[0]["kv_bytes_per_token"] * (ctx + args.max_tokens) / 2**20, 2),
            "peak_memory_mib": round(max(peak) / 2**20, 1) if peak else None,
            "ttft_s": round(median(trials, "ttft_s"), 3), "prefill_tps": round(ctx / median(trials, "ttft_s"), 1),
            "decode_tps": round(median(trials, "decode_tps"), 2), "tokens": trials[0]["tokens"],
            "same_as_ref": round(sum(a == b for a, b in zip(got, ref)) / n, 3) if n else None,
        })
    wall = time.perf_counter() - start
    for ctx in contexts:
        part = [r for r in rows if r["context"] == ctx]
        base = next((r for r in part if r["setting"] == "float"), None)
        print(f"context {ctx}:")
        print(f"  {'KV':<16}{'B/token':>9}{'KV MiB':>8}{'peak MiB':>10}{'TTFT s':>9}{'prefill/s':>11}"
              f"{'decode/s':>10}{'vs float':>10}{'same':>7}")
        for r in part:
            ratio = f"{r['decode_tps'] / base['decode_tps']:.2f}x" if base and base["decode_tps"] else "-"
            peak = f"{r['peak_memory_mib']:.0f}" if r["peak_memory_mib"] is not None else "-"
            same = f"{r['same_as_ref']:.2f}" if r["same_as_ref"] is not None else "-"
            print(f"  {r['setting']:<16}{r['kv_bytes_per_token']:>9.0f}{r['kv_mib_at_context']:>8.1f}{peak:>10}"
                  f"{r['ttft_s']:>9.2f}{r['prefill_tps']:>11.1f}{r['decode_tps']:>10.1f}{ratio:>10}{same:>7}")
    print(f"(B/token: KV bytes per token over all layers; KV MiB: that times the context + decode tokens; same: "
          f"greedy tokens equal to float's (llama.cpp: to its f16 row); {wall:.0f} s)")
    for r in results.values():
        for t in r:
            t.pop("token_ids", None)
    path = write_result("kv_quant", {"machine": info, "command": " ".join(sys.argv), "model": engine.source.name,
                                     "kernels": engine.source.kernels, "contexts": contexts,
                                     "max_tokens": args.max_tokens, "trials": args.trials, "peer": peer_note,
                                     "wall_s": round(wall, 1), "rows": rows, "raw": results})
    print("wrote", path)
    png = plot(rows, path.with_suffix(".png"))
    if png is not None:
        print("wrote", png)


if __name__ == "__main__":
    main()
