"""The CUDA twin of the attention over a quantized KV cache: the Metal body of metal_kernels/quant_attention.metal
behind cuda_kernels/metal_prelude.cuh, in the form `mx.fast.cuda_kernel` builds it (gpu_helpers.mlx_cuda_source:
MLX 0.32's default header, the prelude as the kernel's header, a __global__ function in mlx::core::cu with the
signature and template constants MLX writes), checked as test_cuda_qmm.py checks qmm:

1. compiled by nvcc for sm_90 against the stand-in MLX device header (cuda_kernels/host), without spills;
2. logic: that same source under the CUDA emulator (cuda_kernels/host/cuda_emu.h), merged by
   gpu_attention.merge_partials, matches the float64 oracle (tolerance as in test_metal_attention.py: decode and
   verify, GQA groups, head dims 64 / 128 / 256, every dtype, several splits, NaN scales past S); the prelude
   broken on purpose in the words the body uses (simd_sum, simd_max, simd_shuffle_xor) must fail;
3. where MLX's CUDA back-end is the default device, the kernel's merged outputs match the oracle.
"""


import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from gpu_helpers import AttnConfig
from mlx_infer.kernels import gpu_attention as ga
from mlx_infer.kernels import gpu_qmm

needs_emulator = pytest.mark.skipif(h.EMULATOR_MISSING is not None, reason=f"emulator: {h.EMULATOR_MISSING}")


def _kernel(case: h.AttnCase, prelude: str = gpu_qmm.CUDA_METAL_PRELUDE,
            name: str = ga.ATTN_KERNEL_NAME) -> h.CudaKernel:
    """The kernel MLX builds for the case (with another prelude and name for the broken ones)."""
    launch = ga.attention_launch(*case.args(), split_length=case.config.split_length)
    sdtype = h.ATTN_DTYPES[case.config.scale_dtype]
    dtypes = (case.q.dtype, mx.uint32, sdtype, sdtype, mx.uint32, sdtype, sdtype, mx.int32, mx.float32)
    inputs = list(zip(ga.ATTN_INPUT_NAMES, dtypes))
    outputs = [(output, mx.float32) for output in ga.ATTN_OUTPUT_NAMES]
    return h.mlx_cuda_kernel(name, prelude, ga.ATTN_METAL_BODY, inputs, outputs, launch.template)


def _source(config: AttnConfig) -> str:
    return _kernel(h.make_case(config)).source


def test_cuda_source_has_the_metal_body_verbatim():
    src = _source(AttnConfig(2, 3, 4, 128, 128, 8, 4, 64, "bf16", "f16", 50, 64))
    assert ga.ATTN_METAL_BODY in src and gpu_qmm.CUDA_METAL_PRELUDE in src
    assert ("__global__ void custom_kernel_mlx_infer_quant_attention_bfloat16_t_float16_t_12_4_128_128_64_8_4_4(\n"
            "    const __nv_bfloat16* q,\n    const uint32_t* k,\n    const __half* k_scales,\n") in src
    assert "    const int32_t* lengths,\n    const float* softmax_scale,\n    float* part_m," in src
    assert "  using T = __nv_bfloat16;\n  using ST = __half;\n  constexpr int R = 12;\n" in src


def test_cuda_source_compiles_as_mlx_builds_it(tmp_path):
    """One kernel, exactly one module as MLX would JIT it."""
    result = h.nvcc_compile(_source(AttnConfig(8, 3, 4, 128, 128, 8, 4, 64, "bf16", "bf16", 900, 1024)),
                            tmp_path, "one")
    assert result.returncode == 0, result.stderr[-6000:]
    [(name, stack, stores, loads, regs, smem)] = h.ptxas_entries(result.stderr)
    assert "custom_kernel_mlx_infer_quant_attention" in name
    assert (stack, stores, loads) == (0, 0, 0), "accumulators spilled to local memory"


def test_cuda_instantiations_compile_without_spills(tmp_path):
    """Head dims 64 / 128 / 256, 1 and 16 rows, every dtype, k8v8 / k4v4 / k8v4, in one unit (MLX's default
    header and the prelude are include-guarded, so the sources concatenate)."""
    configs = [AttnConfig(1, rows, 1, dim, dim, kb, vb, gs, dtype, sdtype, 40, 64)
               for dim in ga.ATTN_HEAD_DIMS for rows in (1, 16)
               for (kb, vb, gs, dtype, sdtype) in ((8, 8, 64, "f16", "f16"), (4, 4, 32, "bf16", "bf16"),
                                                   (8, 4, 64, "f32", "f16"))]
    h.assert_compiles_without_spills([_source(c) for c in configs], tmp_path, 32 * 1024)


# --- 2. logic under the CUDA emulator ---------------------------------------------------------------------

#: Emulated configurations (n_kv = 2; S never a multiple of the 32-key tile nor of the split; rows past S in every
#: cache): decode and verify, every dtype, head dims 64 / 128 / 256, Dv != D, one to three splits.
EMU_CONFIGS = (
    AttnConfig(2, 1, 1, 64, 64, 8, 8, 32, "f32", "f32", 77, 96, 32),      # three splits, the last one partial
    AttnConfig(2, 3, 1, 256, 256, 4, 4, 64, "f16", "f16", 45, 64),        # one split of two tiles
    AttnConfig(2, 3, 1, 128, 128, 8, 4, 128, "bf16", "f16", 37, 40, 32),  # f16 scales under bf16 q
    AttnConfig(2, 3, 4, 64, 64, 4, 4, 32, "f32", "f16", 99, 128, 64),     # verify, splits of two tiles
    AttnConfig(2, 4, 4, 128, 64, 4, 8, 32, "bf16", "bf16", 40, 48, 32),   # 16 rows (the most), Dv != D
)
#: The configuration the broken preludes run (rows in every warp, two tiles per split, two splits).
BROKEN_CONFIG = EMU_CONFIGS[3]
#: Prelude mutations that the body's collectives (simd_sum, simd_max, simd_shuffle_xor) must catch.
BROKEN_PRELUDES = ("simd_sum_over_16_lanes", "simd_max_over_16_lanes", "shuffle_xor_with_half_the_mask")


def _run_emulated(exe, kernel: h.CudaKernel, case: h.AttnCase) -> np.ndarray:
    """The emulated kernel's partials, merged by gpu_attention.merge_partials: [n_kv, R, Dv] in q's dtype (as
    numpy; bfloat16 as uint16)."""
    launch = ga.attention_launch(*case.args(), split_length=case.config.split_length)
    arrays = (case.q, *case.keys, *case.values, *launch.extra_inputs())
    inputs = {name: h.to_numpy(a) for name, a in zip(ga.ATTN_INPUT_NAMES, arrays)}
    outputs = {name: (shape, np.float32) for name, shape in zip(ga.ATTN_OUTPUT_NAMES, launch.output_shapes)}
    out = h.run_emulated(exe, kernel, inputs, outputs, launch.grid, launch.threadgroup)
    return h.to_numpy(ga.merge_partials(*(mx.array(out[name]) for name in ga.ATTN_OUTPUT_NAMES), case.q.dtype))


@pytest.fixture(scope="module")
def emulated():
    """Every emulated configuration's CUDA source in one emulator executable: (exe, {config: case},
    {config: CudaKernel})."""
    cases = {c: h.make_case(c) for c in EMU_CONFIGS}
    kernels = {c: _kernel(case) for c, case in cases.items()}
    assert len({k.name for k in kernels.values()}) == len(EMU_CONFIGS), "each configuration is its own instantiation"
    return h.build_cuda_emulator(list(kernels.values())), cases, kernels


@needs_emulator
@pytest.mark.parametrize("config", EMU_CONFIGS, ids=lambda c: c.id)
def test_emulated_cuda_kernel_matches_reference(emulated, config):
    exe, cases, kernels = emulated
    h.assert_attention_close(_run_emulated(exe, kernels[config], cases[config]), cases[config],
                             "emulated cuda " + config.id)


@needs_emulator
@pytest.mark.parametrize("mutation", BROKEN_PRELUDES)
def test_emulation_catches_a_broken_prelude(emulated, mutation):
    exe, cases, kernels = emulated
    case = cases[BROKEN_CONFIG]
    assert h.attention_error_ratio(_run_emulated(exe, kernels[BROKEN_CONFIG], case), case) <= 1.0
    broken = _kernel(case, h.mutated_prelude(gpu_qmm.CUDA_METAL_PRELUDE, mutation), name=f"broken_{mutation}")
    ratio = h.attention_error_ratio(_run_emulated(h.build_cuda_emulator([broken]), broken, case), case)
    assert ratio > 100.0, f"the emulator did not catch the prelude mutation {mutation} (error {ratio:.3g}x the bound)"


# --- 3. on a CUDA device ----------------------------------------------------------------------------------

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
