"""The Metal quantized skinny matmul (metal_kernels/qmm.metal through mlx_infer.kernels.gpu_qmm), checked on a
machine without Metal:

1. golden source: the Metal source MLX generates for the kernel object (printed by a verbose call inside
   mx.export_function tracing) compiles with g++ against metal_kernels/host/metal_shim.h, for every
   template instantiation the default model uses (its five matmul shapes, 1-16 rows, 3 dtypes, bits 4 / 8,
   group sizes 32 / 64 / 128), with the signature MLX is expected to write;
2. logic: that same source runs under the Metal execution-model emulator (metal_emu.h: threadgroups of
   fibers, real barriers, SIMD-group collectives over 32 lanes, shared threadgroup memory) and matches a
   float64 oracle built from MLX's dequantization, and mx.quantized_matmul; bodies broken on purpose (a
   missing barrier, a 16-lane reduction) must fail the same check;
3. where Metal is the default device, the kernel itself matches the oracle.

Tolerance (all dtypes): |y - y64| <= (1 + eps) * 1e-5 * (|W| @ |x|) + eps * |y64| elementwise, where y64 is
the float64 product of MLX's float32 dequantized weights and x, and eps the output dtype's unit roundoff
(2^-24, 2^-11, 2^-8): float32 accumulation error plus one rounding to the output dtype.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from mlx_infer.errors import MlxInferError
from mlx_infer.kernels import gpu_qmm

#: The default model's (K, N) matmul shapes: q/o proj, k/v proj, gate/up, down, tied lm_head.
MODEL_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
#: Emulated shapes: K = 384 is one full 256-value block and a partial one; N = 40 leaves the last of the
#: three threadgroups (16 columns each) half empty.
EMU_K, EMU_N = 384, 40

DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
NP_OUT = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}

needs_gxx = pytest.mark.skipif(h.gxx() is None, reason="the golden-source checks compile with g++, absent here")
needs_emulator = pytest.mark.skipif(h.EMULATOR_MISSING is not None, reason=f"emulator: {h.EMULATOR_MISSING}")


def _emu_cases():
    cases = set()
    for rows in range(1, gpu_qmm.QMM_MAX_ROWS + 1):
        cases.add((rows, EMU_K, EMU_N, 32, 4, "f32"))
        cases.add((rows, EMU_K, EMU_N, 64, 8, "f16"))
    for dtype in DTYPES:
        for bits in gpu_qmm.QMM_BITS:
            for gs in gpu_qmm.QMM_GROUP_SIZES:
                for rows in (2, 9):
                    cases.add((rows, EMU_K, EMU_N, gs, bits, dtype))
    cases.add((16, EMU_K, EMU_N, 128, 4, "bf16"))
    cases.add((5, 576, 192, 32, 4, "f16"))    # a real shape: the k/v projection of a GGUF-loaded model
    cases.add((1, 1536, 40, 32, 4, "bf16"))   # K of the down projection: six full blocks
    return sorted(cases, key=lambda c: (c[5], c[4], c[3], c[0], c[1]))


EMU_CASES = _emu_cases()


def _case_id(c):
    rows, k, n, gs, bits, dtype = c
    return f"{dtype}-b{bits}-g{gs}-m{rows}-{k}x{n}"


def _operands(c, seed=0) -> h.QmmCase:
    rows, k, n, gs, bits, dtype = c
    return h.random_case(rows, k, n, gs, bits, DTYPES[dtype], seed=seed + 7919 * rows + k + n + gs + bits)


def _call(kernel, case: h.QmmCase, verbose=True):
    """A call of a metal_kernel object with the launch gpu_qmm computes for the operands."""
    launch = gpu_qmm.qmm_launch(case.x, case.w, case.scales, case.biases, case.group_size, case.bits)
    return kernel(inputs=[case.x, case.w, case.scales, case.biases], template=list(launch.template),
                  grid=launch.grid, threadgroup=launch.threadgroup, output_shapes=[launch.output_shape],
                  output_dtypes=[launch.output_dtype], verbose=verbose)[0]


def _golden_for(kernel, case: h.QmmCase) -> h.GoldenKernel:
    return h.golden_metal_sources([lambda: _call(kernel, case)])[0]


# Bodies broken on purpose: each must make the emulated result disagree with the oracle.
BARRIER = "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);"
REDUCTION = "const float total = metal::simd_sum(acc[c][m]);"
HALF_REDUCTION = ("float total = acc[c][m];\n"
                  "    for (ushort offset = 8; offset > 0; offset >>= 1) {\n"
                  "      total += metal::simd_shuffle_xor(total, offset);\n"
                  "    }")


def _without_nth(text: str, needle: str, n: int) -> str:
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    assert len(starts) == 3 and n < len(starts), "the body's barriers changed: update the broken fixtures"
    return text[:starts[n]] + text[starts[n] + len(needle):]


BROKEN_BODIES = {
    "no_barrier_after_staging": lambda body: _without_nth(body, BARRIER, 0),
    "no_barrier_before_restaging": lambda body: _without_nth(body, BARRIER, 2),
    "reduction_over_16_lanes": lambda body: body.replace(REDUCTION, HALF_REDUCTION),
}
BROKEN_CASE = (16, EMU_K, EMU_N, 32, 4, "f32")

# A kernel whose thread 0 leaves before a barrier the others wait at: the emulator must report it.
EARLY_RETURN_BODY = """
if (thread_index_in_threadgroup == 0) { return; }
threadgroup float shared_value[1];
shared_value[0] = 1.0f;
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
out[thread_position_in_grid.x] = shared_value[0];
"""


# A kernel reading one element past the end of its input: the emulator's guard page must stop it.
PAST_THE_END_BODY = "out[thread_position_in_grid.x] = a[thread_position_in_grid.x + 1];"


@pytest.fixture(scope="module")
def emulated():
    """Golden sources of every emulated case, of the broken bodies and of the early-return and past-the-end
    kernels, built into one emulator executable: (exe, {case: operands}, {case: GoldenKernel},
    {broken name: GoldenKernel}, (early-return GoldenKernel, past-the-end GoldenKernel))."""
    cases = {c: _operands(c) for c in EMU_CASES}
    kernel = gpu_qmm.metal_kernel()
    golden = dict(zip(EMU_CASES, h.golden_metal_sources([lambda o=o: _call(kernel, o) for o in cases.values()])))
    assert len(golden) == len(EMU_CASES), "each case is its own instantiation"
    broken = {}
    for name, edit in BROKEN_BODIES.items():
        body = edit(gpu_qmm.QMM_METAL_BODY)
        assert body != gpu_qmm.QMM_METAL_BODY
        bad = mx.fast.metal_kernel(name=f"broken_{name}", input_names=list(gpu_qmm.QMM_INPUT_NAMES),
                                   output_names=list(gpu_qmm.QMM_OUTPUT_NAMES), source=body)
        broken[name] = _golden_for(bad, cases[BROKEN_CASE])
    early_kernel = mx.fast.metal_kernel(name="early_return", input_names=["a"], output_names=["out"],
                                        source=EARLY_RETURN_BODY)
    early = h.golden_metal_sources([lambda: early_kernel(
        inputs=[mx.zeros((64,))], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1),
        threadgroup=(64, 1, 1), verbose=True)[0]])[0]
    past_kernel = mx.fast.metal_kernel(name="past_the_end", input_names=["a"], output_names=["out"],
                                       source=PAST_THE_END_BODY)
    past = h.golden_metal_sources([lambda: past_kernel(
        inputs=[mx.zeros((64,))], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(64, 1, 1),
        threadgroup=(32, 1, 1), verbose=True)[0]])[0]
    exe = h.build_emulator(list(golden.values()) + list(broken.values()) + [early, past])
    return exe, cases, golden, broken, (early, past)


def _run_qmm(exe, golden: h.GoldenKernel, case: h.QmmCase) -> np.ndarray:
    launch = gpu_qmm.qmm_launch(case.x, case.w, case.scales, case.biases, case.group_size, case.bits)
    inputs = {"x": h.to_numpy(case.x), "w": h.to_numpy(case.w), "scales": h.to_numpy(case.scales),
              "biases": h.to_numpy(case.biases)}
    out = h.run_emulated(exe, golden, inputs, {"y": (launch.output_shape, NP_OUT[case.x.dtype])},
                         launch.grid, launch.threadgroup)
    return out["y"]


# --- 1. golden source ---------------------------------------------------------------------------------

def test_export_function_prints_the_generated_metal_source(tmp_path):
    """The trick the golden source rests on, on this MLX: a verbose call traced by mx.export_function prints
    the full Metal source to the process's stdout (file descriptor 1), with no Metal back-end."""
    case = _operands((3, 576, 192, 32, 4, "f16"))
    text = h.capture_fd_stdout(lambda: mx.export_function(
        str(tmp_path / "f.mlxfn"), lambda _: [_call(gpu_qmm.metal_kernel(), case)], mx.zeros((1,))))
    assert text.startswith("Generated source code for `mlx_infer_qmm`:\n```\n")
    golden = _golden_for(gpu_qmm.metal_kernel(), case)
    assert golden.source in text
    assert "[[kernel]] void custom_kernel_mlx_infer_qmm_" in golden.source
    assert gpu_qmm.QMM_METAL_BODY.strip() in golden.source
    assert f"[[host_name(\"{golden.name}\")]]" in golden.source
    assert golden.template_args == "<float16_t, 3, 4, 32, 576, 192, 4, 4>"


def test_golden_signature_is_the_one_the_body_expects():
    golden = _golden_for(gpu_qmm.metal_kernel(), _operands((9, 576, 1536, 64, 8, "bf16")))
    assert golden.template_decl == "template <typename T, int M, int BITS, int GS, int K, int N, int NSG, int COLS>"
    buffers = [(p.type, p.name, p.attr) for p in golden.params if p.is_buffer]
    assert buffers == [("const device bfloat16_t*", "x", "buffer(0)"), ("const device uint32_t*", "w", "buffer(1)"),
                       ("const device bfloat16_t*", "scales", "buffer(2)"),
                       ("const device bfloat16_t*", "biases", "buffer(3)"), ("device bfloat16_t*", "y", "buffer(4)")]
    attributes = [(p.type, p.name) for p in golden.params if not p.is_buffer]
    assert attributes == [("uint", "simdgroup_index_in_threadgroup"), ("uint", "thread_index_in_simdgroup"),
                          ("uint", "thread_index_in_threadgroup"), ("uint3", "threadgroup_position_in_grid")]
    assert all(p.attr == p.name and p.name in h.METAL_THREAD_ATTRIBUTES for p in golden.params if not p.is_buffer)
    # Every attribute in the source is one Metal knows (g++ only warns about unknown ones).
    for attr in re.findall(r"\[\[(\w+)", golden.source):
        assert attr in h.METAL_THREAD_ATTRIBUTES | {"kernel", "buffer", "host_name"}, attr


@needs_gxx
def test_golden_sources_compile_against_the_shim(tmp_path):
    kernel = gpu_qmm.metal_kernel()
    configs = [(rows, k, n, gs, bits, dtype) for (k, n) in MODEL_SHAPES for rows in (1, 9, 16) for dtype in DTYPES
               for (bits, gs) in ((4, 32), (8, 64), (4, 128)) if k % gs == 0]
    operands = [_operands(c) for c in configs]
    golden = h.golden_metal_sources([lambda o=o: _call(kernel, o) for o in operands])
    assert len(golden) == len(configs)
    result = h.compile_shim_syntax(golden, tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]


@needs_gxx
def test_shim_compile_catches_errors(tmp_path):
    """The syntax check can fail: a body naming an undeclared variable, or using double (poisoned)."""
    case = _operands((2, 576, 192, 32, 4, "f32"))
    for bad_edit in (lambda b: b.replace("acc[c][m] += sq * xv[m];", "acc[c][m] += sq * xw[m];"),
                     lambda b: b.replace("float sum = 0.0f;", "double sum = 0.0;")):
        body = bad_edit(gpu_qmm.QMM_METAL_BODY)
        assert body != gpu_qmm.QMM_METAL_BODY
        bad = mx.fast.metal_kernel(name="typo", input_names=list(gpu_qmm.QMM_INPUT_NAMES),
                                   output_names=list(gpu_qmm.QMM_OUTPUT_NAMES), source=body)
        result = h.compile_shim_syntax([_golden_for(bad, case)], tmp_path)
        assert result.returncode != 0


# --- 2. logic under the emulator ----------------------------------------------------------------------

@needs_emulator
@pytest.mark.parametrize("c", EMU_CASES, ids=_case_id)
def test_emulated_kernel_matches_reference(emulated, c):
    exe, cases, golden, _, _ = emulated
    case = cases[c]
    y = _run_qmm(exe, golden[c], case)
    h.assert_close_to_oracle(y, case, _case_id(c))
    # And MLX's own op: within 1e-6 (float32) / 5% (float16, bfloat16: MLX's CPU op rounds to x's dtype on
    # the way, so it is the less accurate of the two: the kernel must be at least as near the oracle).
    ref = mx.quantized_matmul(case.x, case.w, case.scales, case.biases, transpose=True,
                              group_size=case.group_size, bits=case.bits)
    mine = h.as_float64(y, case.x.dtype)
    theirs = h.as_float64(h.to_numpy(ref), case.x.dtype)
    exact = h.oracle(case)[0]
    rel = np.linalg.norm(mine - theirs) / np.linalg.norm(theirs)
    if case.x.dtype == mx.float32:
        assert rel < 1e-6, rel
    else:
        assert rel < 0.05, rel
        assert np.linalg.norm(mine - exact) <= np.linalg.norm(theirs - exact)


@needs_emulator
@pytest.mark.parametrize("name", sorted(BROKEN_BODIES))
def test_emulation_catches_a_broken_body(emulated, name):
    exe, cases, golden, broken, _ = emulated
    case = cases[BROKEN_CASE]
    good = _run_qmm(exe, golden[BROKEN_CASE], case)
    assert h.max_error_ratio(good, case) <= 1.0
    bad = _run_qmm(exe, broken[name], case)
    assert h.max_error_ratio(bad, case) > 100.0, f"the emulator did not catch the broken body {name}"


@needs_emulator
def test_emulation_reports_a_barrier_not_all_threads_reach(emulated):
    exe, _, _, _, (early, _) = emulated
    with pytest.raises(AssertionError, match="returned while 63 wait at threadgroup_barrier"):
        h.run_emulated(exe, early, {"a": np.zeros(64, np.float32)}, {"out": ((64,), np.float32)}, (64, 1, 1),
                       (64, 1, 1))


@needs_emulator
def test_emulation_stops_a_read_past_the_end_of_a_buffer(emulated):
    exe, _, _, _, (_, past) = emulated
    with pytest.raises(AssertionError, match="guard page"):
        h.run_emulated(exe, past, {"a": np.zeros(64, np.float32)}, {"out": ((64,), np.float32)}, (64, 1, 1),
                       (32, 1, 1))


# --- launch parameters and errors ---------------------------------------------------------------------

def test_launch_counts_threads_and_covers_every_column():
    case = _operands((4, 576, 49152, 32, 4, "f16"))
    launch = gpu_qmm.qmm_launch(case.x, case.w, case.scales, case.biases, 32, 4)
    threads = launch.threadgroup[0]
    assert launch.threadgroup == (gpu_qmm.SIMD_WIDTH * gpu_qmm.QMM_SIMD_GROUPS, 1, 1)
    assert launch.grid[0] % threads == 0 and launch.grid[1:] == (1, 1)
    columns = launch.grid[0] // threads * gpu_qmm.QMM_SIMD_GROUPS * gpu_qmm.QMM_COLUMNS_PER_SIMD_GROUP
    assert 49152 <= columns < 49152 + gpu_qmm.QMM_SIMD_GROUPS * gpu_qmm.QMM_COLUMNS_PER_SIMD_GROUP
    assert launch.output_shape == (4, 49152) and launch.output_dtype == mx.float16


@pytest.mark.parametrize("edit, message", [
    (dict(bits=3), "bits=3"),
    (dict(group_size=16), "group_size=16"),
    (dict(x=mx.zeros((17, 64))), "1 <= M <= 16"),
    (dict(x=mx.zeros((2, 64), dtype=mx.int32)), "dtype"),
    (dict(w=mx.zeros((8, 4), dtype=mx.uint32)), "w must be uint32"),
    (dict(scales=mx.zeros((8, 2), dtype=mx.float16)), "scales must be"),
    (dict(biases=mx.zeros((8, 1))), "biases must be"),
])
def test_bad_operands_raise_one_line(edit, message):
    args = dict(x=mx.zeros((2, 64)), w=mx.zeros((8, 8), dtype=mx.uint32), scales=mx.zeros((8, 2)),
                biases=mx.zeros((8, 2)), group_size=32, bits=4)
    args.update(edit)
    with pytest.raises(MlxInferError, match=re.escape(message)) as info:
        gpu_qmm.qmm_launch(**args)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(gpu_qmm.metal_available(), reason="Metal is the default device here")
def test_metal_qmm_refuses_without_metal():
    case = _operands((2, 576, 192, 32, 4, "f32"))
    with pytest.raises(RuntimeError, match="Metal"):
        gpu_qmm.metal_qmm(case.x, case.w, case.scales, case.biases, 32, 4)


# --- 3. on a real Metal device ------------------------------------------------------------------------

@pytest.mark.skipif(not gpu_qmm.metal_available(), reason="needs MLX on Metal with the GPU as default device")
@pytest.mark.parametrize("c", [(rows, k, n, gs, bits, dtype) for (k, n) in MODEL_SHAPES for rows in (1, 4, 9, 16)
                               for (gs, bits, dtype) in ((32, 4, "f16"), (64, 8, "bf16"), (128, 4, "f32"))
                               if k % gs == 0],
                         ids=_case_id)
def test_metal_device_matches_reference(c):
    case = _operands(c)
    y = gpu_qmm.metal_qmm(case.x, case.w, case.scales, case.biases, case.group_size, case.bits)
    h.assert_close_to_oracle(h.to_numpy(y), case, _case_id(c))
