"""The Metal reduced quantized matmul (RMM: metal_kernels/rmm_qmm.metal through mlx_infer.kernels.gpu_rmm),
checked on a machine without Metal, against the oracle of mlx_infer.kernels.rmm (group_mask: the selection,
reference_rmm_qmm: the product):

1. golden source: the Metal source MLX generates for the kernel object (a verbose call inside
   mx.export_function tracing) compiles with g++ against metal_kernels/host/metal_shim.h for the default
   model's shapes and the largest K the kernel takes, with the signature and template MLX is expected to write;
2. logic: that source runs under the Metal execution-model emulator (metal_emu.h) and matches the float64
   oracle of x with the dropped groups zeroed (group_mask), and reference_rmm_qmm, for 1, 3 and 16 rows, bits
   4 / 8, group sizes 32 / 64 / 128, keep 1, G/2, G-1 and G, on activations built with exact ties between
   group scores (every |x| sum is exact in float32, so the kernel's scores equal the oracle's bit for bit and
   the tie rule decides); in every run the packed words, scales and biases of the groups no row keeps are
   poisoned (garbage words, NaN scales and biases), and for two large shapes whole pages of them are made
   unreadable, so a read faults; bodies broken on purpose (tie rule reversed, union of one row, rows not
   masked, no skipping, |x| dropped, a missing barrier) must fail;
3. where Metal is the default device, the kernel itself matches the oracle.

Tolerance as in test_metal_qmm.py: |y - y64| <= (1 + eps) * 1e-5 * (|W| @ |x_kept|) + eps * |y64| elementwise.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from mlx_infer.errors import MlxInferError
from mlx_infer.kernels import gpu_rmm
from mlx_infer.kernels.rmm import reference_rmm_qmm

NP_OUT = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}
#: The default model's (K, N) matmul shapes: q/o proj, k/v proj, gate/up, down, tied lm_head.
MODEL_SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))
#: Emulated shapes: K = 384 (12, 6 or 3 groups; the used groups fill one or two 256-value blocks); N = 40
#: leaves the last of three threadgroups (16 columns each) half empty.
EMU_K, EMU_N = 384, 40
#: (group size, bits, dtype) of the emulated sweep.
EMU_CONFIGS = ((32, 4, "f32"), (64, 8, "f16"), (128, 4, "bf16"), (32, 8, "bf16"), (64, 4, "f32"), (128, 8, "f16"))
#: Garbage for the packed words of groups no row keeps.
POISON_WORD = 0xDEADBEEF

needs_gxx = pytest.mark.skipif(h.gxx() is None, reason="the golden-source checks compile with g++, absent here")
needs_emulator = pytest.mark.skipif(h.EMULATOR_MISSING is not None, reason=f"emulator: {h.EMULATOR_MISSING}")


def _poisoned(case: h.RmmCase) -> dict:
    """The kernel's inputs (numpy, bfloat16 as uint16) with the groups no row keeps poisoned: packed words
    POISON_WORD, scales and biases NaN. A kernel reading them gives NaN or garbage."""
    q = case.qmm
    unused = mx.array(~case.used)[None, :]  # [1, G]
    words_per_group = q.group_size * q.bits // 32
    unused_words = mx.repeat(unused, words_per_group, axis=1)  # [1, K * bits / 32]
    nan = mx.array(float("nan"), dtype=q.scales.dtype)
    return {"x": h.to_numpy(q.x),
            "w": h.to_numpy(mx.where(unused_words, mx.array(POISON_WORD, dtype=mx.uint32), q.w)),
            "scales": h.to_numpy(mx.where(unused, nan, q.scales)),
            "biases": h.to_numpy(mx.where(unused, nan, q.biases))}


def _keeps(groups: int):
    return sorted({1, groups // 2, groups - 1, groups} - {0})


def _emu_cases():
    cases = [(rows, EMU_K, EMU_N, gs, bits, dtype, keep) for rows in (1, 3, 16) for (gs, bits, dtype) in EMU_CONFIGS
             for keep in _keeps(EMU_K // gs)]
    cases += [(5, 576, 192, 32, 4, "f16", 9),      # a real shape: the k/v projection of the default model
              (1, 1536, 40, 64, 8, "bf16", 12),    # K of the down projection
              (3, 8192, 40, 32, 4, "f32", 100),    # 256 groups of 32: the largest K at group size 32
              (2, 8192, 40, 32, 8, "bf16", 255)]
    return cases


EMU_CASES = _emu_cases()

#: Large shapes whose unkept groups fill whole pages of w (PAGE_SIZE bytes), which are locked: (case, groups
#: made small in every row, so that no row keeps them). 4 bits at group size 64: 32 bytes a group, 128 groups a
#: page, two pages a row; 8 bits at group size 128: 128 bytes a group, 32 groups a page, four pages a row.
LOCKED_CASES = {(4, 16384, 40, 64, 4, "f16", 64): tuple(range(128, 256)),
                (3, 16384, 40, 128, 8, "f32", 40): tuple(range(32, 64)) + tuple(range(96, 128))}
#: The locked case the no-skipping body is built for.
LOCKED_BROKEN_CASE = (3, 16384, 40, 128, 8, "f32", 40)


def _call(kernel, case: h.RmmCase, verbose=True):
    """A call of a metal_kernel object with the launch gpu_rmm computes for the operands."""
    q = case.qmm
    launch = gpu_rmm.rmm_launch(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    return kernel(inputs=[q.x, q.w, q.scales, q.biases], template=list(launch.template), grid=launch.grid,
                  threadgroup=launch.threadgroup, output_shapes=[launch.output_shape],
                  output_dtypes=[launch.output_dtype], verbose=verbose)[0]


def _golden_for(kernel, case: h.RmmCase) -> h.GoldenKernel:
    return h.golden_metal_sources([lambda: _call(kernel, case)])[0]


# Bodies broken on purpose: each must make the emulated result disagree with the oracle (or fault).
BARRIER = "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);"


def _without_first(text: str, needle: str) -> str:
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    assert len(starts) == 7, "the body's barriers changed: update the broken fixtures"
    return text[:starts[0]] + text[starts[0] + len(needle):]


def _replace_once(old: str, new: str):
    def edit(body: str) -> str:
        assert body.count(old) == 1, f"{old!r} is not in the body once: update the broken fixtures"
        return body.replace(old, new)
    return edit


BROKEN_BODIES = {
    "tie_rule_reversed": _replace_once("(t == s && h < g)", "(t == s && h > g)"),
    "union_of_row_0": _replace_once("u |= kept[m * KG + g];", "u |= kept[g];"),
    "rows_not_masked": _replace_once("if (kept[m * KG + g] != 0) {", "if (true) {"),
    "no_skipping": _replace_once("used[g] = u;", "used[g] = 1;"),
    "score_without_abs": _replace_once("s += metal::abs(float(x[m * K + g * GS + j]));",
                                       "s += float(x[m * K + g * GS + j]);"),
    "no_barrier_after_scores": lambda body: _without_first(body, BARRIER),
}
BROKEN_CASE = (3, EMU_K, EMU_N, 32, 4, "f32", 6)


@pytest.fixture(scope="module")
def emulated():
    """Golden sources of every emulated and locked case and of the broken bodies, in one emulator executable:
    (exe, {case: h.RmmCase}, {case: GoldenKernel}, {broken name: GoldenKernel}); the broken bodies are built for
    BROKEN_CASE, and the no-skipping one also for LOCKED_BROKEN_CASE (as "locked_no_skipping")."""
    cases = {c: h.rmm_case(c) for c in EMU_CASES}
    cases.update({c: h.rmm_case(c, kinds=("levels", "random"), small_groups=small)
                  for c, small in LOCKED_CASES.items()})
    kernel = gpu_rmm.metal_kernel()
    golden = dict(zip(cases, h.golden_metal_sources([lambda o=o: _call(kernel, o) for o in cases.values()])))
    assert len(golden) == len(cases), "each case is its own instantiation"
    broken = {}
    for name, edit in BROKEN_BODIES.items():
        body = edit(gpu_rmm.RMM_METAL_BODY)
        assert body != gpu_rmm.RMM_METAL_BODY
        bad = mx.fast.metal_kernel(name=f"broken_rmm_{name}", input_names=list(gpu_rmm.RMM_INPUT_NAMES),
                                   output_names=list(gpu_rmm.RMM_OUTPUT_NAMES), source=body)
        broken[name] = _golden_for(bad, cases[BROKEN_CASE])
    bad = mx.fast.metal_kernel(name="broken_rmm_locked_no_skipping", input_names=list(gpu_rmm.RMM_INPUT_NAMES),
                               output_names=list(gpu_rmm.RMM_OUTPUT_NAMES),
                               source=BROKEN_BODIES["no_skipping"](gpu_rmm.RMM_METAL_BODY))
    broken["locked_no_skipping"] = _golden_for(bad, cases[LOCKED_BROKEN_CASE])
    exe = h.build_emulator(list(golden.values()) + list(broken.values()))
    return exe, cases, golden, broken


def _run(exe, golden: h.GoldenKernel, case: h.RmmCase, locked=None) -> np.ndarray:
    q = case.qmm
    launch = gpu_rmm.rmm_launch(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    out = h.run_emulated(exe, golden, _poisoned(case), {"y": (launch.output_shape, NP_OUT[q.x.dtype])}, launch.grid,
                         launch.threadgroup, locked=locked)
    return out["y"]


def _locked_pages(case: h.RmmCase):
    """The byte ranges of w (whole pages) that hold only groups no row keeps."""
    q = case.qmm
    n, kw = q.w.shape
    row_bytes = kw * 4
    group_bytes = q.group_size * q.bits // 8
    per_page = h.PAGE_SIZE // group_bytes
    assert row_bytes % h.PAGE_SIZE == 0
    pages = [p for p in range(row_bytes // h.PAGE_SIZE) if not case.used[p * per_page:(p + 1) * per_page].any()]
    assert pages, "the locked case has no page of unused groups"
    return [(row * row_bytes + p * h.PAGE_SIZE, h.PAGE_SIZE) for row in range(n) for p in pages]


def _check_against_reference(y: np.ndarray, case: h.RmmCase, label: str) -> None:
    """y within the float64 oracle's bound, and near reference_rmm_qmm (MLX's op): up to K = 1536 as
    test_metal_qmm.py checks (relative 1e-6 for float32, 5% for float16 / bfloat16), beyond it 1e-5 for float32
    (float32 accumulation over more terms) and no bound for float16 / bfloat16 (MLX's CPU op rounds to x's dtype
    on the way, so its error grows with K); for float16 / bfloat16 y is nearer the oracle than MLX's op."""
    masked = case.masked()
    h.assert_close_to_oracle(y, masked, label)
    q = case.qmm
    ref = reference_rmm_qmm(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    mine = h.as_float64(y, q.x.dtype)
    theirs = h.as_float64(h.to_numpy(ref), q.x.dtype)
    exact = h.oracle(masked)[0]
    rel = np.linalg.norm(mine - theirs) / np.linalg.norm(theirs)
    short = q.x.shape[1] <= 1536
    if q.x.dtype == mx.float32:
        assert rel < (1e-6 if short else 1e-5), (label, rel)
    else:
        assert rel < 0.05 or not short, (label, rel)
        assert np.linalg.norm(mine - exact) <= np.linalg.norm(theirs - exact), label


# --- 1. golden source ---------------------------------------------------------------------------------

def test_golden_signature_and_template():
    case = h.rmm_case((3, 576, 192, 32, 4, "f16", 9))
    golden = _golden_for(gpu_rmm.metal_kernel(), case)
    assert gpu_rmm.RMM_METAL_BODY.strip() in golden.source
    assert golden.template_decl == ("template <typename T, int M, int BITS, int GS, int K, int N, int NSG, int COLS, "
                                    "int KEEP>")
    assert golden.template_args == "<float16_t, 3, 4, 32, 576, 192, 4, 4, 9>"
    buffers = [(p.type, p.name, p.attr) for p in golden.params if p.is_buffer]
    assert buffers == [("const device float16_t*", "x", "buffer(0)"), ("const device uint32_t*", "w", "buffer(1)"),
                       ("const device float16_t*", "scales", "buffer(2)"),
                       ("const device float16_t*", "biases", "buffer(3)"), ("device float16_t*", "y", "buffer(4)")]
    attributes = [p.name for p in golden.params if not p.is_buffer]
    assert attributes == ["simdgroup_index_in_threadgroup", "thread_index_in_simdgroup", "thread_index_in_threadgroup",
                          "threadgroup_position_in_grid"]
    for attr in re.findall(r"\[\[(\w+)", golden.source):
        assert attr in h.METAL_THREAD_ATTRIBUTES | {"kernel", "buffer", "host_name"}, attr


@needs_gxx
def test_golden_sources_compile_against_the_shim(tmp_path):
    configs = [(rows, k, n, gs, bits, dtype, keep) for (k, n) in MODEL_SHAPES for rows in (1, 16)
               for (bits, gs, dtype) in ((4, 32, "f16"), (8, 64, "bf16"), (4, 128, "f32")) if k % gs == 0
               for keep in (1, k // gs // 2)]
    configs += [(16, 256 * gs, 64, gs, bits, dtype, 128) for (gs, bits, dtype) in
                ((32, 4, "f16"), (64, 8, "bf16"), (128, 4, "f32"))]  # the largest K per group size
    operands = [h.rmm_case(c) for c in configs]
    golden = h.golden_metal_sources([lambda o=o: _call(gpu_rmm.metal_kernel(), o) for o in operands])
    assert len(golden) == len(configs)
    result = h.compile_shim_syntax(golden, tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]


@needs_gxx
def test_shim_compile_rejects_too_many_groups(tmp_path):
    """The body's own static_assert: 512 groups (past the launch's check) do not compile."""
    x = mx.zeros((1, 512 * 32), dtype=mx.float16)
    w = mx.zeros((16, 512 * 32 * 4 // 32), dtype=mx.uint32)
    s = mx.zeros((16, 512), dtype=mx.float16)
    template = [("T", mx.float16), ("M", 1), ("BITS", 4), ("GS", 32), ("K", 512 * 32), ("N", 16), ("NSG", 4),
                ("COLS", 4), ("KEEP", 1)]
    golden = h.golden_metal_sources([lambda: gpu_rmm.metal_kernel()(
        inputs=[x, w, s, s], template=template, grid=(128, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(1, 16)],
        output_dtypes=[mx.float16], verbose=True)[0]])
    result = h.compile_shim_syntax(golden, tmp_path)
    assert result.returncode != 0 and "at most 256 groups" in result.stderr


# --- 2. logic under the emulator ----------------------------------------------------------------------

def test_tie_data_has_ties_at_the_keep_boundary():
    """The activations make the tie rule decide: in every emulated case with keep < G and a 'flat' row, the
    group ranked keep-th and the next one have equal scores in some row (checked on the oracle's scores)."""
    for c in EMU_CASES:
        rows, k, _, gs, _, _, keep = c
        if keep == k // gs or rows < 2:
            continue
        case = h.rmm_case(c)
        scores = np.abs(h.as_float64(h.to_numpy(case.qmm.x), case.qmm.x.dtype)).reshape(rows, k // gs, gs).sum(-1)
        ordered = -np.sort(-scores, axis=1)
        assert (ordered[:, keep - 1] == ordered[:, keep]).any(), h.rmm_case_id(c)
        # The tie is broken towards the lower index: for the all-equal row the oracle keeps groups 0..keep-1.
        assert case.kept[1].tolist() == [g < keep for g in range(k // gs)], h.rmm_case_id(c)


@needs_emulator
@pytest.mark.parametrize("c", EMU_CASES, ids=h.rmm_case_id)
def test_emulated_kernel_matches_reference(emulated, c):
    exe, cases, golden, _ = emulated
    case = cases[c]
    y = _run(exe, golden[c], case)
    _check_against_reference(y, case, h.rmm_case_id(c))


@needs_emulator
@pytest.mark.parametrize("c", sorted(LOCKED_CASES), ids=h.rmm_case_id)
def test_emulated_kernel_never_reads_unkept_weights(emulated, c):
    """The pages of w holding only groups no row keeps are unreadable: the kernel runs and matches the oracle."""
    exe, cases, golden, _ = emulated
    case = cases[c]
    assert not case.used[list(LOCKED_CASES[c])].any() and case.used.sum() < len(case.used)
    y = _run(exe, golden[c], case, locked={"w": _locked_pages(case)})
    _check_against_reference(y, case, h.rmm_case_id(c))


@needs_emulator
@pytest.mark.parametrize("name", sorted(BROKEN_BODIES))
def test_emulation_catches_a_broken_body(emulated, name):
    exe, cases, golden, broken = emulated
    case = cases[BROKEN_CASE]
    good = _run(exe, golden[BROKEN_CASE], case)
    assert h.max_error_ratio(good, case.masked()) <= 1.0
    bad = _run(exe, broken[name], case)
    assert h.max_error_ratio(bad, case.masked()) > 100.0, f"the emulator did not catch the broken body {name}"


@needs_emulator
def test_locked_pages_catch_a_body_that_reads_every_group(emulated):
    """The page lock catches reading unkept groups on its own (without the NaN poison, which the no-skipping
    body survives when its inputs are clean): built for a locked case, that body faults."""
    exe, cases, _, broken = emulated
    case = cases[LOCKED_BROKEN_CASE]
    name = broken["locked_no_skipping"]
    q = case.qmm
    launch = gpu_rmm.rmm_launch(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    clean = {"x": h.to_numpy(q.x), "w": h.to_numpy(q.w), "scales": h.to_numpy(q.scales),
             "biases": h.to_numpy(q.biases)}
    outputs = {"y": (launch.output_shape, NP_OUT[q.x.dtype])}
    y = h.run_emulated(exe, name, clean, outputs, launch.grid, launch.threadgroup)["y"]
    h.assert_close_to_oracle(y, case.masked(), "unlocked, unpoisoned: the broken body's values are right")
    with pytest.raises(AssertionError, match="guard page"):
        h.run_emulated(exe, name, clean, outputs, launch.grid, launch.threadgroup,
                       locked={"w": _locked_pages(case)})


# --- launch parameters and errors ---------------------------------------------------------------------

def test_launch_is_qmms_plus_keep():
    case = h.rmm_case((4, 576, 49152, 32, 4, "f16", 7))
    q = case.qmm
    launch = gpu_rmm.rmm_launch(q.x, q.w, q.scales, q.biases, 32, 4, 7)
    assert launch.template[-1] == ("KEEP", 7)
    assert [name for name, _ in launch.template] == ["T", "M", "BITS", "GS", "K", "N", "NSG", "COLS", "KEEP"]
    threads = launch.threadgroup[0]
    assert launch.grid[0] % threads == 0 and launch.grid[1:] == (1, 1)
    columns = launch.grid[0] // threads * 16
    assert 49152 <= columns < 49152 + 16
    assert launch.output_shape == (4, 49152) and launch.output_dtype == mx.float16


@pytest.mark.parametrize("edit, message", [
    (dict(keep=0), "keep must be an int in [1, 2]"),
    (dict(keep=3), "keep must be an int in [1, 2]"),
    (dict(keep=1.5), "keep must be an int"),
    (dict(keep=True), "keep must be an int"),
    (dict(x=mx.zeros((2, 512 * 32)), w=mx.zeros((8, 512 * 4), dtype=mx.uint32), scales=mx.zeros((8, 512)),
          biases=mx.zeros((8, 512))), "at most 256"),
    (dict(bits=3), "rmm_qmm: bits=3"),
    (dict(group_size=16), "rmm_qmm: group_size=16"),
    (dict(x=mx.zeros((17, 64))), "rmm_qmm: x must be [M, K] with 1 <= M <= 16"),
    (dict(scales=mx.zeros((8, 2), dtype=mx.float16)), "rmm_qmm: scales must be"),
])
def test_bad_operands_raise_one_line(edit, message):
    args = dict(x=mx.zeros((2, 64)), w=mx.zeros((8, 8), dtype=mx.uint32), scales=mx.zeros((8, 2)),
                biases=mx.zeros((8, 2)), group_size=32, bits=4, keep=1)
    args.update(edit)
    with pytest.raises(MlxInferError, match=re.escape(message)) as info:
        gpu_rmm.rmm_launch(**args)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(gpu_rmm.metal_available(), reason="Metal is the default device here")
def test_metal_rmm_qmm_refuses_without_metal():
    q = h.rmm_case((2, 576, 192, 32, 4, "f32", 3)).qmm
    with pytest.raises(RuntimeError, match="Metal"):
        gpu_rmm.metal_rmm_qmm(q.x, q.w, q.scales, q.biases, 32, 4, 3)


# --- 3. on a real Metal device ------------------------------------------------------------------------

DEVICE_CASES = [(rows, k, n, gs, bits, dtype, keep) for (k, n) in MODEL_SHAPES for rows in (1, 3, 16)
                for (gs, bits, dtype) in ((32, 4, "f16"), (64, 8, "bf16"), (128, 4, "f32")) if k % gs == 0
                for keep in (1, k // gs // 2, k // gs)]
DEVICE_CASES += [(3, 256 * gs, 512, gs, 4, "f16", 100) for gs in (32, 64, 128)]


@pytest.mark.skipif(not gpu_rmm.metal_available(), reason="needs MLX on Metal with the GPU as default device")
@pytest.mark.parametrize("c", DEVICE_CASES, ids=h.rmm_case_id)
def test_metal_device_matches_reference(c):
    case = h.rmm_case(c)
    q = case.qmm
    y = gpu_rmm.metal_rmm_qmm(q.x, q.w, q.scales, q.biases, q.group_size, q.bits, case.keep)
    h.assert_close_to_oracle(h.to_numpy(y), case.masked(), h.rmm_case_id(c))
