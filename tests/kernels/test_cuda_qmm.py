"""The CUDA twin of the quantized skinny matmul: the Metal body of metal_kernels/qmm.metal behind
cuda_kernels/metal_prelude.cuh, in the form `mx.fast.cuda_kernel` builds it (MLX 0.32's default header, the
prelude as the kernel's header, a __global__ function in mlx::core::cu with the signature and template
constants MLX writes), checked three ways:

1. compiled by nvcc for sm_90 against a stand-in for MLX's device header (cuda_kernels/host: the CPU wheel does
   not ship mlx/backend/cuda/device/utils.cuh), without spills; skipped where there is no nvcc, failed instead
   where $MLX_INFER_REQUIRE_NVCC is 1 (gpu_helpers.nvcc_or_skip);
2. logic: that same source, unchanged, compiled with g++ against cuda_kernels/host/cuda_emu.h and run under the
   execution-model emulator (blocks of fibers, __syncthreads, warp shuffles with CUDA's lane rules), matches
   the float64 oracle (tolerance as in test_metal_qmm.py); the prelude broken on purpose (simd_sum over 16
   lanes, lane and warp indices of 16-thread warps, a barrier that does nothing, a half-warp mask) must fail;
3. where MLX's CUDA back-end is the default device, the kernel's outputs match the oracle.
"""

import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from mlx_infer.kernels import gpu_qmm

needs_emulator = pytest.mark.skipif(h.EMULATOR_MISSING is not None, reason=f"emulator: {h.EMULATOR_MISSING}")

MODEL_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
NP_OUT = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def _case(rows, k, n, group_size, bits, dtype) -> h.QmmCase:
    return h.random_case(rows, k, n, group_size, bits, dtype, seed=rows + k + n)


def _kernel(case: h.QmmCase, prelude: str = gpu_qmm.CUDA_METAL_PRELUDE,
            name: str = gpu_qmm.QMM_KERNEL_NAME) -> h.CudaKernel:
    """The kernel MLX builds for the operands (with another prelude and name for the broken ones)."""
    launch = gpu_qmm.qmm_launch(case.x, case.w, case.scales, case.biases, case.group_size, case.bits)
    dtype = case.x.dtype
    inputs = list(zip(gpu_qmm.QMM_INPUT_NAMES, (dtype, mx.uint32, dtype, dtype)))
    return h.mlx_cuda_kernel(name, prelude, gpu_qmm.QMM_METAL_BODY, inputs, [("y", dtype)], launch.template)


def _source(rows, k, n, group_size, bits, dtype) -> str:
    return _kernel(_case(rows, k, n, group_size, bits, dtype)).source


# --- 1. the source, and nvcc ------------------------------------------------------------------------------

def test_cuda_source_has_the_metal_body_verbatim():
    src = _source(4, 576, 576, 32, 4, mx.float16)
    assert gpu_qmm.QMM_METAL_BODY in src and gpu_qmm.CUDA_METAL_PRELUDE in src
    assert "__global__ void custom_kernel_mlx_infer_qmm_float16_t_4_4_32_576_576_4_4(\n    const __half* x,\n" in src
    assert "  using T = __half;\n  constexpr int M = 4;\n  constexpr int BITS = 4;\n" in src


def test_cuda_source_compiles_as_mlx_builds_it(tmp_path):
    """One kernel, exactly one module as MLX would JIT it."""
    result = h.nvcc_compile(_source(9, 576, 1536, 32, 4, mx.bfloat16), tmp_path, "one")
    assert result.returncode == 0, result.stderr[-6000:]
    [(name, stack, stores, loads, regs, smem)] = h.ptxas_entries(result.stderr)
    assert "custom_kernel_mlx_infer_qmm" in name
    assert (stack, stores, loads) == (0, 0, 0), "accumulators spilled to local memory"


def test_cuda_instantiations_compile_without_spills(tmp_path):
    """Every dtype, bits 4 / 8, group sizes 32 / 64 / 128, 1 and 16 rows, at the default model's shapes, in one
    unit (MLX's default header and the prelude are include-guarded, so the sources concatenate)."""
    configs = [(rows, k, n, gs, bits, dtype) for dtype in DTYPES for bits in gpu_qmm.QMM_BITS
               for (k, n, gs) in ((576, 49152, 32), (1536, 576, 128), (576, 192, 64)) for rows in (1, 16)]
    h.assert_compiles_without_spills([_source(*c) for c in configs], tmp_path, 48 * 1024)


def test_nvcc_missing_skips_or_fails_as_told(monkeypatch, tmp_path):
    """Without nvcc an nvcc test skips, and fails where $MLX_INFER_REQUIRE_NVCC is 1 (as .ci/run sets it on a
    machine with a CUDA toolkit)."""
    monkeypatch.setattr(h, "nvcc", lambda: None)
    monkeypatch.delenv(h.REQUIRE_NVCC_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="nvcc is not installed"):
        h.nvcc_compile("", tmp_path, "none")
    monkeypatch.setenv(h.REQUIRE_NVCC_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="MLX_INFER_REQUIRE_NVCC=1 says this machine compiles"):
        h.nvcc_compile("", tmp_path, "none")


# --- 2. logic under the CUDA emulator ---------------------------------------------------------------------

#: Emulated cases (rows, K, N, group size, bits, dtype): every dtype, bits and group size; K = 384 is one full
#: 256-value block and a partial one, N = 40 leaves the last of three blocks half empty; and two real shapes.
EMU_CASES = tuple((rows, 384, 40, gs, bits, dtype) for dtype in DTYPES for bits in gpu_qmm.QMM_BITS
                  for gs, rows in zip(gpu_qmm.QMM_GROUP_SIZES, (16, 1, 9) if bits == 4 else (5, 16, 2)))
EMU_CASES += ((5, 576, 192, 32, 4, mx.float16), (1, 1536, 40, 32, 4, mx.bfloat16))
#: The case the broken preludes run: 16 rows, four warps per block, two K blocks.
BROKEN_CASE = (16, 384, 40, 32, 4, mx.float32)
#: Prelude mutations that qmm's words (simd_sum, the lane and warp indices, the barrier) must catch.
BROKEN_PRELUDES = ("simd_sum_over_16_lanes", "lane_index_mod_16", "simdgroups_of_16_threads",
                   "threadgroup_barrier_does_nothing")


def _case_id(c) -> str:
    rows, k, n, gs, bits, dtype = c
    return f"{h.MLX_TYPE_NAMES[dtype]}-b{bits}-g{gs}-m{rows}-{k}x{n}"


def _run_emulated(exe, kernel: h.CudaKernel, case: h.QmmCase) -> np.ndarray:
    """y of the emulated kernel, in x's dtype (bfloat16 as uint16)."""
    launch = gpu_qmm.qmm_launch(case.x, case.w, case.scales, case.biases, case.group_size, case.bits)
    arrays = (case.x, case.w, case.scales, case.biases)
    inputs = {name: h.to_numpy(a) for name, a in zip(gpu_qmm.QMM_INPUT_NAMES, arrays)}
    out = h.run_emulated(exe, kernel, inputs, {"y": (launch.output_shape, NP_OUT[case.x.dtype])}, launch.grid,
                         launch.threadgroup)
    return out["y"]


@pytest.fixture(scope="module")
def emulated():
    """The CUDA source of every emulated case in one emulator executable: (exe, {case: operands},
    {case: CudaKernel})."""
    cases = {c: _case(*c) for c in EMU_CASES}
    kernels = {c: _kernel(case) for c, case in cases.items()}
    assert len({k.name for k in kernels.values()}) == len(EMU_CASES), "each case is its own instantiation"
    return h.build_cuda_emulator(list(kernels.values())), cases, kernels


@needs_emulator
@pytest.mark.parametrize("c", EMU_CASES, ids=_case_id)
def test_emulated_cuda_kernel_matches_reference(emulated, c):
    exe, cases, kernels = emulated
    h.assert_close_to_oracle(_run_emulated(exe, kernels[c], cases[c]), cases[c], "emulated cuda " + _case_id(c))


@needs_emulator
@pytest.mark.parametrize("mutation", BROKEN_PRELUDES)
def test_emulation_catches_a_broken_prelude(emulated, mutation):
    """The prelude with a one-line logic error (gpu_helpers.PRELUDE_MUTATIONS; simd_sum_over_16_lanes is the
    reduction over 16 lanes instead of 32 that passed CI before) gives outputs far off the oracle, where the
    intact prelude's are within the bound."""
    exe, cases, kernels = emulated
    case = cases[BROKEN_CASE]
    assert h.max_error_ratio(_run_emulated(exe, kernels[BROKEN_CASE], case), case) <= 1.0
    broken = _kernel(case, h.mutated_prelude(gpu_qmm.CUDA_METAL_PRELUDE, mutation), name=f"broken_{mutation}")
    ratio = h.max_error_ratio(_run_emulated(h.build_cuda_emulator([broken]), broken, case), case)
    assert ratio > 100.0, f"the emulator did not catch the prelude mutation {mutation} (error {ratio:.3g}x the bound)"


@needs_emulator
def test_emulation_reports_a_partial_warp_mask():
    """A shuffle whose member mask leaves out lanes that call it is undefined on a GPU: an emulation error."""
    case = _case(*BROKEN_CASE)
    broken = _kernel(case, h.mutated_prelude(gpu_qmm.CUDA_METAL_PRELUDE, "simd_sum_with_a_half_warp_mask"),
                     name="broken_mask")
    with pytest.raises(AssertionError, match="__shfl_xor_sync with mask 65535: only full-warp masks"):
        _run_emulated(h.build_cuda_emulator([broken]), broken, case)


#: Plain CUDA (no prelude) checking the emulator's rules, for thread t of a 64-thread block: out[t, 0] from
#: __shfl_sync of lane + 33 (taken modulo the width), out[t, 1] from __shfl_down_sync by 3 (lanes past the end
#: keep their own), out[t, 2] from __shfl_xor_sync with 5, out[t, 3] the sum of a __shared__ array every thread
#: wrote one element of before __syncthreads.
LANE_RULES_BODY = """
__shared__ float seen[64];
const unsigned int t = threadIdx.x;
const float v = a[blockIdx.x * blockDim.x + t];
seen[t] = v;
__syncthreads();
float total = 0.0f;
for (int i = 0; i < 64; ++i) {
  total += seen[i];
}
out[4 * t + 0] = __shfl_sync(0xffffffffu, v, int(t % 32u) + 33);
out[4 * t + 1] = __shfl_down_sync(0xffffffffu, v, 3u);
out[4 * t + 2] = __shfl_xor_sync(0xffffffffu, v, 5);
out[4 * t + 3] = total;
"""
#: Lane 7 returns before a full-warp shuffle the other lanes reach.
EARLY_RETURN_BODY = """
if (threadIdx.x == 7u) { return; }
out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, a[threadIdx.x], 1);
"""


@needs_emulator
def test_emulator_follows_cuda_lane_rules():
    a = np.arange(1.0, 65.0, dtype=np.float32)
    kernels = [h.mlx_cuda_kernel(name, "", body, [("a", mx.float32)], [("out", mx.float32)], [])
               for name, body in (("lane_rules", LANE_RULES_BODY), ("early_return", EARLY_RETURN_BODY))]
    exe = h.build_cuda_emulator(kernels)
    out = h.run_emulated(exe, kernels[0], {"a": a}, {"out": ((64, 4), np.float32)}, (64, 1, 1), (64, 1, 1))["out"]
    t = np.arange(64)
    warp, lane = t // 32 * 32, t % 32
    np.testing.assert_array_equal(out[:, 0], a[warp + (lane + 1) % 32])
    np.testing.assert_array_equal(out[:, 1], np.where(lane + 3 < 32, a[np.minimum(t + 3, 63)], a))
    np.testing.assert_array_equal(out[:, 2], a[warp + (lane ^ 5)])
    np.testing.assert_array_equal(out[:, 3], np.full(64, a.sum()))
    with pytest.raises(AssertionError, match="__shfl_xor_sync with a full mask, but lane 7 has returned"):
        h.run_emulated(exe, kernels[1], {"a": a}, {"out": ((32,), np.float32)}, (32, 1, 1), (32, 1, 1))


# --- 3. on a CUDA device ----------------------------------------------------------------------------------

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
