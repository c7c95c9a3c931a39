"""GGUF tensor data -> MLX arrays.

Q4_0, Q4_1 and Q8_0 blocks are repacked bit for bit into MLX affine-quantized weights (group size
32, the GGML block): no precision is lost. Q5_0 and Q5_1 (32-value blocks) and Q4_K and Q5_K
(32-value sub-blocks with a 6-bit scale and min) are affine per group of 32 too, and are repacked
into MLX 5- / 4- / 5-bit weights with the same integers (K-quant scales d*sc and mins dmin*m rounded
to float16). F32, F16 and BF16 become float arrays. Every other type the `gguf` package can
dequantize (Q2_K, Q3_K, Q6_K (16-value sub-blocks), IQ*) is dequantized with it and re-quantized to
MLX affine weights with at least the source's bits (see REQUANT_BITS).

GGML block layouts follow llama.cpp's `ggml-common.h`.
"""

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from ..defaults import GGML_BLOCK, REQUANT_GROUP_SIZE
from ..errors import UnsupportedModelError

#: MLX bits used when a type is re-quantized (at least the source's bits per weight). Q6_K goes to
#: 8 bits: its 16-value sub-blocks do not fit one 6-bit grid per group of 32 (about 2% RMS error at
#: 6 bits, 0.4% at 8), and it holds the tensors a Q4_K_M file keeps at high precision.
REQUANT_BITS = {
    Q.Q5_0: 5, Q.Q5_1: 5, Q.Q2_K: 3, Q.Q3_K: 4, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 8, Q.Q8_K: 8,
    Q.IQ2_XXS: 3, Q.IQ2_XS: 3, Q.IQ2_S: 3, Q.IQ3_XXS: 4, Q.IQ3_S: 4, Q.IQ1_S: 2, Q.IQ1_M: 2,
    Q.IQ4_NL: 4, Q.IQ4_XS: 4, Q.Q8_1: 8,
}
#: Types repacked exactly (same integers, per-32 affine) into MLX weights of these bits.
REPACK_BITS = {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5}


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints `q` [rows, cols] (values < 2**bits, bits in {4, 8}) into uint32
    words [rows, cols * bits / 32], lowest bits first, as `mx.quantize` lays them out."""
    per_word = 32 // bits
    rows, cols = q.shape
    q = q.reshape(rows, cols // per_word, per_word).astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    return np.bitwise_or.reduce(q << shifts, axis=-1)


def _pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack unsigned ints `q` [rows, cols] (values < 2**bits, any bits MLX supports) as MLX lays
    them out: a little-endian bit stream, value i in bits [i*bits, (i+1)*bits), read as uint32
    words [rows, cols * bits / 32]."""
    rows, cols = q.shape
    shifts = np.arange(bits, dtype=np.uint8)
    stream = ((q.astype(np.uint8)[..., None] >> shifts) & 1).reshape(rows, cols * bits // 8, 8)
    return np.ascontiguousarray(np.packbits(stream, axis=-1, bitorder="little").reshape(rows, -1)).view(np.uint32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of each block [rows, n_blocks, bytes] -> [rows, n_blocks]."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0]


def repack_ggml(data: np.ndarray, qtype: Q, rows: int, cols: int) -> dict:
    """Repack Q4_0 / Q4_1 / Q8_0 blocks into MLX affine-quantized arrays, losslessly.

    Args:
        data: raw blocks, uint8, [rows, cols / 32 * block_bytes].
        qtype: Q4_0, Q4_1 or Q8_0.
        rows, cols: the weight's logical shape (output features, input features).

    Returns:
        {"weight": uint32 [rows, cols*bits/32], "scales": float16 [rows, cols/32],
         "biases": float16 [rows, cols/32]} with w = scales * q + biases per group of 32.
    """
    n_blocks = cols // GGML_BLOCK
    blocks = data.reshape(rows, n_blocks, -1)
    d = _f16(blocks, 0)
    if qtype == Q.Q8_0:
        q = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bits, biases = 8, (d * np.float16(-128)).astype(np.float16)
    else:
        offset = 2 if qtype == Q.Q4_0 else 4
        packed = blocks[..., offset:]
        # A block's first 16 values are the low nibbles of its 16 bytes, the next 16 the high ones.
        q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
        bits = 4
        biases = (d * np.float16(-8)).astype(np.float16) if qtype == Q.Q4_0 else _f16(blocks, 2)
    q = q.reshape(rows, cols)
    return {
        "weight": mx.array(_pack(q, bits)),
        "scales": mx.array(d),
        "biases": mx.array(biases),
    }


def _qh_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """Bits 0..n-1 of little-endian bytes `qh` [..., n/8] -> [..., n] of 0/1 (bit i of the stream)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[..., :n]


def repack_affine32(data: np.ndarray, qtype: Q, rows: int, cols: int) -> dict:
    """Repack Q5_0 / Q5_1 / Q4_K / Q5_K into MLX affine weights with group size 32, keeping the
    file's integers: every 32 consecutive values of these types share one scale and one offset.

    Layouts (llama.cpp ggml-common.h / ggml-quants.c):
      Q5_0 (22 B / 32): d, qh[4], qs[16]; q = nibble | qh bit << 4; w = d * (q - 16).
      Q5_1 (24 B / 32): d, m, qh[4], qs[16]; w = d * q + m.
      Q4_K (144 B / 256): d, dmin, scales[12], qs[128]; 4 chunks of 64 values: low nibbles of 32
        bytes (sub-block 2c), then high nibbles (2c+1); w = d * sc * q - dmin * m.
      Q5_K (176 B / 256): d, dmin, scales[12], qh[32], qs[128]; as Q4_K, the 5th bit of value l
        of sub-block j is bit j of qh[l].
    """
    bits = REPACK_BITS[qtype]
    if qtype in (Q.Q5_0, Q.Q5_1):
        blocks = data.reshape(rows, cols // 32, -1)
        d = _f16(blocks, 0).astype(np.float32)
        off = 2 if qtype == Q.Q5_0 else 4
        qh = _qh_bits(blocks[..., off:off + 4], 32)
        qs = blocks[..., off + 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | (qh << 4)
        scales = d
        biases = d * -16.0 if qtype == Q.Q5_0 else _f16(blocks, 2).astype(np.float32)
    else:
        blocks = data.reshape(rows, cols // 256, -1)
        d = _f16(blocks, 0).astype(np.float32)
        dmin = _f16(blocks, 2).astype(np.float32)
        n = rows * (cols // 256)
        sc, mn = quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(n, 12))
        sc = sc.reshape(rows, cols // 256, 8).astype(np.float32)
        mn = mn.reshape(rows, cols // 256, 8).astype(np.float32)
        qs = blocks[..., -128:].reshape(rows, cols // 256, 4, 1, 32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=3)  # [rows, blocks, chunk, half, 32]
        if qtype == Q.Q5_K:
            qh = _qh_bits(blocks[..., 16:48].reshape(rows, cols // 256, 32, 1), 8)  # [.., l, j]
            q = q | (np.moveaxis(qh, 2, 3).reshape(rows, cols // 256, 4, 2, 32) << 4)
        scales = d[..., None] * sc
        biases = -(dmin[..., None] * mn)
    q = q.reshape(rows, cols)
    return {
        "weight": mx.array(_pack_bits(q, bits)),
        "scales": mx.array(scales.reshape(rows, cols // 32).astype(np.float16)),
        "biases": mx.array(biases.reshape(rows, cols // 32).astype(np.float16)),
    }


def tensor_to_mlx(data: np.ndarray, qtype: Q, shape: tuple, name: str) -> dict:
    """Convert one GGUF tensor to MLX arrays.

    Args:
        data: the tensor's data as `gguf.GGUFReader` maps it (float array, or uint8 blocks).
        qtype: its GGML type.
        shape: its logical shape in numpy order (outermost first), e.g. (rows, cols).
        name: the tensor's GGUF name, for error messages.

    Returns:
        {"weight": array} for float tensors, or {"weight", "scales", "biases"} for quantized ones
        (MLX affine layout, group size 32).

    Raises:
        UnsupportedModelError: a tensor type that neither MLX nor the `gguf` package can read.
    """
    if qtype == Q.F32:
        return {"weight": mx.array(np.asarray(data, dtype=np.float32).reshape(shape))}
    if qtype == Q.F16:
        return {"weight": mx.array(np.asarray(data).view(np.float16).reshape(shape))}
    if qtype == Q.BF16:
        as_u16 = np.ascontiguousarray(data).view(np.uint16).reshape(shape)
        f32 = (as_u16.astype(np.uint32) << 16).view(np.float32)
        return {"weight": mx.array(f32).astype(mx.bfloat16)}
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return repack_ggml(np.asarray(data), qtype, rows, cols)
    if qtype in REPACK_BITS:
        return repack_affine32(np.asarray(data), qtype, rows, cols)
    bits = REQUANT_BITS.get(qtype)
    if bits is None:
        raise UnsupportedModelError(
            f"tensor {name} has GGML type {qtype.name}, which mlx-infer cannot load; "
            f"re-quantize the file to Q8_0, Q4_K_M or F16 with llama.cpp's llama-quantize"
        )
    try:
        dense = quants.dequantize(np.asarray(data), qtype).reshape(rows, cols)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"tensor {name} has GGML type {qtype.name}, which the gguf package cannot dequantize"
        ) from e
    w, scales, biases = mx.quantize(
        mx.array(dense, dtype=mx.float16), group_size=REQUANT_GROUP_SIZE, bits=bits
    )
    return {"weight": w, "scales": scales, "biases": biases}


def permute_rows_for_rope(arrays: dict, n_heads: int) -> dict:
    """Undo llama.cpp's Q/K row permutation of llama-family models.

    llama.cpp's convert script reorders each head's rows from HF's half-split RoPE layout to the
    interleaved one. This reorders them back so that mlx-lm's (non-traditional) RoPE is right.
    Rows are independent in every array of a quantized weight, so weight, scales and biases (and a
    bias vector) are permuted alike.

    Args:
        arrays: {"weight": [rows, ...], optionally "scales", "biases", "bias"}; rows = n_heads * head_dim.
        n_heads: query heads for Q, key/value heads for K.
    """
    out = {}
    for key, a in arrays.items():
        rows = a.shape[0]
        head_dim = rows // n_heads
        rest = a.shape[1:]
        a = a.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2)
        out[key] = a.reshape(rows, *rest)
    return out
