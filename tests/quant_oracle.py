"""Oracles of quantized K/V rows for the tests: MLX's affine round trip of each row, optionally in the
Hadamard basis (the matrix built here in NumPy and the rotation done by MLX's primitive, independently of
mlx_infer/kv/rotation.py)."""

import mlx.core as mx
import numpy as np


def sylvester(n):
    """The normalized Sylvester Hadamard matrix [n, n] float32, built in NumPy."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array((h / np.sqrt(n)).astype(np.float32))


def round_trip(x, bits, gs=64, rotated=False):
    """MLX's affine round trip of rows x [..., dim] as float32: float16, mx.quantize (float16 scales and
    biases), mx.dequantize with them in float32; rotated: each group of gs values multiplied by the
    Hadamard matrix before quantizing and after dequantizing (the matrix is its own inverse), by MLX's fast
    Walsh-Hadamard transform, which computes each row alone (a float32 matmul by the matrix rounds a row
    differently by the product's shape under OpenBLAS, which can move a value across a quantization step)."""
    def rotate(a):
        return mx.hadamard_transform(a.reshape(*a.shape[:-1], -1, gs), scale=gs ** -0.5).reshape(a.shape)

    if rotated:
        x = rotate(x.astype(mx.float32))
    w, s, b = mx.quantize(x.astype(mx.float16), group_size=gs, bits=bits)
    y = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
    return rotate(y) if rotated else y
