"""The quantized skinny matmul on the GPU: one Metal body, run by `mx.fast.metal_kernel` on Apple GPUs and,
through a small prelude that maps its Metal words to CUDA, by `mx.fast.cuda_kernel` on NVIDIA GPUs.

    y = qmm(x, w, scales, biases, group_size, bits)
      == mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)

x [M, K] (M = 1..16 rows: decode, verify widths, block drafts) float32 / float16 / bfloat16; w [N, K*bits/32]
uint32 in MLX's affine layout (bits 4 or 8, value j of a word in bits [bits*j, bits*j + bits)); scales,
biases [N, K/group_size] in x's dtype; group_size 32, 64 or 128. y [M, N] in x's dtype, accumulated in
float32. Each packed weight word is read once for all M rows (MLX's own kernels for 2-16 rows are a known
weak spot: mlx#4265).

Sources: metal_kernels/qmm.metal (the body; MLX writes the signature) and cuda_kernels/metal_prelude.cuh
(the CUDA header), read once at import, from the installed package (mlx_infer/metal_kernels,
mlx_infer/cuda_kernels) or else from the source tree beside the package.
"""

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx

from mlx_infer.errors import MlxInferError

#: Largest number of rows of x the skinny kernel takes (decode, verify widths, block drafts).
QMM_MAX_ROWS = 16
#: Bit widths and group sizes of MLX's affine quantization the kernel supports.
QMM_BITS = (4, 8)
QMM_GROUP_SIZES = (32, 64, 128)
#: Activation dtypes (scales and biases share x's dtype).
QMM_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
#: SIMD groups (32 lanes each) per threadgroup, and output columns each SIMD group owns.
QMM_SIMD_GROUPS = 4
QMM_COLUMNS_PER_SIMD_GROUP = 4
#: Width of a SIMD group (Apple GPUs) / warp (NVIDIA), which the body assumes.
SIMD_WIDTH = 32

#: The kernel's name and argument names, as the body spells them.
QMM_KERNEL_NAME = "mlx_infer_qmm"
QMM_INPUT_NAMES = ("x", "w", "scales", "biases")
QMM_OUTPUT_NAMES = ("y",)

_PACKAGE = Path(__file__).resolve().parents[1]


def kernel_source_path(folder: str, name: str) -> Optional[Path]:
    """Where a kernel source file lives: mlx_infer/<folder>/<name> in an installed package, else
    <folder>/<name> in the source tree beside the package; None when neither exists."""
    for base in (_PACKAGE, _PACKAGE.parent):
        path = base / folder / name
        if path.is_file():
            return path
    return None


def _read_source(folder: str, name: str) -> Optional[str]:
    path = kernel_source_path(folder, name)
    return path.read_text() if path is not None else None


#: The Metal body (None when the package was installed without its kernel sources).
QMM_METAL_BODY = _read_source("metal_kernels", "qmm.metal")
#: The CUDA header that maps the body's Metal words to CUDA.
CUDA_METAL_PRELUDE = _read_source("cuda_kernels", "metal_prelude.cuh")


@dataclass(frozen=True)
class QmmLaunch:
    """How one qmm call launches: template constants (in the order MLX writes them), grid (counted in
    THREADS, as mx.fast.*_kernel want) and threadgroup size, and the output's shape and dtype."""

    template: Tuple[Tuple[str, object], ...]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    output_shape: Tuple[int, int]
    output_dtype: mx.Dtype


def qmm_launch(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
               bits: int) -> QmmLaunch:
    """Check the operands of qmm and return how the kernel launches for them.

    Args:
        x: [M, K] float32 / float16 / bfloat16, 1 <= M <= QMM_MAX_ROWS.
        w: [N, K * bits / 32] uint32, MLX's affine packing.
        scales, biases: [N, K / group_size] in x's dtype.
        group_size: 32, 64 or 128. bits: 4 or 8.

    Raises:
        MlxInferError: operands of the wrong rank, shape or dtype, or an unsupported bits / group size.
    """
    if bits not in QMM_BITS:
        raise MlxInferError(f"qmm: bits={bits} is not supported; use one of {QMM_BITS}.")
    if group_size not in QMM_GROUP_SIZES:
        raise MlxInferError(f"qmm: group_size={group_size} is not supported; use one of {QMM_GROUP_SIZES}.")
    if x.ndim != 2 or not 1 <= x.shape[0] <= QMM_MAX_ROWS:
        raise MlxInferError(f"qmm: x must be [M, K] with 1 <= M <= {QMM_MAX_ROWS}, got shape {tuple(x.shape)}; "
                            "use the wide path for more rows.")
    if x.dtype not in QMM_DTYPES:
        raise MlxInferError(f"qmm: x has dtype {x.dtype}; use float32, float16 or bfloat16.")
    rows, k = x.shape
    if k % group_size:
        raise MlxInferError(f"qmm: K={k} is not a multiple of group_size={group_size}.")
    if w.ndim != 2 or w.dtype != mx.uint32 or w.shape[1] * 32 != k * bits:
        raise MlxInferError(f"qmm: w must be uint32 [N, {k * bits // 32}] for K={k} at {bits} bits, got "
                            f"{w.dtype} {tuple(w.shape)}.")
    n = w.shape[0]
    for label, a in (("scales", scales), ("biases", biases)):
        if tuple(a.shape) != (n, k // group_size) or a.dtype != x.dtype:
            raise MlxInferError(f"qmm: {label} must be {x.dtype} [{n}, {k // group_size}], got {a.dtype} "
                                f"{tuple(a.shape)}; cast it to x's dtype.")
    threads = SIMD_WIDTH * QMM_SIMD_GROUPS
    columns = QMM_SIMD_GROUPS * QMM_COLUMNS_PER_SIMD_GROUP
    groups = -(-n // columns)
    template = (("T", x.dtype), ("M", rows), ("BITS", bits), ("GS", group_size), ("K", k), ("N", n),
                ("NSG", QMM_SIMD_GROUPS), ("COLS", QMM_COLUMNS_PER_SIMD_GROUP))
    return QmmLaunch(template=template, grid=(groups * threads, 1, 1), threadgroup=(threads, 1, 1),
                     output_shape=(rows, n), output_dtype=x.dtype)


def require_source(source: Optional[str], what: str, kernel: str) -> str:
    """`source`, or RuntimeError (naming `kernel` and the file `what`) when the installation lacks it."""
    if source is None:
        raise RuntimeError(f"{kernel}: {what} is missing from this installation of mlx_infer; reinstall it with "
                           "its kernel sources (metal_kernels/, cuda_kernels/).")
    return source


def make_metal_kernel(name: str, input_names, output_names, body: Optional[str], body_file: str):
    """An `mx.fast.metal_kernel` object of a Metal body (body_file: its path, for the error when missing).
    Building it needs no Metal; calling it does, except inside `mx.export_function` tracing (which is how
    the tests get its golden source)."""
    return mx.fast.metal_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                source=require_source(body, body_file, name))


def make_cuda_kernel(name: str, input_names, output_names, body: Optional[str], body_file: str):
    """An `mx.fast.cuda_kernel` object of the same Metal body, with the CUDA prelude as its header. Raises
    RuntimeError on an MLX without its CUDA back-end."""
    return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                               source=require_source(body, body_file, name),
                               header=require_source(CUDA_METAL_PRELUDE, "cuda_kernels/metal_prelude.cuh", name))


@lru_cache(maxsize=None)
def metal_kernel():
    """The `mx.fast.metal_kernel` object of qmm (built once). Building it needs no Metal; calling it
    does, except inside `mx.export_function` tracing (which is how the tests get its golden source)."""
    return make_metal_kernel(QMM_KERNEL_NAME, QMM_INPUT_NAMES, QMM_OUTPUT_NAMES, QMM_METAL_BODY, "metal_kernels/qmm.metal")


@lru_cache(maxsize=None)
def cuda_kernel():
    """The `mx.fast.cuda_kernel` object of qmm (built once): the Metal body with the CUDA prelude as its
    header. Raises RuntimeError on an MLX without its CUDA back-end."""
    return make_cuda_kernel(QMM_KERNEL_NAME, QMM_INPUT_NAMES, QMM_OUTPUT_NAMES, QMM_METAL_BODY, "metal_kernels/qmm.metal")


def metal_call(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
               verbose: bool = False) -> mx.array:
    """The Metal kernel applied to the operands, without checking that Metal is the default device: on an
    MLX without Metal the result can be traced (mx.export_function) but not evaluated. verbose=True makes
    MLX print the generated Metal source (signature included) to stdout. Shapes as in qmm_launch."""
    launch = qmm_launch(x, w, scales, biases, group_size, bits)
    return metal_kernel()(inputs=[x, w, scales, biases], template=list(launch.template), grid=launch.grid,
                          threadgroup=launch.threadgroup, output_shapes=[launch.output_shape],
                          output_dtypes=[launch.output_dtype], verbose=verbose)[0]


def metal_available() -> bool:
    """Whether MLX runs on Metal here (Metal present and the GPU the default device)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


def cuda_available() -> bool:
    """Whether MLX runs on CUDA here (its CUDA back-end present and the GPU the default device)."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def metal_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
              bits: int) -> mx.array:
    """y [M, N] = x [M, K] @ dequantize(w, scales, biases).T on Metal; operands as in qmm_launch.

    Raises:
        RuntimeError: Metal is not available or not the default device.
        MlxInferError: bad operands (see qmm_launch).
    """
    if not metal_available():
        raise RuntimeError("qmm: the Metal kernel needs MLX on Metal with the GPU as the default device.")
    return metal_call(x, w, scales, biases, group_size, bits)


def cuda_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
             bits: int) -> mx.array:
    """y [M, N] = x [M, K] @ dequantize(w, scales, biases).T on CUDA (the Metal body through
    cuda_kernels/metal_prelude.cuh); operands as in qmm_launch.

    Raises:
        RuntimeError: MLX's CUDA back-end is not available or the GPU is not the default device.
        MlxInferError: bad operands (see qmm_launch).
    """
    if not cuda_available():
        raise RuntimeError("qmm: the CUDA kernel needs MLX's CUDA back-end with the GPU as the default device.")
    launch = qmm_launch(x, w, scales, biases, group_size, bits)
    return cuda_kernel()(inputs=[x, w, scales, biases], template=list(launch.template), grid=launch.grid,
                         threadgroup=launch.threadgroup, output_shapes=[launch.output_shape],
                         output_dtypes=[launch.output_dtype])[0]
