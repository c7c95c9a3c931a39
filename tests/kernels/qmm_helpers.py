"""Operands and oracles of the CPU kernel tests: random weights in MLX's affine layout, the float32 product
computed by mx from the same operands, and the size of its terms (the scale of accumulation error); the
operations a graph holds; and the runner of checks under another instruction-set variant."""

import io
import os
import re
import subprocess
import sys

import mlx.core as mx
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


def run_in_variant(script: str, variant: str, tmp_path) -> None:
    """Run `script` (Python source; argv: this folder, the variant) in a fresh process with
    MLX_INFER_KERNEL_ISA=variant (the variant is chosen once per process) and assert it exits 0. Skips
    "avx2" on a CPU without AVX2 + FMA or off x86-64."""
    if variant == "avx2" and not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    if variant == "avx2" and not os.uname().machine.startswith("x86"):
        pytest.skip("AVX2 is x86-64 only")
    path = tmp_path / "check.py"
    path.write_text(script)
    env = dict(os.environ, MLX_INFER_KERNEL_ISA=variant)
    done = subprocess.run([sys.executable, str(path), os.path.dirname(__file__), variant], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
