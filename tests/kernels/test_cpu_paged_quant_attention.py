"""The CPU paged-attention kernel over quantized blocks (cpu_kernels/attn_body.h, PagedQuantRows) against a
float64 numpy oracle over MLX's own dequantization of the pool's rows, and the pure-mx reference
(kernels.paged_attention.reference_paged_quant_attention) against the same oracle: ragged requests scattered
over the pool, GQA groups, decode and verify widths, sliding windows, 8 / 4 bits and K, V apart, group sizes
32 / 64 / 128, float16 / bfloat16 scales; hidden keys and blind queries; bad operands; the AVX2 and portable
variants."""

import textwrap

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import run_in_variant
from test_cpu_paged_attention import case_operands
from test_cpu_paged_attention import oracle as float_oracle

from mlx_infer.kernels.paged_attention import (PAGED_MAX_QUERIES, paged_quant_attention,
                                               reference_paged_quant_attention)

#: (lengths, n_kv, n_rep, L, head dim, v head dim, window, k_bits, v_bits, group size).
CASES = [
    ((700,), 3, 3, 1, 64, 64, 0, 8, 8, 64),
    ((100, 37, 260, 5), 3, 3, 1, 64, 64, 0, 4, 4, 64),
    ((1100,), 1, 4, 2, 128, 64, 0, 8, 4, 32),
    ((33, 80), 2, 1, 4, 64, 128, 0, 4, 8, 64),
    ((300, 120, 64), 2, 2, 16, 128, 128, 0, 8, 8, 128),
    ((500, 90), 3, 3, 1, 64, 64, 40, 8, 4, 64),
    ((200, 31, 170), 2, 2, 8, 32, 32, 16, 4, 4, 32),
]


def quantized_operands(case, sb_dtype=mx.float16, q_dtype=mx.float32, seed=0):
    """The float case's operands (test_cpu_paged_attention.case_operands) with its pool quantized per row as
    a quantized BlockPool stores it (the rows in float16, then mx.quantize): (q, keys, values, index,
    lengths, q_pos, k_pos), keys / values (codes, scales, biases) with scales and biases in sb_dtype."""
    lengths, n_kv, n_rep, L, dim, v_dim, _, kb, vb, gs = case
    q, k_pool, v_pool, *rest = case_operands(lengths, n_kv, n_rep, L, dim, v_dim, mx.float32, seed=seed)
    keys = [a if i == 0 else a.astype(sb_dtype)
            for i, a in enumerate(mx.quantize(k_pool.astype(mx.float16), group_size=gs, bits=kb))]
    values = [a if i == 0 else a.astype(sb_dtype)
              for i, a in enumerate(mx.quantize(v_pool.astype(mx.float16), group_size=gs, bits=vb))]
    return (q.astype(q_dtype), keys, values, *rest)


def dequantized(packed, bits, gs):
    """MLX's dequantization of packed rows as float32 [rows, dim] (what the oracle attends over)."""
    w, s, b = packed
    return mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)


def oracle(case, ops, scale):
    """float64 numpy attention (test_cpu_paged_attention.oracle) over the pool rows as MLX dequantizes them."""
    *_, window, kb, vb, gs = case
    q, keys, values, *rest = ops
    return float_oracle(q, dequantized(keys, kb, gs), dequantized(values, vb, gs), *rest, scale, window)


def assert_close(got, want, tol=1e-5):
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol * np.abs(want).max())


def case_id(c):
    return "-".join(map(str, c)).replace(", ", "_")


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("sb_dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_kernel_matches_the_oracle(cpu_kernels, case, sb_dtype):
    lengths, n_kv, n_rep, L, dim, v_dim, window, _, _, gs = case
    ops = quantized_operands(case, sb_dtype, seed=len(lengths) + L)
    want = oracle(case, ops, dim ** -0.5)
    got = cpu_kernels.cpu_paged_quant_attention(*ops, dim ** -0.5, gs, window)
    assert got.dtype == mx.float32 and got.shape == (len(lengths), n_kv * n_rep, L, v_dim)
    assert_close(got, want)
    assert_close(reference_paged_quant_attention(*ops, dim ** -0.5, gs, window), want)


@pytest.mark.parametrize("q_dtype, tol", [(mx.float16, 2.0 ** -9), (mx.bfloat16, 2.0 ** -7)], ids=["f16", "bf16"])
def test_half_queries(cpu_kernels, q_dtype, tol):
    case = CASES[1]
    ops = quantized_operands(case, q_dtype=q_dtype, seed=3)
    got = cpu_kernels.cpu_paged_quant_attention(*ops, 0.125, 64, 0)
    assert got.dtype == q_dtype
    assert_close(got, oracle(case, ops, 0.125), tol)


def test_hidden_keys_and_blind_queries(cpu_kernels):
    """An index outside the pool is a key nobody sees; a query before every key gets zeros."""
    case = ((40, 40), 2, 2, 2, 64, 64, 0, 8, 4, 64)
    q, keys, values, index, lengths, q_pos, k_pos = quantized_operands(case, seed=5)
    idx = np.array(index)
    idx[0, 1, 3], idx[1, 0, 7], idx[1, 1, 0] = -5, keys[0].shape[0], 2 ** 31 - 1
    qp = np.array(q_pos)
    qp[1, 0] = np.array(k_pos)[1, 0] - 1  # sees nothing
    ops = (q, keys, values, mx.array(idx), lengths, mx.array(qp), k_pos)
    want = oracle(case, ops, 0.125)
    got = cpu_kernels.cpu_paged_quant_attention(*ops, 0.125, 64, 0)
    assert not np.array(got[1, :, 0]).any() and np.isfinite(np.array(got)).all()
    assert_close(got, want)
    assert_close(reference_paged_quant_attention(*ops, 0.125, 64, 0), want)


def test_dispatch_runs_the_kernel_at_every_width(cpu_kernels, monkeypatch):
    """paged_quant_attention takes the kernel at every width: one call up to PAGED_MAX_QUERIES positions, blocks
    of that many beyond."""
    calls = []
    real = cpu_kernels.cpu_paged_quant_attention
    monkeypatch.setattr(cpu_kernels, "cpu_paged_quant_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    for L in (PAGED_MAX_QUERIES, PAGED_MAX_QUERIES + 4):
        case = ((90, 300), 3, 3, L, 64, 64, 24, 8, 8, 64)
        ops = quantized_operands(case, seed=L)
        assert_close(paged_quant_attention(*ops, 0.125, 64, 24), oracle(case, ops, 0.125))
    assert calls == [PAGED_MAX_QUERIES, PAGED_MAX_QUERIES, 4]


def bad(**edit):
    """The operands of a good call (B 2, n_q 4, n_kv 2, L 1, S 8, D 64, 8-bit, groups of 64) with `edit`."""
    ops = dict(q=mx.zeros((2, 4, 1, 64)), k=mx.zeros((32, 16), mx.uint32), k_scales=mx.zeros((32, 1), mx.float16),
               k_biases=mx.zeros((32, 1), mx.float16), v=mx.zeros((32, 16), mx.uint32),
               v_scales=mx.zeros((32, 1), mx.float16), v_biases=mx.zeros((32, 1), mx.float16),
               index=mx.zeros((2, 2, 8), mx.int32), lengths=mx.full((2,), 8, mx.int32),
               q_pos=mx.zeros((2, 1), mx.int32), k_pos=mx.zeros((2, 8), mx.int32), group_size=64, window=0)
    ops.update(edit)
    return ops


BAD = [
    (dict(k=mx.zeros((32, 16), mx.float32)), "k must be uint32 codes"),
    (dict(v_biases=mx.zeros((32, 2), mx.float16)), "v must be uint32 codes"),
    (dict(v=mx.zeros((31, 16), mx.uint32), v_scales=mx.zeros((31, 1), mx.float16),
          v_biases=mx.zeros((31, 1), mx.float16)), "the rows of k"),
    (dict(k=mx.zeros((32, 12), mx.uint32)), "bits must be 4 or 8"),
    (dict(group_size=48), "group_size must be 32, 64 or 128"),
    (dict(v_scales=mx.zeros((32, 1), mx.bfloat16), v_biases=mx.zeros((32, 1), mx.bfloat16)), "scales must be one dtype"),
    (dict(q=mx.zeros((2, 4, 1, 128))), "head dims must agree"),
    (dict(index=mx.zeros((2, 2, 8), mx.int64)), "index must be int32"),
    (dict(window=-1), "window must be >= 0"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m for _, m in BAD])
def test_kernel_refuses_bad_operands(cpu_kernels, edit, message):
    ops = bad(**edit)
    keys = (ops.pop("k"), ops.pop("k_scales"), ops.pop("k_biases"))
    values = (ops.pop("v"), ops.pop("v_scales"), ops.pop("v_biases"))
    with pytest.raises(ValueError, match=message):
        cpu_kernels.cpu_paged_quant_attention(ops["q"], keys, values, ops["index"], ops["lengths"], ops["q_pos"],
                                              ops["k_pos"], 0.125, ops["group_size"], ops["window"])


VARIANT_CHECK = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    from mlx_infer.kernels import cpu
    sys.path.insert(0, sys.argv[1])
    from test_cpu_paged_quant_attention import CASES, assert_close, oracle, quantized_operands
    assert cpu.isa() == sys.argv[2], cpu.isa()
    for case in CASES:
        lengths, n_kv, n_rep, L, dim, v_dim, window, kb, vb, gs = case
        ops = quantized_operands(case, seed=len(lengths) + L)
        assert_close(cpu.cpu_paged_quant_attention(*ops, dim ** -0.5, gs, window), oracle(case, ops, dim ** -0.5))
    print("ok")
""")


@pytest.mark.parametrize("variant", ["avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    """The AVX2 and portable variants of the quantized paged kernel (which this machine may not pick)."""
    run_in_variant(VARIANT_CHECK, variant, tmp_path)
