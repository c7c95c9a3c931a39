"""The CUDA twin of the quantized skinny matmul on an NVIDIA GPU, without MLX: CuPy launches the source in the
form `mx.fast.cuda_kernel` builds it (MLX's default header, cuda_kernels/metal_prelude.cuh as the kernel's
header, the Metal body metal_kernels/qmm.metal in a __global__ function of mlx::core::cu with MLX's
signature and template constants), checks it against a float64 numpy reference and times rows 1..16 at the
default model's shapes (SmolLM2-135M: K x N = 576x576, 576x192, 576x1536, 1536x576, 576x49152).

    python bench/gpu_qmm_device.py [--dtype float16|float32|bfloat16] [--bits 4] [--group-size 32]
        [--iters 200] [--json out.json]

Prints one line per (shape, rows): microseconds per call (CUDA events, mean over --iters after a warm-up)
and GB/s of weight + scale/bias bytes read. Needs numpy and CuPy only. Launch parameters as
mlx_infer/kernels/gpu_qmm.py (4 SIMD groups of 32 threads, 4 columns each).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import cupy as cp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
SIMD_GROUPS, COLUMNS, WIDTH = 4, 4, 32
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
CUDA_TYPE = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
MLX_NAME = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t"}
EPS = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def source(dtype, rows, k, n, gs, bits):
    """(full kernel name, CUDA source) as MLX 0.32's cuda custom_kernel build_kernel writes them."""
    template = [("T", dtype), ("M", rows), ("BITS", bits), ("GS", gs), ("K", k), ("N", n), ("NSG", SIMD_GROUPS),
                ("COLS", COLUMNS)]
    name = "custom_kernel_mlx_infer_qmm" + "".join(
        f"_{MLX_NAME[v]}" if isinstance(v, str) else f"_{v}" for _, v in template)
    consts = "".join(f"  using {c} = {CUDA_TYPE[v]};\n" if isinstance(v, str) else f"  constexpr int {c} = {v};\n"
                     for c, v in template)
    t = CUDA_TYPE[dtype]
    src = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
           "#define inf cuda::std::numeric_limits<float>::infinity()\n\n"
           + (REPO / "cuda_kernels" / "metal_prelude.cuh").read_text()
           + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
           f"__global__ void {name}(\n    const {t}* x,\n    const uint32_t* w,\n    const {t}* scales,\n"
           f"    const {t}* biases,\n    {t}* y) {{\n" + consts + "\n"
           + (REPO / "metal_kernels" / "qmm.metal").read_text() + "\n}\n\n} // namespace mlx::core::cu\n")
    return "mlx::core::cu::" + name, src


def compile_kernel(dtype, rows, k, n, gs, bits):
    name, src = source(dtype, rows, k, n, gs, bits)
    opts = ["-std=c++17", f"-I{REPO / 'cuda_kernels' / 'host'}"]
    cuda_home = os.environ.get("CUDA_PATH") or os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    if Path(cuda_home, "include").is_dir():
        opts.append(f"-I{Path(cuda_home, 'include')}")
    try:
        mod = cp.RawModule(code=src, options=tuple(opts), name_expressions=[name])
        return mod.get_function(name)
    except Exception as nvrtc_error:  # NVRTC without the toolkit's headers: try nvcc if there is one
        if not Path(cuda_home, "bin", "nvcc").exists():
            raise
        print(f"nvrtc failed ({str(nvrtc_error).splitlines()[0]}); using nvcc", file=sys.stderr)
        mod = cp.RawModule(code=src, options=tuple(opts), name_expressions=[name], backend="nvcc")
        return mod.get_function(name)


def to_dtype(a, dtype):
    """float32 numpy -> device array of dtype (bfloat16 as uint16 bits, rounded to nearest even), and the
    float64 values it holds."""
    a = a.astype(np.float32)
    if dtype == "bfloat16":
        u = a.view(np.uint32)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return cp.asarray(bits), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    held = a.astype(dtype)
    return cp.asarray(held), held.astype(np.float64)


def from_device(y, dtype):
    y = cp.asnumpy(y)
    if dtype == "bfloat16":
        return (y.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return y.astype(np.float64)


def run(dtype, rows, k, n, gs, bits, iters, rng):
    per_word = 32 // bits
    words = rng.integers(0, 2 ** 32, size=(n, k // per_word), dtype=np.uint64).astype(np.uint32)
    s_dev, s = to_dtype(rng.uniform(-0.05, 0.05, (n, k // gs)), dtype)
    b_dev, b = to_dtype(rng.uniform(-0.5, 0.5, (n, k // gs)), dtype)
    x_dev, x = to_dtype(rng.standard_normal((rows, k)), dtype)
    q = ((words[:, :, None] >> (bits * np.arange(per_word, dtype=np.uint32))) & ((1 << bits) - 1)).reshape(n, k)
    wf = q * np.repeat(s, gs, axis=1) + np.repeat(b, gs, axis=1)   # [N, K] float64
    ref, bound = x @ wf.T, np.abs(x) @ np.abs(wf).T                # [M, N]
    w_dev = cp.asarray(words)
    y = cp.empty((rows, n), dtype=np.uint16 if dtype == "bfloat16" else dtype)
    kernel = compile_kernel(dtype, rows, k, n, gs, bits)
    blocks = (-(-n // (SIMD_GROUPS * COLUMNS)), 1, 1)
    threads = (SIMD_GROUPS * WIDTH, 1, 1)
    args = (x_dev, w_dev, s_dev, b_dev, y)
    kernel(blocks, threads, args)
    cp.cuda.Device().synchronize()
    err = np.abs(from_device(y, dtype) - ref)
    allowed = (1 + EPS[dtype]) * 1e-5 * bound + EPS[dtype] * np.abs(ref) + 2.0 ** -25
    ok = bool((err <= allowed).all())
    for _ in range(10):
        kernel(blocks, threads, args)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        kernel(blocks, threads, args)
    stop.record()
    stop.synchronize()
    us = cp.cuda.get_elapsed_time(start, stop) * 1000.0 / iters
    nbytes = words.nbytes + 2 * s_dev.nbytes
    return {"dtype": dtype, "bits": bits, "group_size": gs, "K": k, "N": n, "rows": rows, "us": us,
            "weight_GBps": nbytes / us / 1e3, "ok": ok, "worst_error_over_bound": float(np.max(err / allowed))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float16", choices=sorted(CUDA_TYPE))
    ap.add_argument("--bits", type=int, default=4, choices=(4, 8))
    ap.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128))
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rows", default="1-16", help="a range a-b or a comma list")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = (range(int(a.rows.split("-")[0]), int(a.rows.split("-")[1]) + 1) if "-" in a.rows
            else [int(r) for r in a.rows.split(",")])
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {a.dtype}, bits {a.bits}, "
          f"group {a.group_size}, {a.iters} iters")
    print(f"{'K x N':>12} {'rows':>4} {'us':>9} {'GB/s':>8}  check")
    rng = np.random.default_rng(0)
    results = []
    for k, n in SHAPES:
        if k % a.group_size:
            continue
        for m in rows:
            r = run(a.dtype, m, k, n, a.group_size, a.bits, a.iters, rng)
            results.append(r)
            print(f"{k:>5} x {n:<5} {m:>4} {r['us']:>9.2f} {r['weight_GBps']:>8.1f}  "
                  f"{'ok' if r['ok'] else 'MISMATCH'} ({r['worst_error_over_bound']:.2f} of bound)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
