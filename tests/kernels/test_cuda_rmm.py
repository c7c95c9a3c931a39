"""The CUDA twin of RMM's reduced quantized matmul: the Metal body of metal_kernels/rmm_qmm.metal behind
cuda_kernels/metal_prelude.cuh, in the form `mx.fast.cuda_kernel` builds it (gpu_helpers.mlx_cuda_source),
compiled by nvcc for sm_90 against the stand-in for MLX's device header (cuda_kernels/host), with no spills.
Where MLX's CUDA back-end is the default device, the kernel's outputs match the float64 oracle of x with each
row's dropped groups zeroed (selection: mlx_infer.kernels.rmm.group_mask; tolerance as in test_metal_qmm.py).
"""

import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from mlx_infer.kernels import gpu_qmm, gpu_rmm

needs_nvcc = pytest.mark.skipif(h.nvcc() is None, reason="nvcc is not installed")

DTYPES = h.ATTN_DTYPES
#: The default model's (K, N) matmul shapes.
MODEL_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


def _source(rows, k, n, group_size, bits, dtype, keep):
    x = mx.zeros((rows, k), dtype=DTYPES[dtype])
    w = mx.zeros((n, k * bits // 32), dtype=mx.uint32)
    s = mx.zeros((n, k // group_size), dtype=DTYPES[dtype])
    launch = gpu_rmm.rmm_launch(x, w, s, s, group_size, bits, keep)
    inputs = list(zip(gpu_rmm.RMM_INPUT_NAMES, (x.dtype, mx.uint32, x.dtype, x.dtype)))
    return h.mlx_cuda_source(gpu_rmm.RMM_KERNEL_NAME, gpu_qmm.CUDA_METAL_PRELUDE, gpu_rmm.RMM_METAL_BODY, inputs,
                             [("y", x.dtype)], launch.template)


def test_cuda_source_has_the_metal_body_verbatim():
    src = _source(4, 576, 576, 32, 4, "f16", 9)
    assert gpu_rmm.RMM_METAL_BODY in src and gpu_qmm.CUDA_METAL_PRELUDE in src
    assert ("__global__ void custom_kernel_mlx_infer_rmm_qmm_float16_t_4_4_32_576_576_4_4_9(\n"
            "    const __half* x,\n") in src
    assert "  constexpr int COLS = 4;\n  constexpr int KEEP = 9;\n" in src


@needs_nvcc
def test_cuda_source_compiles_as_mlx_builds_it(tmp_path):
    """One kernel, exactly one module as MLX would JIT it."""
    result = h.nvcc_compile(_source(9, 576, 1536, 32, 4, "bf16", 9), tmp_path, "one")
    assert result.returncode == 0, result.stderr[-6000:]
    [(name, stack, stores, loads, _, _)] = h.ptxas_entries(result.stderr)
    assert "custom_kernel_mlx_infer_rmm_qmm" in name
    assert (stack, stores, loads) == (0, 0, 0), "accumulators spilled to local memory"


@needs_nvcc
def test_cuda_instantiations_compile_without_spills(tmp_path):
    """Every dtype, bits 4 / 8, group sizes 32 / 64 / 128, 1 and 16 rows, at the default model's shapes and at the
    largest K per group size (256 groups), in one unit."""
    configs = [(rows, k, n, gs, bits, dtype, max(1, k // gs // 2)) for dtype in DTYPES for bits in (4, 8)
               for (k, n, gs) in ((576, 49152, 32), (1536, 576, 128), (576, 192, 64), (8192, 576, 32),
                                  (16384, 576, 64), (32768, 576, 128))
               for rows in (1, 16)]
    h.assert_compiles_without_spills([_source(*c) for c in configs], tmp_path, 32 * 1024)


@pytest.mark.skipif(gpu_rmm.cuda_available(), reason="MLX's CUDA back-end is the default device here")
def test_cuda_rmm_qmm_refuses_without_cuda():
    q = h.rmm_case((2, 576, 192, 32, 4, "f32", 3)).qmm
    with pytest.raises(RuntimeError, match="CUDA"):
        gpu_rmm.cuda_rmm_qmm(q.x, q.w, q.scales, q.biases, 32, 4, 3)


DEVICE_CASES = [(rows, k, n, gs, bits, dtype, keep) for (k, n) in MODEL_SHAPES for rows in (1, 3, 16)
                for (gs, bits, dtype) in ((32, 4, "f16"), (64, 8, "bf16"), (32, 8, "f32")) if k % gs == 0
                for keep in (1, k // gs // 2, k // gs)]
DEVICE_CASES += [(3, 256 * gs, 512, gs, bits, "f16", 100) for gs in (32, 64, 128) for bits in (4, 8)]


@pytest.mark.skipif(not gpu_rmm.cuda_available(), reason="needs MLX's CUDA back-end with the GPU as default device")
@pytest.mark.parametrize("c", DEVICE_CASES, ids=h.rmm_case_id)
def test_cuda_device_matches_reference(c):
    case = h.rmm_case(c)
    q = case.qmm
    y = gpu_rmm.cuda_rmm_qmm(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    h.assert_close_to_oracle(np.array(h.to_numpy(y)), case.masked(), "cuda " + h.rmm_case_id(c))
