"""Hadamard rotation of quantized K/V rows (QuaRot, arXiv 2404.00456; the same idea in QuIP#, arXiv 2402.04396).

Post-RoPE keys have a few channels far larger than the rest, and with per-token groups along head_dim one
such channel sets the scale of its whole group, so 4-bit codes keep little of the other values. Multiplying
each group of `group_size` values by an orthonormal Hadamard matrix H spreads every channel's energy over
the group before quantizing. Attention needs no inverse on the keys, since scores are invariant under an
orthogonal change of basis applied to both sides: (q H)(k H)^T = q k^T. Values are rotated too, and the
attention output, a mix of rotated values, is rotated back: (P V H) H = P V, because the normalized
Sylvester H is symmetric and orthogonal, so H H = I. `rotate` is therefore its own inverse.

Measured on the default model (docs/kv_quant.md): 4-bit K/V's mean KL from float KV falls severalfold at
the same bytes. At 8 bits the codes already keep the large channels and the rotation's effect is within the
noise of perplexity and recall, so by default only 4-bit stores are rotated.
"""

import mlx.core as mx


def rotate(x: mx.array, group_size: int) -> mx.array:
    """x [..., D] with each group of `group_size` consecutive values along the last axis multiplied by the
    normalized Sylvester Hadamard matrix H [group_size, group_size] (symmetric, orthogonal: H H = I),
    computed in float32 and returned in x's dtype. Its own inverse.

    Runs MLX's fast Walsh-Hadamard transform, which computes every row by the same butterflies whatever
    the number of rows, so a token's rotated key is bit-identical in a one-token decode step and in a
    verify forward of several tokens (speculative decoding stays lossless over 4-bit KV). A float32
    matmul by H is not: OpenBLAS rounds a row differently with M = 3 than M = 9.

    Raises:
        ValueError: D is not a multiple of group_size, or group_size is not a power of two.
    """
    D = x.shape[-1]
    if group_size < 1 or group_size & (group_size - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {group_size}")
    if D % group_size:
        raise ValueError(f"rotate: last axis {D} is not a multiple of the group size {group_size}")
    g = x.astype(mx.float32).reshape(*x.shape[:-1], D // group_size, group_size)  # [..., D / g, g]
    return mx.hadamard_transform(g, scale=group_size ** -0.5).reshape(x.shape).astype(x.dtype)


def keys_basis(x: mx.array, quant) -> mx.array:
    """Keys or queries [..., D] moved between the model's basis and the one a quantized cache stores its keys
    in (either way: the rotation is its own inverse): rotated when quant.rotate_k, else x itself.
    quant: a kv.quant_options.KVQuant."""
    return rotate(x, quant.group_size) if quant.rotate_k else x


def values_basis(x: mx.array, quant) -> mx.array:
    """Values, or an attention output over them, [..., Dv] moved between the model's basis and the one a
    quantized cache stores its values in: rotated when quant.rotate_v, else x itself."""
    return rotate(x, quant.group_size) if quant.rotate_v else x
