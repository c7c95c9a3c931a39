"""The CUDA twin of RMM's reduced quantized matmul: the Metal body of metal_kernels/rmm_qmm.metal behind
cuda_kernels/metal_prelude.cuh, in the form `mx.fast.cuda_kernel` builds it (gpu_helpers.mlx_cuda_source),
checked as test_cuda_qmm.py checks qmm:

1. compiled by nvcc for sm_90 against the stand-in for MLX's device header (cuda_kernels/host), with no spills;
2. logic: that same source under the CUDA emulator (cuda_kernels/host/cuda_emu.h) matches the float64 oracle of
   x with each row's dropped groups zeroed (selection: mlx_infer.kernels.rmm.group_mask; tolerance as in
   test_metal_qmm.py), with the groups no row keeps poisoned (garbage words, NaN scales and biases); the prelude
   broken on purpose (simd_sum over 16 lanes, a barrier that does nothing) must fail;
3. where MLX's CUDA back-end is the default device, the kernel's outputs match the same oracle.
"""

import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from mlx_infer.kernels import gpu_qmm, gpu_rmm

needs_emulator = pytest.mark.skipif(h.EMULATOR_MISSING is not None, reason=f"emulator: {h.EMULATOR_MISSING}")

DTYPES = h.ATTN_DTYPES
NP_OUT = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}
#: The default model's (K, N) matmul shapes.
MODEL_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


def _kernel(x: mx.array, w: mx.array, scales: mx.array, group_size: int, bits: int, keep: int,
            prelude: str = gpu_qmm.CUDA_METAL_PRELUDE, name: str = gpu_rmm.RMM_KERNEL_NAME) -> h.CudaKernel:
    """The kernel MLX builds for operands of these shapes and dtypes (with another prelude and name for the
    broken ones)."""
    launch = gpu_rmm.rmm_launch(x, w, scales, scales, group_size, bits, keep)
    inputs = list(zip(gpu_rmm.RMM_INPUT_NAMES, (x.dtype, mx.uint32, x.dtype, x.dtype)))
    return h.mlx_cuda_kernel(name, prelude, gpu_rmm.RMM_METAL_BODY, inputs, [("y", x.dtype)], launch.template)


def _source(rows, k, n, group_size, bits, dtype, keep):
    x = mx.zeros((rows, k), dtype=DTYPES[dtype])
    w = mx.zeros((n, k * bits // 32), dtype=mx.uint32)
    s = mx.zeros((n, k // group_size), dtype=DTYPES[dtype])
    return _kernel(x, w, s, group_size, bits, keep).source


def test_cuda_source_has_the_metal_body_verbatim():
    src = _source(4, 576, 576, 32, 4, "f16", 9)
    assert gpu_rmm.RMM_METAL_BODY in src and gpu_qmm.CUDA_METAL_PRELUDE in src
    assert ("__global__ void custom_kernel_mlx_infer_rmm_qmm_float16_t_4_4_32_576_576_4_4_9(\n"
            "    const __half* x,\n") in src
    assert "  constexpr int COLS = 4;\n  constexpr int KEEP = 9;\n" in src


def test_cuda_source_compiles_as_mlx_builds_it(tmp_path):
    """One kernel, exactly one module as MLX would JIT it."""
    result = h.nvcc_compile(_source(9, 576, 1536, 32, 4, "bf16", 9), tmp_path, "one")
    assert result.returncode == 0, result.stderr[-6000:]
    [(name, stack, stores, loads, _, _)] = h.ptxas_entries(result.stderr)
    assert "custom_kernel_mlx_infer_rmm_qmm" in name
    assert (stack, stores, loads) == (0, 0, 0), "accumulators spilled to local memory"


def test_cuda_instantiations_compile_without_spills(tmp_path):
    """Every dtype, bits 4 / 8, group sizes 32 / 64 / 128, 1 and 16 rows, at the default model's shapes and at the
    largest K per group size (256 groups), in one unit."""
    configs = [(rows, k, n, gs, bits, dtype, max(1, k // gs // 2)) for dtype in DTYPES for bits in (4, 8)
               for (k, n, gs) in ((576, 49152, 32), (1536, 576, 128), (576, 192, 64), (8192, 576, 32),
                                  (16384, 576, 64), (32768, 576, 128))
               for rows in (1, 16)]
    h.assert_compiles_without_spills([_source(*c) for c in configs], tmp_path, 32 * 1024)


# --- 2. logic under the CUDA emulator ---------------------------------------------------------------------

#: Emulated cases (rows, K, N, group size, bits, dtype, keep): every dtype, bits and group size, keep 1 to G;
#: K = 384, N = 40 (the last of three blocks half empty), a real shape and the largest K at group size 32.
EMU_CASES = ((3, 384, 40, 32, 4, "f32", 6), (16, 384, 40, 64, 8, "f16", 5), (1, 384, 40, 128, 4, "bf16", 1),
             (3, 384, 40, 32, 8, "bf16", 12), (5, 576, 192, 32, 4, "f16", 9), (3, 8192, 40, 32, 4, "f32", 100))
#: The case the broken preludes run.
BROKEN_CASE = EMU_CASES[0]
BROKEN_PRELUDES = ("simd_sum_over_16_lanes", "threadgroup_barrier_does_nothing")
#: Garbage for the packed words of groups no row keeps.
POISON_WORD = 0xDEADBEEF


def _poisoned(case: h.RmmCase) -> dict:
    """The kernel's inputs (numpy, bfloat16 as uint16) with the groups no row keeps poisoned: packed words
    POISON_WORD, scales and biases NaN."""
    q = case.qmm
    unused = mx.array(~case.used)[None, :]  # [1, G]
    unused_words = mx.repeat(unused, q.group_size * q.bits // 32, axis=1)  # [1, K * bits / 32]
    nan = mx.array(float("nan"), dtype=q.scales.dtype)
    poison = mx.array(POISON_WORD, dtype=mx.uint32)
    return {"x": h.to_numpy(q.x), "w": h.to_numpy(mx.where(unused_words, poison, q.w)),
            "scales": h.to_numpy(mx.where(unused, nan, q.scales)),
            "biases": h.to_numpy(mx.where(unused, nan, q.biases))}


def _case_kernel(case: h.RmmCase, **kwargs) -> h.CudaKernel:
    q = case.qmm
    return _kernel(q.x, q.w, q.scales, q.group_size, q.bits, case.keep, **kwargs)


def _run_emulated(exe, kernel: h.CudaKernel, case: h.RmmCase) -> np.ndarray:
    q = case.qmm
    launch = gpu_rmm.rmm_launch(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    out = h.run_emulated(exe, kernel, _poisoned(case), {"y": (launch.output_shape, NP_OUT[q.x.dtype])}, launch.grid,
                         launch.threadgroup)
    return out["y"]


@pytest.fixture(scope="module")
def emulated():
    """Every emulated case's CUDA source in one emulator executable: (exe, {case: h.RmmCase},
    {case: CudaKernel})."""
    cases = {c: h.rmm_case(c) for c in EMU_CASES}
    kernels = {c: _case_kernel(case) for c, case in cases.items()}
    assert len({k.name for k in kernels.values()}) == len(EMU_CASES), "each case is its own instantiation"
    return h.build_cuda_emulator(list(kernels.values())), cases, kernels


@needs_emulator
@pytest.mark.parametrize("c", EMU_CASES, ids=h.rmm_case_id)
def test_emulated_cuda_kernel_matches_reference(emulated, c):
    exe, cases, kernels = emulated
    case = cases[c]
    h.assert_close_to_oracle(_run_emulated(exe, kernels[c], case), case.masked(), "emulated cuda " + h.rmm_case_id(c))


@needs_emulator
@pytest.mark.parametrize("mutation", BROKEN_PRELUDES)
def test_emulation_catches_a_broken_prelude(emulated, mutation):
    exe, cases, kernels = emulated
    case = cases[BROKEN_CASE]
    assert h.max_error_ratio(_run_emulated(exe, kernels[BROKEN_CASE], case), case.masked()) <= 1.0
    broken = _case_kernel(case, prelude=h.mutated_prelude(gpu_qmm.CUDA_METAL_PRELUDE, mutation),
                          name=f"broken_{mutation}")
    ratio = h.max_error_ratio(_run_emulated(h.build_cuda_emulator([broken]), broken, case), case.masked())
    assert ratio > 100.0, f"the emulator did not catch the prelude mutation {mutation} (error {ratio:.3g}x the bound)"


# --- 3. on a CUDA device ----------------------------------------------------------------------------------

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
