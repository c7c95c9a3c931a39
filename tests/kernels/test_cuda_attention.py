"""The CUDA twin of the attention over a quantized KV cache: the Metal body of metal_kernels/quant_attention.metal
behind cuda_kernels/metal_prelude.cuh, in the form `mx.fast.cuda_kernel` builds it (gpu_helpers.mlx_cuda_source:
MLX 0.32's default header, the prelude as the kernel's header, a __global__ function in mlx::core::cu with the
signature and template constants MLX writes), compiled by nvcc for sm_90 against the stand-in MLX device header
(cuda_kernels/host). Where MLX's CUDA back-end is the default device, the kernel's merged outputs match the
float64 oracle (tolerance as in test_metal_attention.py).
"""


import mlx.core as mx
import pytest

import gpu_helpers as h
from gpu_helpers import AttnConfig
from mlx_infer.kernels import gpu_attention as ga
from mlx_infer.kernels import gpu_qmm

needs_nvcc = pytest.mark.skipif(h.nvcc() is None, reason="nvcc is not installed")


def _source(config: AttnConfig) -> str:
    case = h.make_case(config)
    launch = ga.attention_launch(*case.args())
    sdtype = h.ATTN_DTYPES[config.scale_dtype]
    dtypes = (case.q.dtype, mx.uint32, sdtype, sdtype, mx.uint32, sdtype, sdtype, mx.int32, mx.float32)
    inputs = list(zip(ga.ATTN_INPUT_NAMES, dtypes))
    outputs = [(name, mx.float32) for name in ga.ATTN_OUTPUT_NAMES]
    return h.mlx_cuda_source(ga.ATTN_KERNEL_NAME, gpu_qmm.CUDA_METAL_PRELUDE, ga.ATTN_METAL_BODY, inputs, outputs,
                             launch.template)


def test_cuda_source_has_the_metal_body_verbatim():
    src = _source(AttnConfig(2, 3, 4, 128, 128, 8, 4, 64, "bf16", "f16", 50, 64))
    assert ga.ATTN_METAL_BODY in src and gpu_qmm.CUDA_METAL_PRELUDE in src
    assert ("__global__ void custom_kernel_mlx_infer_quant_attention_bfloat16_t_float16_t_12_4_128_128_64_8_4_4(\n"
            "    const __nv_bfloat16* q,\n    const uint32_t* k,\n    const __half* k_scales,\n") in src
    assert "    const int32_t* lengths,\n    const float* softmax_scale,\n    float* part_m," in src
    assert "  using T = __nv_bfloat16;\n  using ST = __half;\n  constexpr int R = 12;\n" in src


@needs_nvcc
def test_cuda_source_compiles_as_mlx_builds_it(tmp_path):
    """One kernel, exactly one module as MLX would JIT it."""
    result = h.nvcc_compile(_source(AttnConfig(8, 3, 4, 128, 128, 8, 4, 64, "bf16", "bf16", 900, 1024)),
                            tmp_path, "one")
    assert result.returncode == 0, result.stderr[-6000:]
    [(name, stack, stores, loads, regs, smem)] = h.ptxas_entries(result.stderr)
    assert "custom_kernel_mlx_infer_quant_attention" in name
    assert (stack, stores, loads) == (0, 0, 0), "accumulators spilled to local memory"


@needs_nvcc
def test_cuda_instantiations_compile_without_spills(tmp_path):
    """Head dims 64 / 128 / 256, 1 and 16 rows, every dtype, k8v8 / k4v4 / k8v4, in one unit (MLX's default
    header and the prelude are include-guarded, so the sources concatenate)."""
    configs = [AttnConfig(1, rows, 1, dim, dim, kb, vb, gs, dtype, sdtype, 40, 64)
               for dim in ga.ATTN_HEAD_DIMS for rows in (1, 16)
               for (kb, vb, gs, dtype, sdtype) in ((8, 8, 64, "f16", "f16"), (4, 4, 32, "bf16", "bf16"),
                                                   (8, 4, 64, "f32", "f16"))]
    h.assert_compiles_without_spills([_source(c) for c in configs], tmp_path, 32 * 1024)


@pytest.mark.skipif(ga.cuda_available(), reason="MLX's CUDA back-end is the default device here")
def test_cuda_quant_attention_refuses_without_cuda():
    case = h.make_case(AttnConfig(2, 2, 1, 64, 64, 8, 8, 32, "f32", "f32", 20, 32))
    with pytest.raises(RuntimeError, match="CUDA"):
        ga.cuda_quant_attention(*case.args())




@pytest.mark.skipif(not ga.cuda_available(), reason="needs MLX's CUDA back-end with the GPU as default device")
@pytest.mark.parametrize("config", h.ATTN_DEVICE_CONFIGS, ids=lambda c: c.id)
def test_cuda_device_matches_reference(config):
    case = h.make_case(config)
    out = ga.cuda_quant_attention(*case.args())
    h.assert_attention_close(h.to_numpy(out), case, config.id)
