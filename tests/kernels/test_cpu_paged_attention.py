"""The CPU paged-attention kernel (cpu_kernels/attn_body.h, PagedRows) against a float64 numpy oracle, and the
pure-mx reference (kernels.paged_attention.reference_paged_attention) against the same oracle: ragged requests
whose live tokens lie scattered over a pool (evicted tokens: non-contiguous positions), GQA groups, decode
and verify widths, sliding windows, float32 / float16 / bfloat16 pools and queries."""

import textwrap

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import run_in_variant

from mlx_infer.kernels.paged_attention import PAGED_MAX_QUERIES, paged_attention, reference_paged_attention

#: (lengths (live tokens per request), n_kv, n_rep, L, head dim, v head dim, window): one request and
#: several, lengths below / across the kernel's 32-key tiles and 256-key splits, a GQA group of 1 to 4 heads,
#: decode (L 1) and verify widths up to 16, sliding windows shorter than the context.
CASES = [
    ((700,), 3, 3, 1, 64, 64, 0),
    ((100, 37, 260, 5), 3, 3, 1, 64, 64, 0),
    ((1100,), 1, 4, 2, 128, 64, 0),
    ((33, 80), 2, 1, 4, 64, 128, 0),
    ((300, 120, 64), 2, 2, 16, 64, 64, 0),
    ((500, 90), 3, 3, 1, 64, 64, 40),
    ((200, 31, 170), 2, 2, 8, 32, 32, 16),
    ((1, 17), 1, 2, 1, 16, 16, 0),
]


def case_operands(lengths, n_kv, n_rep, L, dim, v_dim, dtype, seed=0):
    """A pool of 4096 slots per head and B requests (numpy operands): request b's live tokens are lengths[b]
    random slots (ascending positions with holes: evicted tokens), right-padded to S with slot 0 and
    position -1; its L queries stand at the positions of its last L live tokens (with fewer, at the L
    positions up to its last one). Returns (q, k_pool, v_pool, index, lengths, q_pos, k_pos) as mx arrays."""
    rng = np.random.default_rng(seed)
    B, S, slots = len(lengths), max(lengths), 4096
    k_pool = rng.standard_normal((n_kv * slots, dim)) * (1 + np.arange(dim) % 5)
    v_pool = rng.standard_normal((n_kv * slots, v_dim))
    index = np.zeros((B, n_kv, S), np.int32)
    k_pos = np.full((B, S), -1, np.int32)
    q_pos = np.zeros((B, L), np.int32)
    for b, n in enumerate(lengths):
        live = rng.choice(slots, n, replace=False)
        index[b, :, :n] = np.arange(n_kv)[:, None] * slots + live[None]
        pos = np.sort(rng.choice(3 * n + L, n, replace=False))  # original positions with holes
        k_pos[b, :n] = pos
        q_pos[b] = pos[-L:] if n >= L else pos[-1] - L + 1 + np.arange(L)  # the newest tokens' positions
    q = rng.standard_normal((B, n_kv * n_rep, L, dim))
    arrays = [mx.array(q.astype(np.float32)).astype(dtype), mx.array(k_pool.astype(np.float32)).astype(dtype),
              mx.array(v_pool.astype(np.float32)).astype(dtype)]
    return (*arrays, mx.array(index), mx.array(np.array(lengths, np.int32)), mx.array(q_pos), mx.array(k_pos))


def oracle(q, k_pool, v_pool, index, lengths, q_pos, k_pos, scale, window):
    """float64 numpy attention: per request and query, softmax over the visible live keys (t < lengths[b],
    index a pool row, k_pos <= q_pos, q_pos - k_pos < window when window > 0); zeros when none is visible."""
    f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)  # noqa: E731
    q, kp, vp = f64(q), f64(k_pool), f64(v_pool)
    index, lengths, q_pos, k_pos = (np.array(a) for a in (index, lengths, q_pos, k_pos))
    B, n_q, L, _ = q.shape
    n_kv = index.shape[1]
    out = np.zeros((B, n_q, L, vp.shape[1]))
    for b in range(B):
        for g in range(n_q):
            rows = index[b, g // (n_q // n_kv), : lengths[b]]
            for i in range(L):
                p, k = q_pos[b, i], k_pos[b, : lengths[b]]
                seen = (k <= p) & (rows >= 0) & (rows < kp.shape[0])
                if window > 0:
                    seen &= p - k < window
                if not seen.any():
                    continue
                s = scale * kp[rows[seen]] @ q[b, g, i]
                w = np.exp(s - s.max())
                out[b, g, i] = (w / w.sum()) @ vp[rows[seen]]
    return out


TOLERANCE = {mx.float32: 1e-5, mx.float16: 2.0 ** -9, mx.bfloat16: 2.0 ** -7}


def assert_close(got, want, dtype):
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(", ", "_"))
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_kernel_matches_the_oracle(cpu_kernels, case, dtype):
    lengths, n_kv, n_rep, L, dim, v_dim, window = case
    ops = case_operands(lengths, n_kv, n_rep, L, dim, v_dim, dtype, seed=len(lengths) + L)
    want = oracle(*ops, dim ** -0.5, window)
    got = cpu_kernels.cpu_paged_attention(*ops, dim ** -0.5, window)
    assert got.dtype == dtype and got.shape == (len(lengths), n_kv * n_rep, L, v_dim)
    assert_close(got, want, dtype)
    if dtype == mx.float32:
        assert_close(reference_paged_attention(*ops, dim ** -0.5, window), want, dtype)


def test_hidden_keys_and_blind_queries(cpu_kernels):
    """An index outside the pool is a key nobody sees; a query before every key (a left-padded column) gets
    zeros from the kernel and from the reference."""
    q, kp, vp, index, lengths, q_pos, k_pos = case_operands((40, 40), 2, 2, 2, 64, 64, mx.float32, seed=5)
    idx = np.array(index)
    idx[0, 1, 3], idx[1, 0, 7], idx[1, 1, 0] = -5, kp.shape[0], 2 ** 31 - 1
    qp = np.array(q_pos)
    qp[1, 0] = np.array(k_pos)[1, 0] - 1  # sees nothing
    ops = (q, kp, vp, mx.array(idx), lengths, mx.array(qp), k_pos)
    want = oracle(*ops, 0.125, 0)
    got = cpu_kernels.cpu_paged_attention(*ops, 0.125, 0)
    assert not np.array(got[1, :, 0]).any() and np.isfinite(np.array(got)).all()
    assert_close(got, want, mx.float32)
    assert_close(reference_paged_attention(*ops, 0.125, 0), want, mx.float32)


def test_dispatch_runs_the_kernel_at_every_width(cpu_kernels, monkeypatch):
    """paged_attention takes the kernel at every width: one call up to PAGED_MAX_QUERIES positions, blocks of
    that many beyond (a batched prefill chunk); both agree with the oracle, and each row of the wider forward
    equals, bit for bit, the same query's row computed alone (a one-token step)."""
    calls = []
    real = cpu_kernels.cpu_paged_attention
    monkeypatch.setattr(cpu_kernels, "cpu_paged_attention", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    for L in (PAGED_MAX_QUERIES, PAGED_MAX_QUERIES + 4):
        ops = case_operands((90, 300), 3, 3, L, 64, 64, mx.float32, seed=L)
        got = paged_attention(*ops, 0.125, 24)
        np.testing.assert_allclose(np.array(got), oracle(*ops, 0.125, 24), rtol=1e-5, atol=1e-5)
    assert calls == [PAGED_MAX_QUERIES, PAGED_MAX_QUERIES, 4]
    q, kp, vp, index, lengths, q_pos, k_pos = ops
    for t in (0, PAGED_MAX_QUERIES - 1, PAGED_MAX_QUERIES + 3):
        alone = paged_attention(q[:, :, t:t + 1], kp, vp, index, lengths, q_pos[:, t:t + 1], k_pos, 0.125, 24)
        assert mx.array_equal(alone, got[:, :, t:t + 1]).item()


@pytest.mark.parametrize("L", [1, PAGED_MAX_QUERIES + 4])
def test_pools_with_leading_dims_are_their_rows(cpu_kernels, L):
    """Pools given as [2, 3, 2048, D] (a dense cache's buffer [B, n_kv, capacity, D]) are read as their
    12,288 rows: the kernel's result equals, bit for bit, the one over the same pools reshaped to [rows, D],
    past PAGED_MAX_QUERIES (in blocks) too."""
    q, kp, vp, *rest = case_operands((90, 300), 3, 2, L, 64, 32, mx.float32, seed=7)
    k4, v4 = kp.reshape(2, 3, 2048, 64), vp.reshape(2, 3, 2048, 32)
    got = paged_attention(q, k4, v4, *rest, 0.125, 0)
    assert mx.array_equal(got, paged_attention(q, kp, vp, *rest, 0.125, 0)).item()
    assert_close(got, oracle(q, kp, vp, *rest, 0.125, 0), mx.float32)


def bad(edit):
    """The operands of a good call (B 2, n_q 4, n_kv 2, L 1, S 8, D 64) with `edit` applied."""
    ops = dict(q=mx.zeros((2, 4, 1, 64)), k_pool=mx.zeros((32, 64)), v_pool=mx.zeros((32, 64)),
               index=mx.zeros((2, 2, 8), mx.int32), lengths=mx.full((2,), 8, mx.int32),
               q_pos=mx.zeros((2, 1), mx.int32), k_pos=mx.zeros((2, 8), mx.int32), window=0)
    ops.update(edit)
    return ops


BAD = [
    (dict(q=mx.zeros((4, 1, 64))), "q must be"),
    (dict(q=mx.zeros((2, 4, 1, 64), mx.int32)), "q must be float32"),
    (dict(v_pool=mx.zeros((31, 64))), "k_pool and v_pool"),
    (dict(v_pool=mx.zeros((32, 64), mx.float16)), "k_pool and v_pool"),
    (dict(k_pool=mx.zeros((2, 16, 64)), v_pool=mx.zeros((4, 8, 64))), "k_pool and v_pool"),
    (dict(k_pool=mx.zeros((32, 32))), "head dims"),
    (dict(q=mx.zeros((2, 4, 1, 24)), k_pool=mx.zeros((32, 24))), "multiples of 16"),
    (dict(q=mx.zeros((2, 3, 1, 64))), "multiple of n_kv"),
    (dict(index=mx.zeros((2, 2, 8), mx.int64)), "index must be int32"),
    (dict(lengths=mx.zeros((3,), mx.int32)), "lengths must be int32"),
    (dict(q_pos=mx.zeros((2, 2), mx.int32)), "q_pos must be int32"),
    (dict(k_pos=mx.zeros((2, 8), mx.float32)), "k_pos must be int32"),
    (dict(window=-1), "window must be >= 0"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m for _, m in BAD])
def test_kernel_refuses_bad_operands(cpu_kernels, edit, message):
    ops = bad(edit)
    window = ops.pop("window")
    with pytest.raises(ValueError, match=message):
        cpu_kernels.cpu_paged_attention(*ops.values(), 0.125, window)


@pytest.mark.parametrize("edit, message", [
    (dict(q=mx.zeros((2, 4, 20, 64)), q_pos=mx.zeros((2, 3), mx.int32)), "q_pos must be int32 \\[2, 20\\]"),
    (dict(q=mx.zeros((2, 4, 20, 64)), q_pos=mx.zeros((2, 20), mx.int32), window=-1), "window must be >= 0"),
    (dict(q=mx.zeros((2, 3, 20, 64)), q_pos=mx.zeros((2, 20), mx.int32)), "n_q a multiple of n_kv"),
])
def test_blocked_dispatch_refuses_bad_operands(cpu_kernels, edit, message):
    """Past PAGED_MAX_QUERIES (the kernel in blocks) the dispatch checks the whole forward's operands itself, so
    the error names their shapes, not a block's."""
    ops = bad(edit)
    window = ops.pop("window")
    with pytest.raises(ValueError, match=message):
        paged_attention(*ops.values(), 0.125, window)


VARIANT_CHECK = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    import numpy as np
    from mlx_infer.kernels import cpu
    sys.path.insert(0, sys.argv[1])
    from test_cpu_paged_attention import CASES, assert_close, case_operands, oracle
    assert cpu.isa() == sys.argv[2], cpu.isa()
    for dtype in (mx.float32, mx.float16):
        for lengths, n_kv, n_rep, L, dim, v_dim, window in CASES:
            ops = case_operands(lengths, n_kv, n_rep, L, dim, v_dim, dtype, seed=len(lengths) + L)
            assert_close(cpu.cpu_paged_attention(*ops, dim ** -0.5, window), oracle(*ops, dim ** -0.5, window), dtype)
    print("ok")
""")


@pytest.mark.parametrize("variant", ["avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    """The AVX2 and portable variants of the paged kernel (which this machine may not pick)."""
    run_in_variant(VARIANT_CHECK, variant, tmp_path)
