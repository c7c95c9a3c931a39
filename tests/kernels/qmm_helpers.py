"""Operands and oracles of the CPU kernel tests: random weights in MLX's affine layout, the float32 product
computed by mx from the same operands, and the size of its terms (the scale of accumulation error)."""

import mlx.core as mx


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
