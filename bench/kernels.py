"""The quantized skinny matmul (mlx_infer.kernels.qmm) against its references, and the default model's
decode step and verify forward with the kernels on, in one run, interleaved.

Part 1, the kernel, rows 1..16, the default model's shapes (K x N: 576x576, 576x192, 576x1536, 1536x576
at 4 bits and the tied lm_head 576x49152 at 8 bits, as stored; group 32), on the default device:
  kernel      qmm() on what qmm_backend() names (the CPU extension here)
  reference   the pure-mx oracle: x @ mx.dequantize(w, scales, biases).T (float32 BLAS matmul)
  mlx         MLX's built-in mx.quantized_matmul(..., transpose=True)
microseconds per call (median, and minimum, of --repeats batches, each the mean over a batch of calls;
on a shared machine the minimum is the closer estimate of the unloaded cost), GB/s of weight bytes
read (packed weights + scales + biases) and that as a fraction of this machine's memory bandwidth,
measured first (a large copy and a large read, on 1 and 2 threads; the best is the reference).

Part 2, the default model (SmolLM2-135M Q4_1): one decode step (width 1, and a pipelined plain step as
mlx-lm's generate_step runs it) and a width-9 verify forward, over a 64-token cache, for
  kernels     weights="native" with use_kernels(model)
  float32     weights="float32" (today's CPU fast path)
  native      weights="native" without the kernels (MLX's quantized loop)
interleaved per trial; medians and minima.

Usage: python bench/kernels.py [--repeats 5] [--trials 7] [--skip-kernel] [--skip-model]
Prints tables and writes bench/results/kernels-*.json.
"""

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx_infer  # noqa: E402  (first: preloads the optimized BLAS before mlx.core)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from common import machine, write_result  # noqa: E402
from mlx_infer.kernels import cpu  # noqa: E402
from mlx_infer.kernels.linear import use_kernels  # noqa: E402
from mlx_infer.kernels.qmm import qmm, qmm_backend  # noqa: E402
from mlx_infer.speculative.cost import pipelined_step_seconds  # noqa: E402

#: (K, N, bits) of the default model's quantized products (group 32).
SHAPES = ((576, 576, 4), (576, 192, 4), (576, 1536, 4), (1536, 576, 4), (576, 49152, 8))
GROUP_SIZE = 32
ROWS = tuple(range(1, 17))
#: Bytes of the arrays the bandwidth probe copies / reads (well above the caches).
PROBE_BYTES = 512 * 2**20
#: Target seconds per timed batch of calls.
BATCH_S = 0.05
#: Cache length and verify width of part 2.
CONTEXT = 64
VERIFY_WIDTH = 9


def _best_rate(fn, nbytes: float, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def memory_bandwidth() -> dict:
    """GB/s of a large copy (bytes read + written) and a large read (a sum), on 1 and 2 threads (numpy
    releases the GIL in both)."""
    src = np.ones(PROBE_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    out = {}
    for threads in (1, 2):
        parts = np.array_split(np.arange(src.size), threads)
        bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts]
        with ThreadPoolExecutor(threads) as pool:
            def copy():
                list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))

            def read():
                list(pool.map(lambda b: src[b[0]:b[1]].sum(), bounds))

            out[f"copy_{threads}t_gbs"] = _best_rate(copy, 2 * src.nbytes)
            out[f"read_{threads}t_gbs"] = _best_rate(read, src.nbytes)
    out["best_gbs"] = max(out.values())
    return out


def time_call(fn, repeats: int) -> tuple:
    """(median, min) over `repeats` batches of the mean microseconds per evaluated call."""
    mx.eval(fn())
    start = time.perf_counter()
    mx.eval(fn())
    once = time.perf_counter() - start
    calls = max(1, min(200, int(BATCH_S / max(once, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples), min(samples)


def kernel_table(repeats: int, bandwidth: float) -> list:
    rows = []
    for k, n, bits in SHAPES:
        w_float = mx.random.normal((n, k), key=mx.random.key(k * n))
        w, scales, biases = mx.quantize(w_float, group_size=GROUP_SIZE, bits=bits)
        scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)  # as the GGUF model stores them
        mx.eval(w, scales, biases)
        weight_bytes = w.nbytes + scales.nbytes + biases.nbytes
        for m in ROWS:
            x = mx.random.normal((m, k), key=mx.random.key(m))
            mx.eval(x)
            row = {"K": k, "N": n, "bits": bits, "M": m}
            runs = {
                "kernel": lambda: qmm(x, w, scales, biases, GROUP_SIZE, bits),
                "reference": lambda: x @ mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                                       group_size=GROUP_SIZE, bits=bits).T,
                "mlx": lambda: mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=GROUP_SIZE,
                                                   bits=bits),
            }
            for name, fn in runs.items():
                row[f"{name}_us"], row[f"{name}_min_us"] = time_call(fn, repeats if name == "kernel"
                                                                     else max(1, repeats // 2))
            row["kernel_gbs"] = weight_bytes / row["kernel_us"] / 1e3
            row["kernel_best_gbs"] = weight_bytes / row["kernel_min_us"] / 1e3
            row["kernel_bw_fraction"] = row["kernel_gbs"] / bandwidth
            rows.append(row)
            print(f"K{k:5d} N{n:6d} b{bits} M{m:2d}  kernel {row['kernel_us']:9.1f} us ({row['kernel_min_us']:.1f})"
                  f"  reference {row['reference_us']:9.1f} us  mlx {row['mlx_us']:10.1f} us ({row['mlx_min_us']:.1f})"
                  f"  {row['kernel_gbs']:5.1f} GB/s ({row['kernel_bw_fraction']:.0%}; best {row['kernel_best_gbs']:.1f})",
                  flush=True)
    return rows


def model_timings(trials: int) -> dict:
    """Seconds of a width-1 forward, a pipelined plain step and a width-VERIFY_WIDTH forward per system."""
    systems = {}
    for name, weights in (("kernels", "native"), ("float32", "float32"), ("native", "native")):
        engine = mlx_infer.load(weights=weights)
        if name == "kernels":
            use_kernels(engine.model)
        cache = make_prompt_cache(engine.model)
        mx.eval(engine.model(mx.arange(CONTEXT).reshape(1, -1), cache=cache))
        systems[name] = (engine.model, cache)
    tokens = mx.arange(100, 100 + VERIFY_WIDTH).reshape(1, -1)
    samples = {name: {"w1": [], "w9": [], "plain": []} for name in systems}

    def forward(model, cache, width):
        start = time.perf_counter()
        mx.eval(model(tokens[:, :width], cache=cache))
        elapsed = time.perf_counter() - start
        for c in cache:
            c.trim(width)
        return elapsed

    for trial in range(trials + 1):  # the first trial warms up and is not kept
        for name, (model, cache) in systems.items():
            w1 = min(forward(model, cache, 1) for _ in range(3))
            w9 = min(forward(model, cache, VERIFY_WIDTH) for _ in range(2))
            plain = min(pipelined_step_seconds(model, cache) for _ in range(3)) if name != "native" or trial < 2 else None
            if trial:
                samples[name]["w1"].append(w1)
                samples[name]["w9"].append(w9)
                if plain is not None:
                    samples[name]["plain"].append(plain)
    out = {}
    for name, s in samples.items():
        out[name] = {key: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3}
                     for key, v in s.items() if v}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed batches per kernel cell")
    ap.add_argument("--trials", type=int, default=7, help="interleaved trials of the model timings")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-model", action="store_true")
    args = ap.parse_args()

    backend = qmm_backend()
    info = {"machine": machine(), "qmm_backend": backend, "cpu_kernels": cpu.why_not() or "available",
            "cpu_threads": cpu.num_threads() if cpu.available() else None}
    print(f"qmm backend: {backend}; {info['machine']}", flush=True)
    bandwidth = memory_bandwidth()
    info["bandwidth"] = bandwidth
    print("memory bandwidth: " + ", ".join(f"{k} {v:.1f}" for k, v in bandwidth.items()), flush=True)
    if not args.skip_kernel:
        info["kernel"] = kernel_table(args.repeats, bandwidth["best_gbs"])
    if not args.skip_model:
        timings = model_timings(args.trials)
        info["model"] = timings
        print(f"\ndefault model, {CONTEXT}-token cache, medians (min) over {args.trials} interleaved trials:")
        for name, t in timings.items():
            plain = t.get("plain")
            line = (f"  {name:8s} width 1 {t['w1']['median_ms']:7.1f} ms ({t['w1']['min_ms']:.1f})  "
                    f"width {VERIFY_WIDTH} {t['w9']['median_ms']:7.1f} ms ({t['w9']['min_ms']:.1f})  "
                    f"w{VERIFY_WIDTH}/w1 {t['w9']['median_ms'] / t['w1']['median_ms']:.2f}")
            if plain:
                line += f"  decode {1e3 / plain['median_ms']:6.1f} tok/s ({1e3 / plain['min_ms']:.1f} best)"
            print(line)
        k, f = timings["kernels"], timings["float32"]
        print(f"  kernels / float32 decode: {f['plain']['median_ms'] / k['plain']['median_ms']:.2f}x")
    print(f"wrote {write_result('kernels', info)}")


if __name__ == "__main__":
    main()
