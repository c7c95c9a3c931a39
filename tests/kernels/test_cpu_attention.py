"""The CPU kernel of attention over a quantized KV cache (cpu_kernels/attn_body.h) against a float64 numpy
oracle, and the pure-mx reference (kernels.attention.reference_quant_attention) against the same oracle."""

import textwrap

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import run_in_variant

from mlx_infer.kernels.attention import quant_attention, reference_quant_attention

#: (n_kv, n_rep, positions, length, capacity, head dim, k bits, v bits, group size): decode and verify
#: widths, GQA groups, lengths below / across the kernel's 32-key tiles and 256-key splits, a cache with
#: room past its length.
CASES = [
    (3, 3, 1, 700, 1024, 64, 8, 8, 64),
    (3, 3, 4, 300, 512, 64, 4, 4, 64),
    (1, 4, 1, 1000, 1200, 256, 8, 4, 64),
    (2, 1, 2, 33, 40, 128, 4, 8, 32),
    (3, 3, 1, 5, 8, 64, 8, 8, 64),
    (2, 2, 16, 16, 16, 128, 8, 8, 128),
    (4, 4, 16, 2049, 2100, 64, 4, 4, 32),
]


def packed(n_kv, cap, dim, bits, gs, seed):
    x = mx.random.normal((n_kv, cap, dim), key=mx.random.key(seed)) * (1 + mx.arange(dim) % 7)
    return mx.quantize(x.astype(mx.float16), group_size=gs, bits=bits)


def oracle(q, keys, values, length, scale, positions, gs, k_bits, v_bits):
    """float64 numpy attention over MLX's dequantization of the first `length` rows."""
    def deq(p, bits):
        w, s, b = (a[:, :length] for a in p)
        return np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits),
                        dtype=np.float64)
    k, v = deq(keys, k_bits), deq(values, v_bits)  # [H, S, D]
    qn = np.array(q.astype(mx.float32), dtype=np.float64)  # [H, R, D]
    scores = scale * qn @ k.transpose(0, 2, 1)  # [H, R, S]
    rows = np.arange(qn.shape[1]) % positions + length - positions
    scores = np.where(np.arange(length)[None, None, :] <= rows[None, :, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v  # [H, R, Dv]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_the_oracle(cpu_kernels, case, dtype):
    n_kv, n_rep, positions, length, cap, dim, kb, vb, gs = case
    q = mx.random.normal((n_kv, n_rep * positions, dim), key=mx.random.key(length)).astype(dtype)
    keys, values = packed(n_kv, cap, dim, kb, gs, 1), packed(n_kv, cap, dim, vb, gs, 2)
    want = oracle(q, keys, values, length, dim ** -0.5, positions, gs, kb, vb)
    got = cpu_kernels.cpu_quant_attention(q, keys, values, length, dim ** -0.5, positions, gs, kb, vb)
    assert got.dtype == dtype and got.shape == (n_kv, n_rep * positions, dim)
    tol = 1e-5 if dtype == mx.float32 else 2.0 ** -7
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol * np.abs(want).max())
    ref = reference_quant_attention(q.astype(mx.float32), keys, values, length, dim ** -0.5, positions, gs)
    np.testing.assert_allclose(np.array(ref), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_dispatch_runs_the_kernel_for_decode_rows(cpu_kernels):
    """quant_attention takes the kernel for decode / verify rows and the row-chunked reference for more
    (prefill): both agree with the oracle."""
    keys, values = packed(2, 600, 64, 8, 64, 3), packed(2, 600, 64, 8, 64, 4)
    for rows, positions in ((6, 2), (600, 300)):
        q = mx.random.normal((2, rows, 64), key=mx.random.key(rows))
        want = oracle(q, keys, values, 600, 0.125, positions, 64, 8, 8)
        got = np.array(quant_attention(q, keys, values, 600, 0.125, positions, 64))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("edit, message", [
    (dict(length=0), "positions"),
    (dict(length=700), "positions"),
    (dict(positions=4), "multiple of positions"),
    (dict(q=mx.zeros((2, 3, 32))), "q must be"),
])
def test_bad_operands_are_refused(cpu_kernels, edit, message):
    keys, values = packed(2, 600, 64, 8, 64, 3), packed(2, 600, 64, 8, 64, 4)
    args = dict(q=mx.zeros((2, 3, 64)), length=10, positions=1)
    args.update(edit)
    with pytest.raises(ValueError, match=message):
        quant_attention(args["q"], keys, values, args["length"], 0.125, args["positions"], 64)


def test_kernel_refuses_mismatched_caches(cpu_kernels):
    keys, values = packed(1, 8, 64, 8, 64, 1), packed(1, 4, 64, 8, 64, 2)
    with pytest.raises(ValueError, match="same heads and rows"):
        cpu_kernels.cpu_quant_attention(mx.zeros((1, 1, 64)), keys, values, 4, 0.1, 1, 64, 8, 8)


VARIANT_CHECK = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    import numpy as np
    from mlx_infer.kernels import cpu
    sys.path.insert(0, sys.argv[1])
    from test_cpu_attention import CASES, oracle, packed
    assert cpu.isa() == sys.argv[2], cpu.isa()
    for n_kv, n_rep, positions, length, cap, dim, kb, vb, gs in CASES:
        q = mx.random.normal((n_kv, n_rep * positions, dim), key=mx.random.key(length))
        keys, values = packed(n_kv, cap, dim, kb, gs, 1), packed(n_kv, cap, dim, vb, gs, 2)
        want = oracle(q, keys, values, length, dim ** -0.5, positions, gs, kb, vb)
        got = cpu.cpu_quant_attention(q, keys, values, length, dim ** -0.5, positions, gs, kb, vb)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    print("ok")
""")


@pytest.mark.parametrize("variant", ["avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    """The AVX2 and portable variants of the attention kernel (which this machine may not pick)."""
    run_in_variant(VARIANT_CHECK, variant, tmp_path)


@pytest.mark.parametrize("n_kv, rows, length, cap, dim, kb, vb, gs", [
    (3, 3, 256, 320, 64, 4, 4, 64), (2, 4, 96, 128, 64, 8, 4, 32), (1, 2, 640, 640, 256, 4, 8, 64),
    (3, 9, 2048, 2304, 64, 4, 4, 32)])
def test_channel_keys_kernel_matches_the_oracle(cpu_kernels, n_kv, rows, length, cap, dim, kb, vb, gs):
    """KIVI's layout (each key channel quantized along tokens): out and the log-sum-exp against float64."""
    x = mx.random.normal((n_kv, dim, cap), key=mx.random.key(7)) * (1 + mx.arange(dim) % 7)[:, None]
    keys = mx.quantize(x.astype(mx.float16), group_size=gs, bits=kb)  # [H, D, C * kb / 32]
    values = packed(n_kv, cap + 64, dim, vb, gs, 8)  # more V rows than K: capacities may differ
    q = mx.random.normal((n_kv, rows, dim), key=mx.random.key(rows))
    k = np.array(mx.dequantize(keys[0], keys[1].astype(mx.float32), keys[2].astype(mx.float32), group_size=gs,
                               bits=kb), dtype=np.float64)[:, :, :length]  # [H, D, S]
    v = np.array(mx.dequantize(*(a[:, :length] for a in values[:1]), values[1][:, :length].astype(mx.float32),
                               values[2][:, :length].astype(mx.float32), group_size=gs, bits=vb), dtype=np.float64)
    scores = dim ** -0.5 * np.array(q, dtype=np.float64) @ k  # [H, R, S]
    lse = np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1)) + scores.max(-1)
    want = np.exp(scores - lse[..., None]) @ v
    out, got_lse = cpu_kernels.cpu_quant_attention(q, keys, values, length, dim ** -0.5, 1, gs, kb, vb,
                                                   channel_keys=True, with_lse=True)
    np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(np.array(got_lse), lse, rtol=1e-5, atol=1e-5)
