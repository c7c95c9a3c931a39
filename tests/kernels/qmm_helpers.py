"""Operands and oracles of the CPU kernel tests: random weights in MLX's affine layout, the float32 product
computed by mx from the same operands, and the size of its terms (the scale of accumulation error); the
operations a graph holds; and the runner of checks under another instruction-set variant."""

import io
import os
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.blas import cpu_flags


def ops_in_graph(out: mx.array) -> list:
    """The operations between `out` and its evaluated inputs (names, from MLX's DOT export)."""
    f = io.StringIO()
    mx.export_to_dot(f, out)
    return [label.split()[0] for label in re.findall(r'label ?="([^"]+)"', f.getvalue())]


def quantized(n: int, k: int, group_size: int, bits: int, dtype=mx.float32, seed: int = 0):
    """(w [N, K*bits/32] uint32, scales [N, K/gs], biases [N, K/gs]) of a random normal weight, scales and
    biases cast to `dtype`."""
    weight = mx.random.normal((n, k), key=mx.random.key(seed))
    w, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def oracle(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """x @ dequantize(w).T computed by mx in float32 from the same operands: [M, N] float32."""
    wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return x.astype(mx.float32) @ wf.T


def magnitude(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """|x| @ |W|.T [M, N]: the scale of float32 accumulation error of each output (sum of |terms|)."""
    wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    return mx.abs(x.astype(mx.float32)) @ mx.abs(wf).T


def int8_oracle(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                bits: int) -> mx.array:
    """The int8-activation product computed by numpy (float64 sums) from the same operands: each row of x
    rounded in chunks of 32 to xq = rint(x * (127 / max|x|)) (float32 arithmetic, ties to even), scale
    dx = max|x| / 127; y = sum_chunks d * dx * (q . xq) + sum_groups b * (sum of x over the group). [M, N]."""
    xf = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])
    m, k = xf.shape
    chunks = xf.reshape(m, k // 32, 32)
    amax = np.abs(chunks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = np.rint((chunks * inv).astype(np.float32)).reshape(m, k).astype(np.float64)
    dx = np.repeat((amax[..., 0] / np.float32(127)).astype(np.float32), 32, axis=1).astype(np.float64)
    s = np.repeat(np.array(scales.astype(mx.float32)), group_size, axis=1).astype(np.float64)
    b = np.array(biases.astype(mx.float32)).astype(np.float64)
    q = np.array(mx.dequantize(w, mx.ones(scales.shape), mx.zeros(biases.shape), group_size=group_size,
                               bits=bits)).astype(np.float64)  # the codes 0..2^bits - 1
    xs = xf.astype(np.float64).reshape(m, k // group_size, group_size).sum(-1)  # [M, G]
    return mx.array(((xq * dx) @ (q * s).T + xs @ b.T).astype(np.float32))


def int8_bound(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
               bits: int) -> mx.array:
    """The most that rounding x to int8 in chunks of 32 can move each output: sum_k |d q_k| * dx / 2, dx
    = max|x| / 127 of k's chunk. [M, N] float32."""
    xf = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1])
    m, k = xf.shape
    dx = np.repeat(np.abs(xf.reshape(m, k // 32, 32)).max(-1) / 127.0, 32, axis=1)
    q = np.array(mx.dequantize(w, mx.ones(scales.shape), mx.zeros(biases.shape), group_size=group_size,
                               bits=bits))
    s = np.repeat(np.abs(np.array(scales.astype(mx.float32))), group_size, axis=1)
    return mx.array((dx / 2) @ (q * s).T)


def run_in_variant(script: str, variant: str, tmp_path) -> None:
    """Run `script` (Python source; argv: this folder, the variant) in a fresh process with
    MLX_INFER_KERNEL_ISA=variant (the variant is chosen once per process) and assert it exits 0. Skips
    "avx512*" on a CPU without AVX-512 (F, BW, DQ, VL), "avx512vnni" without VNNI, "avx2*" without AVX2 +
    FMA, any "avx*" off x86-64."""
    if variant.startswith("avx") and not os.uname().machine.startswith("x86"):
        pytest.skip("AVX is x86-64 only")
    if variant.startswith("avx512") and not {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    if variant == "avx512vnni" and "avx512_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI")
    if variant.startswith("avx2") and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    path = tmp_path / "check.py"
    path.write_text(script)
    env = dict(os.environ, MLX_INFER_KERNEL_ISA=variant)
    done = subprocess.run([sys.executable, str(path), os.path.dirname(__file__), variant], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
