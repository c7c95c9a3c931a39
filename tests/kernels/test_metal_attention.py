"""The Metal attention over a quantized KV cache (metal_kernels/quant_attention.metal through
mlx_infer.kernels.gpu_attention), checked on a machine without Metal, as test_metal_qmm.py checks qmm:

1. golden source: the Metal source MLX generates for the kernel object (printed by a verbose call inside
   mx.export_function tracing) compiles with g++ against metal_kernels/host/metal_shim.h for every head-dim /
   bits / dtype / row-count combination below, with the signature the body expects;
2. logic: that same source runs under the Metal execution-model emulator (metal_emu.h) and, merged by
   gpu_attention.merge_partials, matches a float64 numpy oracle (decode P = 1 and verify P = 4, n_rep 1 and
   3, bits k8v8 / k4v4 / k8v4, head dims 64 / 128 / 256, S not a multiple of the 32-key tile or of the split,
   C > S with NaN scales in the rows past S); bodies broken on purpose (missing barriers, a short reduction,
   no rescaling, reading past S) must fail the same check;
3. where Metal is the default device, the kernel itself matches the oracle.

Tolerance: |out - out64| <= 2e-6 * sum_s p_s |v_s| (1 + max_s |score_s|) + eps |out64| + 2^-25 elementwise
(gpu_helpers.attention_error_ratio): float32 scores, exp and sums, plus one rounding to q's dtype.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

import gpu_helpers as h
from gpu_helpers import AttnConfig
from mlx_infer.errors import MlxInferError
from mlx_infer.kernels import gpu_attention as ga

needs_gxx = pytest.mark.skipif(h.gxx() is None, reason="the golden-source checks compile with g++, absent here")
needs_emulator = pytest.mark.skipif(h.EMULATOR_MISSING is not None, reason=f"emulator: {h.EMULATOR_MISSING}")

#: Emulated configurations: n_kv = 2 everywhere (the head index matters); S is never a multiple of the tile (32)
#: nor of the split; every cache has rows past S (NaN scales there: see gpu_helpers.make_case).
EMU_CONFIGS = (
    # decode (P = 1)
    AttnConfig(2, 1, 1, 64, 64, 8, 8, 32, "f32", "f32", 77, 96, 32),      # three splits, the last one partial
    AttnConfig(2, 3, 1, 256, 256, 4, 4, 64, "f16", "f16", 45, 64),        # one split of two tiles
    AttnConfig(2, 3, 1, 128, 128, 8, 4, 128, "bf16", "f16", 37, 40, 32),  # f16 scales under bf16 q
    # verify (P = 4)
    AttnConfig(2, 1, 4, 64, 64, 8, 4, 64, "bf16", "bf16", 70, 80, 32),
    AttnConfig(2, 3, 4, 256, 256, 8, 8, 128, "f16", "f16", 53, 70, 32),
    AttnConfig(2, 3, 4, 64, 64, 4, 4, 32, "f32", "f16", 99, 128, 64),     # splits of two tiles
    AttnConfig(2, 4, 4, 128, 64, 4, 8, 32, "f16", "f16", 40, 48, 32),     # 16 rows (the most), Dv != D
    AttnConfig(2, 3, 4, 64, 256, 8, 4, 64, "f32", "f32", 4, 33),          # S = P: a fresh verify
)
#: The configuration the broken bodies run (rows in every SIMD group, two tiles per split, two splits).
BROKEN_CONFIG = EMU_CONFIGS[5]

NP_OUT = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}
NP_SCALE = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def _call(kernel, case: h.AttnCase, verbose=True):
    """A call of a metal_kernel object with the launch gpu_attention computes for the case (part_m only: one
    output is enough to trace the kernel)."""
    launch = ga.attention_launch(*case.args(), split_length=case.config.split_length)
    return ga.launch_kernel(kernel, case.q, case.keys, case.values, launch, verbose)[0]


def _golden_for(kernel, case: h.AttnCase) -> h.GoldenKernel:
    return h.golden_metal_sources([lambda: _call(kernel, case)])[0]


BARRIER = "metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);"


def _without_nth(text: str, needle: str, n: int) -> str:
    starts = [m.start() for m in re.finditer(re.escape(needle), text)]
    assert len(starts) == 5 and n < len(starts), "the body's barriers changed: update the broken fixtures"
    return text[:starts[n]] + text[starts[n] + len(needle):]


def _replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} changed in the body: update the broken fixtures"
    return text.replace(old, new)


BROKEN_BODIES = {
    "no_barrier_after_staging_q": lambda b: _without_nth(b, BARRIER, 0),
    "no_barrier_after_scores": lambda b: _without_nth(b, BARRIER, 2),
    "no_barrier_after_softmax": lambda b: _without_nth(b, BARRIER, 3),
    "score_reduction_over_4_lanes": lambda b: _replaced(b, "offset = TPK / 2;", "offset = TPK / 4;"),
    "no_rescaling_of_acc": lambda b: _replaced(b, "acc[r][e] *= a;", "acc[r][e] *= 1.0f;"),
    "reads_past_length": lambda b: _replaced(b, "s0 + SL < S ? s0 + SL : S;", "s0 + SL;"),
}


@pytest.fixture(scope="module")
def emulated():
    """Golden sources of every emulated configuration and of the broken bodies, built into one emulator:
    (exe, {config: case}, {config: GoldenKernel}, {broken name: GoldenKernel})."""
    cases = {c: h.make_case(c) for c in EMU_CONFIGS}
    kernel = ga.metal_kernel()
    golden = dict(zip(cases, h.golden_metal_sources([lambda o=o: _call(kernel, o) for o in cases.values()])))
    assert len(golden) == len(cases), "each configuration is its own instantiation"
    broken = {}
    for name, edit in BROKEN_BODIES.items():
        body = edit(ga.ATTN_METAL_BODY)
        assert body != ga.ATTN_METAL_BODY
        bad = mx.fast.metal_kernel(name=f"broken_{name}", input_names=list(ga.ATTN_INPUT_NAMES),
                                   output_names=list(ga.ATTN_OUTPUT_NAMES), source=body)
        broken[name] = _golden_for(bad, cases[BROKEN_CONFIG])
    exe = h.build_emulator(list(golden.values()) + list(broken.values()))
    return exe, cases, golden, broken


def _run_attention(exe, golden: h.GoldenKernel, case: h.AttnCase) -> np.ndarray:
    """The emulated kernel's partials, merged by gpu_attention.merge_partials: [n_kv, R, Dv] in q's dtype (as
    numpy; bfloat16 as uint16)."""
    launch = ga.attention_launch(*case.args(), split_length=case.config.split_length)
    lengths, scale = launch.extra_inputs()
    arrays = (case.q, *case.keys, *case.values, lengths, scale)
    inputs = {name: h.to_numpy(a) for name, a in zip(ga.ATTN_INPUT_NAMES, arrays)}
    outputs = {name: (shape, np.float32) for name, shape in zip(ga.ATTN_OUTPUT_NAMES, launch.output_shapes)}
    out = h.run_emulated(exe, golden, inputs, outputs, launch.grid, launch.threadgroup)
    parts = [mx.array(out[name]) for name in ga.ATTN_OUTPUT_NAMES]
    return h.to_numpy(ga.merge_partials(*parts, case.q.dtype))


# --- 1. golden source ---------------------------------------------------------------------------------

def test_golden_signature_is_the_one_the_body_expects():
    case = h.make_case(AttnConfig(2, 3, 4, 128, 128, 8, 4, 64, "bf16", "f16", 50, 64))
    golden = _golden_for(ga.metal_kernel(), case)
    assert ga.ATTN_METAL_BODY.strip() in golden.source
    assert golden.template_decl == ("template <typename T, typename ST, int R, int P, int D, int DV, int GS, "
                                    "int KBITS, int VBITS, int NSG>")
    assert golden.template_args == "<bfloat16_t, float16_t, 12, 4, 128, 128, 64, 8, 4, 4>"
    buffers = [(p.type, p.name) for p in golden.params if p.is_buffer]
    assert [name for _, name in buffers] == list(ga.ATTN_INPUT_NAMES + ga.ATTN_OUTPUT_NAMES)
    assert buffers[0] == ("const device bfloat16_t*", "q")
    assert buffers[1] == ("const device uint32_t*", "k") and buffers[4] == ("const device uint32_t*", "v")
    assert all(t == "const device float16_t*" for t, n in buffers if n.endswith(("_scales", "_biases")))
    # MLX puts the two tiny inputs in the constant address space; the body only reads them.
    assert buffers[7] == ("const constant int32_t*", "lengths") and buffers[8][1] == "softmax_scale"
    assert all(t == "device float*" for t, _ in buffers[9:])
    attributes = [(p.type, p.name) for p in golden.params if not p.is_buffer]
    assert attributes == [("uint", "simdgroup_index_in_threadgroup"), ("uint", "thread_index_in_simdgroup"),
                          ("uint", "thread_index_in_threadgroup"), ("uint3", "threadgroup_position_in_grid")]
    for attr in re.findall(r"\[\[(\w+)", golden.source):
        assert attr in h.METAL_THREAD_ATTRIBUTES | {"kernel", "buffer", "host_name"}, attr


@needs_gxx
def test_golden_sources_compile_against_the_shim(tmp_path):
    configs = [AttnConfig(1, rows, 1, dim, v_dim, kb, vb, gs, dtype, sdtype, 40, 64)
               for dim in ga.ATTN_HEAD_DIMS for v_dim in ga.ATTN_HEAD_DIMS for rows in (1, 16)
               for (kb, vb, gs, dtype, sdtype) in ((8, 8, 32, "f16", "f16"), (4, 4, 64, "bf16", "f16"),
                                                   (8, 4, 64, "f32", "f32"))]
    configs += [AttnConfig(1, 3, 4, 128, 128, 4, 8, 128, "bf16", "bf16", 40, 64)]
    cases = [h.make_case(c) for c in configs]
    golden = h.golden_metal_sources([lambda o=o: _call(ga.metal_kernel(), o) for o in cases])
    assert len(golden) == len(configs)
    result = h.compile_shim_syntax(golden, tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]


@needs_gxx
def test_shim_compile_catches_errors(tmp_path):
    case = h.make_case(AttnConfig(1, 1, 1, 64, 64, 8, 8, 32, "f32", "f32", 40, 64))
    for edit in (lambda b: b.replace("part[r] += kv * qs[", "part[r] += kw * qs["),
                 lambda b: b.replace("float sum = 0.0f;", "double sum = 0.0;")):
        body = edit(ga.ATTN_METAL_BODY)
        assert body != ga.ATTN_METAL_BODY
        bad = mx.fast.metal_kernel(name="typo", input_names=list(ga.ATTN_INPUT_NAMES),
                                   output_names=list(ga.ATTN_OUTPUT_NAMES), source=body)
        assert h.compile_shim_syntax([_golden_for(bad, case)], tmp_path).returncode != 0


# --- 2. logic under the emulator ----------------------------------------------------------------------

@needs_emulator
@pytest.mark.parametrize("config", EMU_CONFIGS, ids=lambda c: c.id)
def test_emulated_kernel_matches_reference(emulated, config):
    exe, cases, golden, _ = emulated
    case = cases[config]
    out = _run_attention(exe, golden[config], case)
    h.assert_attention_close(out, case, config.id)


@needs_emulator
@pytest.mark.parametrize("name", sorted(BROKEN_BODIES))
def test_emulation_catches_a_broken_body(emulated, name):
    exe, cases, golden, broken = emulated
    case = cases[BROKEN_CONFIG]
    assert h.attention_error_ratio(_run_attention(exe, golden[BROKEN_CONFIG], case), case) <= 1.0
    ratio = h.attention_error_ratio(_run_attention(exe, broken[name], case), case)
    assert ratio > 100.0, f"the emulator did not catch the broken body {name} (error {ratio:.3g}x the bound)"


def test_oracle_agrees_with_reference_quant_attention():
    """The numpy oracle is the semantics of attention.reference_quant_attention (MLX's dequantization and
    softmax in float32), decode and verify."""
    from mlx_infer.kernels.attention import reference_quant_attention

    for config in (EMU_CONFIGS[1], EMU_CONFIGS[4], EMU_CONFIGS[6]):
        case = h.make_case(config)
        ref = reference_quant_attention(*case.args())
        ratio = h.attention_error_ratio(h.to_numpy(ref), case)
        assert ratio <= 1.0, f"{config.id}: reference_quant_attention is {ratio:.3g}x the bound off the oracle"


def test_merge_of_partials_equals_one_pass():
    """merge_partials: splits of a softmax, one of them without visible keys, combine to the whole."""
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 5, 3, 32)).astype(np.float32)   # [n_kv, splits, R, keys]
    values = rng.standard_normal((2, 5, 32, 8)).astype(np.float32)
    scores[:, 4] = -np.inf                                            # the last split sees nothing
    m = scores.max(axis=-1)
    p = np.exp(scores - np.where(np.isfinite(m), m, 0.0)[..., None])
    part_m = np.where(np.isfinite(m), m, -1e30).astype(np.float32)
    parts = (mx.array(part_m), mx.array(p.sum(-1)), mx.array(p @ values))
    out = np.array(ga.merge_partials(*parts, mx.float32))
    whole = scores.transpose(0, 2, 1, 3).reshape(2, 3, 160)
    pw = np.exp(whole - whole.max(-1, keepdims=True))
    want = (pw / pw.sum(-1, keepdims=True)) @ values.reshape(2, 160, 8)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


# --- launch parameters and errors ---------------------------------------------------------------------

def test_launch_grid_and_splits():
    case = h.make_case(AttnConfig(8, 2, 1, 128, 128, 8, 8, 64, "f16", "f16", 4097, 4352))
    launch = ga.attention_launch(*case.args())
    threads = launch.threadgroup[0]
    assert launch.threadgroup == (32 * ga.ATTN_SIMD_GROUPS, 1, 1)
    assert launch.grid == (launch.splits * threads, 8, 1)
    assert launch.split_length % ga.ATTN_TILE == 0 and launch.split_length >= ga.ATTN_MIN_SPLIT
    assert (launch.splits - 1) * launch.split_length < 4097 <= launch.splits * launch.split_length
    assert launch.lengths == (4097, 4352, launch.split_length, launch.splits)
    assert launch.output_shapes == ((8, launch.splits, 2), (8, launch.splits, 2), (8, launch.splits, 2, 128))
    short = ga.attention_launch(*h.make_case(AttnConfig(8, 2, 1, 128, 128, 8, 8, 64, "f16", "f16", 70, 96)).args())
    assert short.splits == 1 and short.split_length == 96


def _bad_args(**edit):
    case = h.make_case(AttnConfig(2, 2, 2, 64, 64, 8, 4, 32, "f16", "f16", 20, 32))
    args = dict(q=case.q, keys=case.keys, values=case.values, length=20, scale=0.125, positions=2, group_size=32)
    args.update(edit)
    return args


@pytest.mark.parametrize("edit, message", [
    (lambda a: dict(group_size=16), "group_size=16"),
    (lambda a: dict(q=a["q"].astype(mx.int32)), "dtype"),
    (lambda a: dict(q=a["q"][0]), "q must be [n_kv, R, D]"),
    (lambda a: dict(q=mx.zeros((2, 18, 64), dtype=mx.float16), positions=1), "1..16"),
    (lambda a: dict(positions=3), "positions=3"),
    (lambda a: dict(length=33), "length (33)"),
    (lambda a: dict(length=1), "length (1)"),
    (lambda a: dict(keys=(a["keys"][0][:, :, :12], *a["keys"][1:])), "bits must be one of"),
    (lambda a: dict(keys=(a["keys"][0], a["keys"][1].astype(mx.float32), a["keys"][2])), "biases must match"),
    (lambda a: dict(keys=tuple(x.astype(mx.bfloat16) if x.dtype != mx.uint32 else x for x in a["keys"])),
     "float16 or q's dtype"),
    (lambda a: dict(values=tuple(x[:1] for x in a["values"])), "values has 1 KV heads"),
    (lambda a: dict(values=tuple(x[:, :16] for x in a["values"])), "values 16"),
    (lambda a: dict(q=mx.zeros((2, 4, 32), dtype=mx.float16)), "head dim"),
])
def test_bad_operands_raise_one_line(edit, message):
    args = _bad_args()
    args.update(edit(args))
    with pytest.raises(MlxInferError, match=re.escape(message)) as info:
        ga.attention_launch(**args)
    assert "\n" not in str(info.value)


def test_bad_split_length_raises():
    with pytest.raises(MlxInferError, match="multiple of 32"):
        ga.attention_launch(**_bad_args(), split_length=48)


@pytest.mark.skipif(ga.metal_available(), reason="Metal is the default device here")
def test_metal_quant_attention_refuses_without_metal():
    with pytest.raises(RuntimeError, match="Metal"):
        ga.metal_quant_attention(**_bad_args())


# --- 3. on a real Metal device ------------------------------------------------------------------------


@pytest.mark.skipif(not ga.metal_available(), reason="needs MLX on Metal with the GPU as default device")
@pytest.mark.parametrize("config", h.ATTN_DEVICE_CONFIGS, ids=lambda c: c.id)
def test_metal_device_matches_reference(config):
    case = h.make_case(config)
    out = ga.metal_quant_attention(*case.args())
    h.assert_attention_close(h.to_numpy(out), case, config.id)
