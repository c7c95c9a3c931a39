"""RMM's reduced quantized matmul (arXiv 2608.13426) on the CPU kernel and in the pure-mx reference, against
a NumPy oracle written from the rule: per row, score each quantization group by sum |x|, keep the `keep`
largest (equal scores: the lower index), multiply only those (float64).

Tolerance as test_cpu_qmm.py: a few float32 roundings of the kept terms' total size."""

import textwrap

import mlx.core as mx
import numpy as np
import pytest
from qmm_helpers import quantized, run_in_variant

from mlx_infer.kernels.rmm import group_keep, reference_rmm_qmm, rmm_qmm

FLOAT32_TOL = 1e-5


def kept_groups(x: np.ndarray, group_size: int, keep: int) -> np.ndarray:
    """[M, G] bool: the oracle's selection (Python's sort on (-score, index))."""
    rows, k = x.shape
    out = np.zeros((rows, k // group_size), dtype=bool)
    for m in range(rows):
        scores = [float(np.abs(x[m, g * group_size:(g + 1) * group_size]).sum()) for g in range(k // group_size)]
        for g in sorted(range(len(scores)), key=lambda g: (-scores[g], g))[:keep]:
            out[m, g] = True
    return out


def oracle(x, w, scales, biases, group_size, bits, keep):
    """(y [M, N] float64, size [M, N]: sum of |kept terms|) from the rule."""
    xf = np.array(x.astype(mx.float32)).astype(np.float64)
    wf = np.array(mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                                bits=bits)).astype(np.float64)
    mask = np.repeat(kept_groups(xf, group_size, keep), group_size, axis=1)
    xr = np.where(mask, xf, 0.0)
    return xr @ wf.T, np.abs(xr) @ np.abs(wf).T


def assert_close(y, x, w, scales, biases, group_size, bits, keep):
    ref, size = oracle(x, w, scales, biases, group_size, bits, keep)
    err = np.abs(np.array(y.astype(mx.float32)).astype(np.float64) - ref)
    tol = FLOAT32_TOL * size + (0 if y.dtype == mx.float32 else 2.0**-7) * np.abs(ref)
    assert (err <= tol).all(), f"max error {err.max():.3g} over the bound by {(err - tol).max():.3g}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_kernel_matches_the_rule(cpu_kernels, bits, group_size):
    n, k = 37, 512
    groups = k // group_size
    w, scales, biases = quantized(n, k, group_size, bits, mx.float16, seed=bits + group_size)
    for m in (1, 2, 5, 16):
        x = mx.random.normal((m, k), key=mx.random.key(m))
        for keep in sorted({1, groups // 2, groups - 1}):
            y = cpu_kernels.cpu_rmm_qmm(x, w, scales, biases, group_size, bits, keep)
            assert y.shape == (m, n) and y.dtype == mx.float32
            assert_close(y, x, w, scales, biases, group_size, bits, keep)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_half_precision_activations(cpu_kernels, dtype):
    w, scales, biases = quantized(64, 576, 32, 4, dtype, seed=3)
    x = mx.random.normal((3, 576), key=mx.random.key(9)).astype(dtype)
    y = cpu_kernels.cpu_rmm_qmm(x, w, scales, biases, 32, 4, 9)
    assert y.dtype == dtype
    assert_close(y, x, w, scales, biases, 32, 4, 9)


def test_equal_scores_keep_the_lower_group(cpu_kernels):
    """Groups whose |x| sums are exactly equal (permutations of the same small integers): the lower index
    wins, as the rule says, in the kernel and the reference alike."""
    k, gs = 256, 32
    base = np.arange(1, gs + 1, dtype=np.float32) / 8
    rng = np.random.default_rng(0)
    row = np.concatenate([rng.permutation(base) * (1 if g % 3 else -1) for g in range(k // gs)])
    x = mx.array(np.stack([row, row[::-1].copy()]))  # [2, K]: every group ties
    w, scales, biases = quantized(40, k, gs, 4, mx.float32, seed=1)
    for keep in (1, 3, 7):
        mask = kept_groups(np.array(x), gs, keep)
        assert mask[0, :keep].all() and not mask[0, keep:].any()  # the oracle itself: lowest indices
        for y in (cpu_kernels.cpu_rmm_qmm(x, w, scales, biases, gs, 4, keep),
                  reference_rmm_qmm(x, w, scales, biases, gs, 4, keep)):
            assert_close(y, x, w, scales, biases, gs, 4, keep)


def test_groups_no_row_keeps_are_never_read(cpu_kernels):
    """NaN scales and biases on every group no row keeps: the kernel's result stays finite and right (the
    masked reference, which reads them, would turn NaN)."""
    k, gs, keep = 512, 64, 3
    x = np.random.default_rng(1).normal(size=(2, k)).astype(np.float32)
    x[:, gs * 5:gs * 8] *= 20  # both rows keep groups 5, 6, 7
    x = mx.array(x)
    w, scales, biases = quantized(33, k, gs, 8, mx.float32, seed=2)
    ref, _ = oracle(x, w, scales, biases, gs, 8, keep)
    unread = ~kept_groups(np.array(x), gs, keep).any(axis=0)
    assert unread.sum() == k // gs - keep
    poison = mx.array(np.where(unread[None, :], np.nan, 0.0).astype(np.float32))
    y = cpu_kernels.cpu_rmm_qmm(x, w, scales + poison, biases + poison, gs, 8, keep)
    assert np.isfinite(np.array(y)).all()
    assert np.allclose(np.array(y), ref, rtol=1e-4, atol=1e-4)
    assert np.isnan(np.array(reference_rmm_qmm(x, w, scales + poison, biases + poison, gs, 8, keep))).any()


def test_rows_select_on_their_own(cpu_kernels):
    """A row's product does not depend on the rows beside it: one 9-row call equals nine 1-row calls."""
    w, scales, biases = quantized(96, 576, 32, 4, mx.float16, seed=5)
    x = mx.random.normal((9, 576), key=mx.random.key(4))
    together = np.array(cpu_kernels.cpu_rmm_qmm(x, w, scales, biases, 32, 4, 7))
    alone = np.concatenate([np.array(cpu_kernels.cpu_rmm_qmm(x[i:i + 1], w, scales, biases, 32, 4, 7))
                            for i in range(9)])
    assert np.allclose(together, alone, rtol=1e-5, atol=1e-5)


def test_dispatch_full_retention_is_qmm_and_wide_rows_use_the_reference(cpu_kernels):
    w, scales, biases = quantized(50, 256, 32, 4, mx.float32, seed=6)
    x = mx.random.normal((2, 20, 256), key=mx.random.key(6))  # 40 rows: more than the skinny kernel takes
    y = rmm_qmm(x, w, scales, biases, 32, 4, 5)
    assert y.shape == (2, 20, 50)
    assert_close(y.reshape(40, 50), x.reshape(40, 256), w, scales, biases, 32, 4, 5)
    full = rmm_qmm(x[0, :3], w, scales, biases, 32, 4, 8)
    assert_close(full, x[0, :3], w, scales, biases, 32, 4, 8)


def test_bad_keep(cpu_kernels):
    w, scales, biases = quantized(8, 128, 32, 4, mx.float32)
    x = mx.zeros((1, 128))
    for keep in (0, 5):
        with pytest.raises(ValueError, match="keep must be in"):
            rmm_qmm(x, w, scales, biases, 32, 4, keep)
        with pytest.raises(ValueError, match="keep must be in"):
            cpu_kernels.cpu_rmm_qmm(x, w, scales, biases, 32, 4, keep)


@pytest.mark.parametrize("retention,groups,keep", [(1.0, 18, 18), (0.5, 18, 9), (0.75, 18, 14), (0.01, 18, 1),
                                                   (0.5, 48, 24), (0.9, 48, 44)])
def test_group_keep_is_ceil(retention, groups, keep):
    assert group_keep(groups * 32, 32, retention) == keep


@pytest.mark.parametrize("variant", ["avx2", "generic"])
def test_other_instruction_sets(cpu_kernels, variant, tmp_path):
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import mlx.core as mx
        from qmm_helpers import quantized
        from test_cpu_rmm import assert_close
        from mlx_infer.kernels import cpu
        assert cpu.isa() == sys.argv[2], cpu.isa()
        for bits in (4, 8):
            w, scales, biases = quantized(21, 384, 32, bits, mx.float16, seed=bits)
            for m in (1, 4, 7):
                x = mx.random.normal((m, 384), key=mx.random.key(m))
                assert_close(cpu.cpu_rmm_qmm(x, w, scales, biases, 32, bits, 5), x, w, scales, biases, 32, bits, 5)
    """)
    run_in_variant(script, variant, tmp_path)
