"""Oracles of quantized K/V rows for the tests: MLX's affine round trip of each row, optionally in the
Hadamard basis (built here in NumPy, independently of mlx_infer/kv/rotation.py)."""

import mlx.core as mx
import numpy as np


def sylvester(n):
    """The normalized Sylvester Hadamard matrix [n, n] float32, built in NumPy."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array((h / np.sqrt(n)).astype(np.float32))


def in_groups(x, h):
    """Each group of h.shape[0] values along x's last axis times h."""
    g = h.shape[0]
    return (x.reshape(*x.shape[:-1], -1, g) @ h).reshape(x.shape)


def round_trip(x, bits, gs=64, rotated=False, chunks=None):
    """MLX's affine round trip of rows x [..., dim] as float32: float16, mx.quantize (float16 scales and
    biases), mx.dequantize with them in float32; rotated: each group of gs values multiplied by the
    Hadamard matrix before quantizing and after dequantizing (the matrix is its own inverse).

    chunks: (start, stop) ranges along axis -2 rotated one product each before quantizing, as a cache fed
    those chunks rotates them (a float32 product's last bit can depend on its shape: OpenBLAS's Haswell
    kernels round some rows of a 100-row product unlike the same rows of a 300-row one, which moves a
    value across a quantization step); None: one product."""
    h = sylvester(gs) if rotated else None
    if rotated:
        x = x.astype(mx.float32)
        parts = [x[..., a:b, :] for a, b in chunks] if chunks else [x]
        x = mx.concatenate([in_groups(p, h) for p in parts], axis=-2)
    w, s, b = mx.quantize(x.astype(mx.float16), group_size=gs, bits=bits)
    y = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
    return in_groups(y, h) if rotated else y
