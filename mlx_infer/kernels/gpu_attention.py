"""Attention over a quantized KV cache on the GPU: one Metal body (metal_kernels/quant_attention.metal), run by
`mx.fast.metal_kernel` on Apple GPUs and, through cuda_kernels/metal_prelude.cuh, by `mx.fast.cuda_kernel` on
NVIDIA GPUs; the GPU twin of mlx_infer.kernels.attention.quant_attention (same arguments, same result as its
oracle reference_quant_attention).

    out = metal_quant_attention(q, (k, k_scales, k_biases), (v, v_scales, v_biases), length=S,
                                scale=D ** -0.5, positions=P, group_size=64)      # [n_kv, R, Dv]

q [n_kv, R, D] float32 / float16 / bfloat16, R = n_rep * P <= 16 rows (row r is query position r % P);
k [n_kv, C, D * k_bits / 32] uint32, k_scales / k_biases [n_kv, C, D / group_size] (MLX's affine layout along
head_dim, one row per token; float16 or q's dtype), values likewise with their own bits and Dv; C >= S cache
rows, the first S valid. out[h, r] = softmax(scale * q[h, r] . k[h, s]) v[h, s] over s <= S - P + r % P, in
float32, returned in q's dtype. Head dims 64, 128, 256; bits 4 / 8 (K and V independently); group sizes 32, 64,
128.

Flash-decoding (arXiv 2307.08691): the grid is (splits, KV heads); each threadgroup reads every packed K / V row
of its split once for all R rows of the head (the GQA group times the verify width), dequantizes it in
registers, keeps an online softmax, and writes per-split partials (running max, sum, unnormalized output);
`merge_partials` (mx ops) combines them. The length S and the scale are kernel inputs, not template
constants, so one compiled kernel serves every decode step of a shape.
"""

from dataclasses import dataclass
from functools import lru_cache
from numbers import Integral
from typing import Optional, Tuple

import mlx.core as mx

from mlx_infer.errors import MlxInferError
from mlx_infer.kernels.gpu_qmm import (SIMD_WIDTH, cuda_available, kernel_source_path, make_cuda_kernel,
                                       make_metal_kernel, metal_available)

Packed = Tuple[mx.array, mx.array, mx.array]

#: Most query rows per KV head the GPU kernel takes (n_rep * positions).
ATTN_GPU_MAX_ROWS = 16
#: Head dims (of K and of V, independently), bit widths and group sizes the kernel supports.
ATTN_HEAD_DIMS = (64, 128, 256)
ATTN_BITS = (4, 8)
ATTN_GROUP_SIZES = (32, 64, 128)
#: Query dtypes; the scales and biases are float16 or q's dtype (all four the same).
ATTN_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
#: SIMD groups per threadgroup, and keys per tile (the body's BK: one key per lane of a SIMD group).
ATTN_SIMD_GROUPS = 4
ATTN_TILE = 32
#: Split heuristic: aim for this many threadgroups in all, but give each split at least ATTN_MIN_SPLIT keys.
ATTN_TARGET_THREADGROUPS = 256
ATTN_MIN_SPLIT = 256

#: The kernel's name and argument names, as the body spells them.
ATTN_KERNEL_NAME = "mlx_infer_quant_attention"
ATTN_INPUT_NAMES = ("q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases", "lengths", "softmax_scale")
ATTN_OUTPUT_NAMES = ("part_m", "part_l", "part_acc")

#: Where the Metal body lives, and its text (None when the package was installed without its kernel sources).
ATTN_METAL_PATH = kernel_source_path("metal_kernels", "quant_attention.metal")
ATTN_METAL_BODY = ATTN_METAL_PATH.read_text() if ATTN_METAL_PATH is not None else None

__all__ = ["ATTN_GPU_MAX_ROWS", "AttentionLaunch", "attention_launch", "cuda_quant_attention", "merge_partials",
           "launch_kernel", "metal_call", "metal_partials", "metal_quant_attention"]


@dataclass(frozen=True)
class AttentionLaunch:
    """How one call launches: template constants (in the order MLX writes them), grid (counted in THREADS, as
    mx.fast.*_kernel want) and threadgroup size, the split (length in keys, a multiple of ATTN_TILE, and
    count), the kernel's data inputs `lengths` (int32 [S, C, split length, splits]) and `softmax_scale`
    (float32 [1]), and the shapes of its float32 outputs part_m, part_l [n_kv, splits, R] and part_acc
    [n_kv, splits, R, Dv], and output_dtype, the dtype of the merged result (q's)."""

    template: Tuple[Tuple[str, object], ...]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    split_length: int
    splits: int
    lengths: Tuple[int, int, int, int]
    scale: float
    output_shapes: Tuple[Tuple[int, ...], ...]
    output_dtype: mx.Dtype

    def extra_inputs(self) -> Tuple[mx.array, mx.array]:
        """The `lengths` and `softmax_scale` input arrays."""
        return mx.array(self.lengths, dtype=mx.int32), mx.array([self.scale], dtype=mx.float32)


def _fail(message: str) -> None:
    raise MlxInferError(f"gpu quant_attention: {message}")


def _packed_layout(label: str, packed: Packed, n_kv: int, group_size: int) -> Tuple[int, int, int, mx.Dtype]:
    """(bits, head dim, capacity, scales dtype) of a packed cache, checked."""
    if not isinstance(packed, (tuple, list)) or len(packed) != 3:
        _fail(f"{label} must be a (w, scales, biases) triple.")
    w, scales, biases = packed
    if w.ndim != 3 or w.dtype != mx.uint32:
        _fail(f"{label} w must be uint32 [n_kv, C, dim * bits / 32], got {w.dtype} {tuple(w.shape)}.")
    if scales.ndim != 3 or tuple(scales.shape[:2]) != tuple(w.shape[:2]):
        _fail(f"{label} scales must be [{w.shape[0]}, {w.shape[1]}, dim / group_size], got {tuple(scales.shape)}.")
    if tuple(biases.shape) != tuple(scales.shape) or biases.dtype != scales.dtype:
        _fail(f"{label} biases must match its scales ({scales.dtype} {tuple(scales.shape)}), got {biases.dtype} "
              f"{tuple(biases.shape)}.")
    if w.shape[0] != n_kv:
        _fail(f"{label} has {w.shape[0]} KV heads, q has {n_kv}.")
    dim = scales.shape[2] * group_size
    if dim not in ATTN_HEAD_DIMS:
        _fail(f"{label} head dim {dim} (= {scales.shape[2]} groups of {group_size}) is not supported; use one of "
              f"{ATTN_HEAD_DIMS}.")
    if (w.shape[2] * 32) % dim or w.shape[2] * 32 // dim not in ATTN_BITS:
        _fail(f"{label} w has {w.shape[2]} words per row for head dim {dim}: bits must be one of {ATTN_BITS}.")
    return w.shape[2] * 32 // dim, dim, w.shape[1], scales.dtype


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def default_split_length(n_kv: int, length: int) -> int:
    """Keys per split: enough splits for about ATTN_TARGET_THREADGROUPS threadgroups over the n_kv heads, but
    none shorter than ATTN_MIN_SPLIT keys (so a short sequence is one split), rounded up to a whole tile."""
    splits = max(1, min(_ceil_div(ATTN_TARGET_THREADGROUPS, n_kv), _ceil_div(length, ATTN_MIN_SPLIT)))
    return ATTN_TILE * _ceil_div(_ceil_div(length, splits), ATTN_TILE)


def attention_launch(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
                     group_size: int, split_length: Optional[int] = None) -> AttentionLaunch:
    """Check the operands of the GPU quant_attention and return how the kernel launches for them.

    Args:
        q: [n_kv, R, D] float32 / float16 / bfloat16, 1 <= R <= ATTN_GPU_MAX_ROWS, R a multiple of positions.
        keys: (k [n_kv, C, D * k_bits / 32] uint32, k_scales, k_biases [n_kv, C, D / group_size] in float16 or
            q's dtype); D in ATTN_HEAD_DIMS, k_bits 4 or 8.
        values: the same for V (its own bits and head dim Dv; same C, same scales dtype as K).
        length: valid cache rows S, positions <= S <= C. scale: the softmax scale.
        positions: query positions P per head (1: decode, every key visible; more: causal).
        group_size: 32, 64 or 128.
        split_length: keys per threadgroup (a positive multiple of ATTN_TILE); None picks one from
            ATTN_TARGET_THREADGROUPS and ATTN_MIN_SPLIT.

    Raises:
        MlxInferError (one line): operands of the wrong rank, shape or dtype; unsupported bits, head dims,
            group size or row count; lengths out of range.
    """
    if group_size not in ATTN_GROUP_SIZES:
        _fail(f"group_size={group_size} is not supported; use one of {ATTN_GROUP_SIZES}.")
    if q.ndim != 3:
        _fail(f"q must be [n_kv, R, D], got shape {tuple(q.shape)}.")
    if q.dtype not in ATTN_DTYPES:
        _fail(f"q has dtype {q.dtype}; use float32, float16 or bfloat16.")
    n_kv, rows, dim = q.shape
    k_bits, k_dim, capacity, k_sdtype = _packed_layout("keys", keys, n_kv, group_size)
    v_bits, v_dim, v_capacity, v_sdtype = _packed_layout("values", values, n_kv, group_size)
    if k_dim != dim:
        _fail(f"q has head dim {dim}, keys {k_dim}.")
    if v_capacity != capacity:
        _fail(f"keys hold {capacity} rows, values {v_capacity}.")
    if k_sdtype not in (mx.float16, q.dtype) or v_sdtype != k_sdtype:
        _fail(f"scales and biases must all be float16 or q's dtype ({q.dtype}), got keys {k_sdtype}, values "
              f"{v_sdtype}.")
    if not 1 <= rows <= ATTN_GPU_MAX_ROWS:
        _fail(f"q has {rows} rows per KV head; the GPU kernel takes 1..{ATTN_GPU_MAX_ROWS} (n_rep * positions).")
    if not isinstance(positions, Integral) or positions < 1 or rows % positions:
        _fail(f"positions={positions} must be >= 1 and divide the {rows} rows of q.")
    if not isinstance(length, Integral) or not positions <= length <= capacity:
        _fail(f"need positions ({positions}) <= length ({length}) <= cache rows ({capacity}).")
    positions, length = int(positions), int(length)
    if split_length is None:
        split_length = default_split_length(n_kv, length)
    elif not isinstance(split_length, Integral) or split_length < 1 or split_length % ATTN_TILE:
        _fail(f"split_length={split_length} must be a positive multiple of {ATTN_TILE}.")
    split_length = int(split_length)
    splits = _ceil_div(length, split_length)
    threads = SIMD_WIDTH * ATTN_SIMD_GROUPS
    template = (("T", q.dtype), ("ST", k_sdtype), ("R", rows), ("P", positions), ("D", dim), ("DV", v_dim),
                ("GS", group_size), ("KBITS", k_bits), ("VBITS", v_bits), ("NSG", ATTN_SIMD_GROUPS))
    return AttentionLaunch(template=template, grid=(splits * threads, n_kv, 1), threadgroup=(threads, 1, 1),
                           split_length=split_length, splits=splits, lengths=(length, capacity, split_length, splits),
                           scale=float(scale),
                           output_shapes=((n_kv, splits, rows), (n_kv, splits, rows), (n_kv, splits, rows, v_dim)),
                           output_dtype=q.dtype)


def merge_partials(part_m: mx.array, part_l: mx.array, part_acc: mx.array, dtype: mx.Dtype) -> mx.array:
    """Combine the kernel's per-split partials (float32 part_m, part_l [n_kv, NS, R], part_acc
    [n_kv, NS, R, Dv]) into the attention output [n_kv, R, Dv] in `dtype`:
    sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i, M = max_i m_i (a split without visible keys has
    m = -1e30, l = 0, acc = 0 and weighs nothing)."""
    if part_m.shape[1] == 1:
        return (part_acc[:, 0] / part_l[:, 0, :, None]).astype(dtype)
    weight = mx.exp(part_m - mx.max(part_m, axis=1, keepdims=True))    # [n_kv, NS, R]
    total = mx.sum(weight * part_l, axis=1)                              # [n_kv, R]
    acc = mx.sum(weight[..., None] * part_acc, axis=1)                   # [n_kv, R, Dv]
    return (acc / total[..., None]).astype(dtype)


@lru_cache(maxsize=None)
def metal_kernel():
    """The `mx.fast.metal_kernel` object of the attention (built once). Building it needs no Metal; calling
    it does, except inside `mx.export_function` tracing (which is how the tests get its golden source)."""
    return make_metal_kernel(ATTN_KERNEL_NAME, ATTN_INPUT_NAMES, ATTN_OUTPUT_NAMES, ATTN_METAL_BODY,
                             "metal_kernels/quant_attention.metal")


@lru_cache(maxsize=None)
def cuda_kernel():
    """The `mx.fast.cuda_kernel` object of the attention (built once): the Metal body with the CUDA prelude
    as its header. Raises RuntimeError on an MLX without its CUDA back-end."""
    return make_cuda_kernel(ATTN_KERNEL_NAME, ATTN_INPUT_NAMES, ATTN_OUTPUT_NAMES, ATTN_METAL_BODY,
                            "metal_kernels/quant_attention.metal")


def launch_kernel(kernel, q: mx.array, keys: Packed, values: Packed, launch: AttentionLaunch,
                  verbose: Optional[bool] = None) -> Tuple[mx.array, mx.array, mx.array]:
    """Call an mx.fast.metal_kernel / cuda_kernel object of the body (or of an edit of it, as the tests do)
    with the launch computed by attention_launch; returns (part_m, part_l, part_acc), float32. verbose=None
    leaves the argument out (cuda_kernel objects need not take it)."""
    extra = {} if verbose is None else {"verbose": verbose}
    outs = kernel(inputs=[q, *keys, *values, *launch.extra_inputs()], template=list(launch.template),
                  grid=launch.grid, threadgroup=launch.threadgroup, output_shapes=list(launch.output_shapes),
                  output_dtypes=[mx.float32] * 3, **extra)
    return outs[0], outs[1], outs[2]


def metal_partials(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
                   group_size: int, verbose: bool = False,
                   split_length: Optional[int] = None) -> Tuple[mx.array, mx.array, mx.array]:
    """The Metal kernel's raw outputs (part_m, part_l, part_acc; see AttentionLaunch), without checking that
    Metal is the default device (so it can be traced on an MLX without Metal). Operands as in
    attention_launch."""
    launch = attention_launch(q, keys, values, length, scale, positions, group_size, split_length)
    return launch_kernel(metal_kernel(), q, keys, values, launch, verbose)


def metal_call(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
               group_size: int, verbose: bool = False, split_length: Optional[int] = None) -> mx.array:
    """The Metal kernel and the merge applied to the operands, without checking that Metal is the default
    device: on an MLX without Metal the result can be traced (mx.export_function) but not evaluated.
    verbose=True makes MLX print the generated Metal source (signature included) to stdout. Operands as in
    attention_launch; returns [n_kv, R, Dv] in q's dtype."""
    parts = metal_partials(q, keys, values, length, scale, positions, group_size, verbose, split_length)
    return merge_partials(*parts, q.dtype)


def metal_quant_attention(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
                          group_size: int) -> mx.array:
    """Attention of q over the quantized cache on Metal: [n_kv, R, Dv] in q's dtype (operands as in
    attention_launch; semantics of attention.reference_quant_attention).

    Raises:
        RuntimeError: Metal is not available or not the default device.
        MlxInferError: bad operands (see attention_launch).
    """
    if not metal_available():
        raise RuntimeError("quant_attention: the Metal kernel needs MLX on Metal with the GPU as the default device.")
    return metal_call(q, keys, values, length, scale, positions, group_size)


def cuda_quant_attention(q: mx.array, keys: Packed, values: Packed, length: int, scale: float, positions: int,
                         group_size: int) -> mx.array:
    """Attention of q over the quantized cache on CUDA (the Metal body through cuda_kernels/metal_prelude.cuh):
    [n_kv, R, Dv] in q's dtype (operands as in attention_launch).

    Raises:
        RuntimeError: MLX's CUDA back-end is not available or the GPU is not the default device.
        MlxInferError: bad operands (see attention_launch).
    """
    if not cuda_available():
        raise RuntimeError("quant_attention: the CUDA kernel needs MLX's CUDA back-end with the GPU as the default "
                           "device.")
    launch = attention_launch(q, keys, values, length, scale, positions, group_size)
    return merge_partials(*launch_kernel(cuda_kernel(), q, keys, values, launch, None), q.dtype)
