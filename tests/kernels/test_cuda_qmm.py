"""The CUDA twin of the quantized skinny matmul: the Metal body of metal_kernels/qmm.metal behind
cuda_kernels/metal_prelude.cuh, in the form `mx.fast.cuda_kernel` builds it (MLX 0.32's default header, the
prelude as the kernel's header, a __global__ function in mlx::core::cu with the signature and template
constants MLX writes), compiled by nvcc for sm_90 against a stand-in for MLX's device header
(cuda_kernels/host: the CPU wheel does not ship mlx/backend/cuda/device/utils.cuh). Where MLX's CUDA back-end
is the default device, the kernel's outputs match the float64 oracle (tolerance as in test_metal_qmm.py).
"""


import mlx.core as mx
import pytest

import gpu_helpers as h
from mlx_infer.kernels import gpu_qmm

needs_nvcc = pytest.mark.skipif(h.nvcc() is None, reason="nvcc is not installed")

MODEL_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _source(rows, k, n, group_size, bits, dtype):
    case = h.random_case(rows, k, n, group_size, bits, dtype, seed=rows + k + n)
    launch = gpu_qmm.qmm_launch(case.x, case.w, case.scales, case.biases, group_size, bits)
    inputs = list(zip(gpu_qmm.QMM_INPUT_NAMES, (dtype, mx.uint32, dtype, dtype)))
    return h.mlx_cuda_source(gpu_qmm.QMM_KERNEL_NAME, gpu_qmm.CUDA_METAL_PRELUDE, gpu_qmm.QMM_METAL_BODY, inputs,
                             [("y", dtype)], launch.template)


def test_cuda_source_has_the_metal_body_verbatim():
    src = _source(4, 576, 576, 32, 4, mx.float16)
    assert gpu_qmm.QMM_METAL_BODY in src and gpu_qmm.CUDA_METAL_PRELUDE in src
    assert "__global__ void custom_kernel_mlx_infer_qmm_float16_t_4_4_32_576_576_4_4(\n    const __half* x,\n" in src
    assert "  using T = __half;\n  constexpr int M = 4;\n  constexpr int BITS = 4;\n" in src


@needs_nvcc
def test_cuda_source_compiles_as_mlx_builds_it(tmp_path):
    """One kernel, exactly one module as MLX would JIT it."""
    result = h.nvcc_compile(_source(9, 576, 1536, 32, 4, mx.bfloat16), tmp_path, "one")
    assert result.returncode == 0, result.stderr[-6000:]
    [(name, stack, stores, loads, regs, smem)] = h.ptxas_entries(result.stderr)
    assert "custom_kernel_mlx_infer_qmm" in name
    assert (stack, stores, loads) == (0, 0, 0), "accumulators spilled to local memory"


@needs_nvcc
def test_cuda_instantiations_compile_without_spills(tmp_path):
    """Every dtype, bits 4 / 8, group sizes 32 / 64 / 128, 1 and 16 rows, at the default model's shapes, in one
    unit (MLX's default header and the prelude are include-guarded, so the sources concatenate)."""
    configs = [(rows, k, n, gs, bits, dtype) for dtype in DTYPES for bits in gpu_qmm.QMM_BITS
               for (k, n, gs) in ((576, 49152, 32), (1536, 576, 128), (576, 192, 64)) for rows in (1, 16)]
    h.assert_compiles_without_spills([_source(*c) for c in configs], tmp_path, 48 * 1024)


@pytest.mark.skipif(gpu_qmm.cuda_available(), reason="MLX's CUDA back-end is the default device here")
def test_cuda_qmm_refuses_without_cuda():
    case = h.random_case(2, 576, 192, 32, 4, mx.float32, seed=1)
    with pytest.raises(RuntimeError, match="CUDA"):
        gpu_qmm.cuda_qmm(case.x, case.w, case.scales, case.biases, 32, 4)


@pytest.mark.skipif(not gpu_qmm.cuda_available(), reason="needs MLX's CUDA back-end with the GPU as default device")
@pytest.mark.parametrize("rows", (1, 4, 9, 16))
@pytest.mark.parametrize("k, n", MODEL_SHAPES)
@pytest.mark.parametrize("group_size, bits, dtype", ((32, 4, mx.float16), (64, 8, mx.bfloat16), (32, 8, mx.float32)))
def test_cuda_device_matches_reference(rows, k, n, group_size, bits, dtype):
    case = h.random_case(rows, k, n, group_size, bits, dtype, seed=rows * 31 + k + n)
    y = gpu_qmm.cuda_qmm(case.x, case.w, case.scales, case.biases, group_size, bits)
    h.assert_close_to_oracle(h.to_numpy(y), case, f"cuda {dtype} b{bits} g{group_size} m{rows} {k}x{n}")
