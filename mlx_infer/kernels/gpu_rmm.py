"""RMM's reduced quantized skinny matmul on the GPU (arXiv 2608.13426): one Metal body
(metal_kernels/rmm_qmm.metal), run by `mx.fast.metal_kernel` on Apple GPUs and, through
cuda_kernels/metal_prelude.cuh, by `mx.fast.cuda_kernel` on NVIDIA GPUs; the GPU twin of
mlx_infer.kernels.rmm.rmm_qmm (same arguments, same result as its oracle reference_rmm_qmm).

    y = metal_rmm_qmm(x, w, scales, biases, group_size, bits, keep)
      == reference_rmm_qmm(x, w, scales, biases, group_size, bits, keep)

Per row m of x [M, K] (M = 1..16), group g (columns [g * group_size, (g + 1) * group_size)) scores
s[m, g] = sum_j |x[m, j]| in float32; g beats h when s[m, g] > s[m, h], or the scores are equal and g < h;
row m keeps the groups beaten by fewer than `keep` others, and y[m, n] = sum over its kept groups of
x[m, j] * dequantize(w)[n, j]. The kernel computes the scores and the selection itself (no host round trip)
and reads packed words, scales and biases only of the groups some row keeps.

Shapes and dtypes as gpu_qmm's: x [M, K] float32 / float16 / bfloat16; w [N, K * bits / 32] uint32 in MLX's
affine layout (bits 4 or 8); scales, biases [N, K / group_size] in x's dtype; group_size 32, 64 or 128;
y [M, N] in x's dtype, accumulated in float32. Limit: K / group_size <= RMM_MAX_GROUPS (256), i.e.
K <= 8192 at group size 32, 16384 at 64, 32768 at 128.

Sources: metal_kernels/rmm_qmm.metal (the body; MLX writes the signature) and cuda_kernels/metal_prelude.cuh
(the CUDA header), found as gpu_qmm finds its own (installed package or source tree).
"""

from dataclasses import dataclass
from functools import lru_cache
from numbers import Integral
from typing import Tuple

import mlx.core as mx

from mlx_infer.errors import MlxInferError
from mlx_infer.kernels.gpu_qmm import (QMM_INPUT_NAMES, QMM_MAX_ROWS, QMM_OUTPUT_NAMES, cuda_available,
                                       kernel_source_path, make_cuda_kernel, make_metal_kernel,
                                       metal_available, qmm_launch)

#: Most quantization groups per row of x the kernel takes (its scores live in a 256-float staging row).
RMM_MAX_GROUPS = 256
#: Most rows of x (the skinny qmm kernel's; its threadgroup shape and grid are qmm's too).
RMM_MAX_ROWS = QMM_MAX_ROWS

#: The kernel's name and argument names, as the body spells them (qmm's).
RMM_KERNEL_NAME = "mlx_infer_rmm_qmm"
RMM_INPUT_NAMES = QMM_INPUT_NAMES
RMM_OUTPUT_NAMES = QMM_OUTPUT_NAMES

#: Where the Metal body lives, and its text (None when the package was installed without its kernel sources).
RMM_METAL_PATH = kernel_source_path("metal_kernels", "rmm_qmm.metal")
RMM_METAL_BODY = RMM_METAL_PATH.read_text() if RMM_METAL_PATH is not None else None

__all__ = ["RMM_MAX_GROUPS", "RMM_MAX_ROWS", "RmmLaunch", "cuda_rmm_qmm", "metal_rmm_call", "metal_rmm_qmm",
           "rmm_launch"]


@dataclass(frozen=True)
class RmmLaunch:
    """How one rmm_qmm call launches: template constants (in the order MLX writes them: qmm's, then KEEP), grid
    (counted in THREADS, as mx.fast.*_kernel want) and threadgroup size, and the output's shape and dtype."""

    template: Tuple[Tuple[str, object], ...]
    grid: Tuple[int, int, int]
    threadgroup: Tuple[int, int, int]
    output_shape: Tuple[int, int]
    output_dtype: mx.Dtype


def rmm_launch(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
               keep: int) -> RmmLaunch:
    """Check the operands of rmm_qmm and return how the kernel launches for them.

    Args:
        x: [M, K] float32 / float16 / bfloat16, 1 <= M <= RMM_MAX_ROWS, K / group_size <= RMM_MAX_GROUPS.
        w: [N, K * bits / 32] uint32, MLX's affine packing.
        scales, biases: [N, K / group_size] in x's dtype.
        group_size: 32, 64 or 128. bits: 4 or 8.
        keep: groups kept per row, an int in [1, K / group_size].

    Raises:
        MlxInferError (one line): operands of the wrong rank, shape or dtype, an unsupported bits / group size
        (the checks of gpu_qmm.qmm_launch), more than RMM_MAX_GROUPS groups, or keep out of range.
    """
    try:
        base = qmm_launch(x, w, scales, biases, group_size, bits)
    except MlxInferError as error:
        message = str(error)
        raise MlxInferError("rmm_" + message if message.startswith("qmm:") else message) from None
    k = x.shape[1]
    groups = k // group_size
    if groups > RMM_MAX_GROUPS:
        raise MlxInferError(f"rmm_qmm: K={k} has {groups} groups of {group_size}; the GPU kernel takes at most "
                            f"{RMM_MAX_GROUPS} (K <= {RMM_MAX_GROUPS * group_size} at this group size).")
    if isinstance(keep, bool) or not isinstance(keep, Integral) or not 1 <= keep <= groups:
        raise MlxInferError(f"rmm_qmm: keep must be an int in [1, {groups}] for K={k} and group_size={group_size}, "
                            f"got {keep!r}.")
    return RmmLaunch(template=base.template + (("KEEP", int(keep)),), grid=base.grid, threadgroup=base.threadgroup,
                     output_shape=base.output_shape, output_dtype=base.output_dtype)


@lru_cache(maxsize=None)
def metal_kernel():
    """The `mx.fast.metal_kernel` object of rmm_qmm (built once). Building it needs no Metal; calling it does,
    except inside `mx.export_function` tracing (which is how the tests get its golden source)."""
    return make_metal_kernel(RMM_KERNEL_NAME, RMM_INPUT_NAMES, RMM_OUTPUT_NAMES, RMM_METAL_BODY,
                             "metal_kernels/rmm_qmm.metal")


@lru_cache(maxsize=None)
def cuda_kernel():
    """The `mx.fast.cuda_kernel` object of rmm_qmm (built once): the Metal body with the CUDA prelude as its
    header. Raises RuntimeError on an MLX without its CUDA back-end."""
    return make_cuda_kernel(RMM_KERNEL_NAME, RMM_INPUT_NAMES, RMM_OUTPUT_NAMES, RMM_METAL_BODY,
                            "metal_kernels/rmm_qmm.metal")


def _launch_kernel(kernel, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, launch: RmmLaunch,
                   **extra) -> mx.array:
    return kernel(inputs=[x, w, scales, biases], template=list(launch.template), grid=launch.grid,
                  threadgroup=launch.threadgroup, output_shapes=[launch.output_shape],
                  output_dtypes=[launch.output_dtype], **extra)[0]


def metal_rmm_call(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                   keep: int, verbose: bool = False) -> mx.array:
    """The Metal kernel applied to the operands, without checking that Metal is the default device: on an MLX
    without Metal the result can be traced (mx.export_function) but not evaluated. verbose=True makes MLX print
    the generated Metal source (signature included) to stdout. Operands as in rmm_launch; returns y [M, N] in
    x's dtype.

    Raises:
        MlxInferError: bad operands (see rmm_launch).
    """
    launch = rmm_launch(x, w, scales, biases, group_size, bits, keep)
    return _launch_kernel(metal_kernel(), x, w, scales, biases, launch, verbose=verbose)


def metal_rmm_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                  keep: int) -> mx.array:
    """y [M, N]: x [M, K] times dequantize(w, scales, biases).T over the `keep` groups each row keeps, on Metal;
    operands as in rmm_launch, y in x's dtype.

    Raises:
        RuntimeError: Metal is not available or not the default device.
        MlxInferError: bad operands (see rmm_launch).
    """
    if not metal_available():
        raise RuntimeError("rmm_qmm: the Metal kernel needs MLX on Metal with the GPU as the default device.")
    return metal_rmm_call(x, w, scales, biases, group_size, bits, keep)


def cuda_rmm_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                 keep: int) -> mx.array:
    """y [M, N]: x [M, K] times dequantize(w, scales, biases).T over the `keep` groups each row keeps, on CUDA
    (the Metal body through cuda_kernels/metal_prelude.cuh); operands as in rmm_launch, y in x's dtype.

    Raises:
        RuntimeError: MLX's CUDA back-end is not available or the GPU is not the default device.
        MlxInferError: bad operands (see rmm_launch).
    """
    if not cuda_available():
        raise RuntimeError("rmm_qmm: the CUDA kernel needs MLX's CUDA back-end with the GPU as the default device.")
    launch = rmm_launch(x, w, scales, biases, group_size, bits, keep)
    return _launch_kernel(cuda_kernel(), x, w, scales, biases, launch)
