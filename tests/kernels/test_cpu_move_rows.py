"""The repacker's row move on the CPU kernel (cpu_kernels/move.cpp, kernels/move_rows.py): the same rows as
a NumPy oracle for every dtype, strides and overlapping moves; the input's buffer reused when MLX can donate
it (only the moved rows copied: the peak memory of a move stays far under the array's size, where the
reference's gather + scatter copies the whole array), and left untouched when something else holds it. And
write_rows, a batched step's write of its new K / V rows into a pool plane, against the same oracle."""

import gc

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer.kernels.move_rows import move_rows, reference_move_rows, write_rows
from qmm_helpers import ops_in_graph
from mlx_infer.kv import BlockPool, PagedSequence
from mlx_infer.kv.cache import PagedKVCache
from mlx_infer.kv.repack import Repacker


def oracle(a: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    out = a.copy()
    out[dst] = a[src]  # NumPy reads the right side first
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.uint32])
def test_moves_equal_the_oracle_for_every_dtype(cpu_kernels, dtype):
    rng = np.random.default_rng(1)
    base = rng.integers(0, 60000, (64, 24))
    src = rng.permutation(64)[:20].astype(np.int32)
    dst = rng.permutation(64)[:20].astype(np.int32)
    a = mx.array(base).astype(dtype)
    got = cpu_kernels.cpu_move_rows(a, mx.array(src), mx.array(dst))
    want = oracle(np.array(a.astype(mx.float32)), src, dst)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    assert got.dtype == dtype


def test_overlapping_moves_read_before_writing(cpu_kernels):
    """A chain 0 -> 1 -> 2 -> 3 and a swap 10 <-> 11: each destination is another move's source."""
    a = mx.array(np.arange(16 * 4, dtype=np.float32).reshape(16, 4))
    src, dst = np.array([0, 1, 2, 10, 11], np.int32), np.array([1, 2, 3, 11, 10], np.int32)
    got = cpu_kernels.cpu_move_rows(a, mx.array(src), mx.array(dst))
    np.testing.assert_array_equal(np.array(got), oracle(np.array(a), src, dst))


def test_a_strided_input_and_the_reference_agree(cpu_kernels):
    full = mx.array(np.random.default_rng(2).standard_normal((32, 48)).astype(np.float32))
    a = full.T[:, ::3]  # [48, 11], not row-contiguous
    src, dst = mx.array(np.array([5, 40, 7], np.int32)), mx.array(np.array([0, 1, 40], np.int32))
    got = cpu_kernels.cpu_move_rows(a, src, dst)
    np.testing.assert_array_equal(np.array(got), oracle(np.array(a), np.array(src), np.array(dst)))
    np.testing.assert_array_equal(np.array(got), np.array(reference_move_rows(mx.array(a), src, dst)))


def test_a_held_input_is_left_untouched(cpu_kernels):
    a = mx.array(np.arange(40, dtype=np.float32).reshape(10, 4))
    mx.eval(a)
    before = np.array(a)
    got = cpu_kernels.cpu_move_rows(a, mx.array(np.array([9], np.int32)), mx.array(np.array([0], np.int32)))
    mx.eval(got)
    np.testing.assert_array_equal(np.array(a), before)
    np.testing.assert_array_equal(np.array(got)[0], before[9])


def peak_of_move(fn, rows: int, width: int, want=oracle) -> int:
    """Peak bytes above the evaluated input while `fn` moves 64 rows of a float32 [rows, width] array that
    nothing else holds (its result checked against want(a, src, dst))."""
    a = mx.array(np.random.default_rng(3).standard_normal((rows, width)).astype(np.float32))
    mx.eval(a)
    src = mx.array(np.arange(0, 128, 2, dtype=np.int32))
    dst = mx.array(np.arange(rows - 64, rows, dtype=np.int32))
    mx.eval(src, dst)
    want = want(np.array(a), np.array(src), np.array(dst))
    gc.collect()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    a = fn(a, src, dst)  # the old `a` is held by the move alone
    mx.eval(a)
    peak = mx.get_peak_memory() - base
    np.testing.assert_array_equal(np.array(a), want)
    return peak


def test_the_kernel_moves_in_place(cpu_kernels):
    # The reference (gather, then a scatter into the same array) copies the whole array when the gather
    # still holds it as the scatter runs, which depends on MLX's evaluation order: not asserted here.
    rows, width = 1 << 15, 64  # 8 MiB
    nbytes = rows * width * 4
    assert peak_of_move(cpu_kernels.cpu_move_rows, rows, width) < nbytes // 8


def test_a_pool_repack_on_the_kernel_copies_only_the_moved_tokens(cpu_kernels):
    """BlockPool.move through kernels.move_rows: a repack of 128 blocks' live quarter keeps the values and
    adds far less than the pool's size to MLX's peak memory."""
    layers, n_kv, d, bs, blocks = 2, 2, 64, 16, 128
    pool = BlockPool(layers, block_size=bs)
    seq = PagedSequence(pool, layers)
    caches = [PagedKVCache(seq, i) for i in range(layers)]
    rng = np.random.default_rng(4)
    for c in caches:
        kv = mx.array(rng.standard_normal((1, n_kv, blocks * bs, d)).astype(np.float32))
        c.update_and_fetch(kv, kv + 1)
    mx.eval(pool.arrays())
    keep = np.arange(0, blocks * bs, 4)
    want = [np.array(c.state[0])[:, :, keep] for c in caches]
    seq.evict(np.setdiff1d(np.arange(blocks * bs), keep))
    gc.collect()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    plan = Repacker(low_watermark=None, max_moves=None).maybe_repack(seq)
    mx.eval(pool.arrays())
    peak = mx.get_peak_memory() - base
    assert plan is not None and plan.saved == blocks - blocks // 4
    assert peak < pool.nbytes // 4, (peak, pool.nbytes)
    for layer, c in enumerate(caches):
        np.testing.assert_array_equal(np.array(c.state[0]), want[layer])


def test_bad_operands_are_refused(cpu_kernels):
    idx = mx.array(np.array([0], np.int32))
    with pytest.raises(ValueError, match="must be"):
        cpu_kernels.cpu_move_rows(mx.zeros((2, 3, 4)), idx, idx)
    with pytest.raises(ValueError, match="int32"):
        cpu_kernels.cpu_move_rows(mx.zeros((4, 4)), idx.astype(mx.int64), idx)
    with pytest.raises(ValueError, match="int32"):
        move_rows(mx.zeros((4, 4)), idx, mx.array(np.array([0, 1], np.int32)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.uint32])
def test_written_rows_equal_the_oracle(cpu_kernels, dtype):
    """write_rows of x [B, n_kv, L, W] (rows in that order, strided too) equals NumPy's out[dst] = rows, as
    one operation, in place when nothing else holds the array; a held array is left untouched."""
    rng = np.random.default_rng(5)
    base = mx.array(rng.integers(0, 60000, (64, 24))).astype(dtype)
    x = mx.array(rng.integers(0, 60000, (2, 3, 1, 24))).astype(dtype)
    dst = mx.array(rng.permutation(64)[:6].astype(np.int32))
    mx.eval(base, x, dst)
    want = np.array(base.astype(mx.float32))
    want[np.array(dst)] = np.array(x.astype(mx.float32)).reshape(6, 24)
    held = np.array(base.astype(mx.float32))
    got = write_rows(base, x, dst)
    assert ops_in_graph(got) == ["MlxInferWriteRows"] and got.dtype == dtype
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    np.testing.assert_array_equal(np.array(base.astype(mx.float32)), held)  # `base` was held: copied
    strided = mx.array(np.array(x.astype(mx.float32)).reshape(6, 24).T.copy()).astype(dtype).T  # [6, 24], columns
    np.testing.assert_array_equal(np.array(write_rows(base, strided, dst).astype(mx.float32)), want)
    with pytest.raises(ValueError, match="write_rows"):
        write_rows(base, x[..., :20], dst)
    with pytest.raises(ValueError, match="write_rows"):
        write_rows(base, x, dst[:3])


def test_rows_are_written_in_place(cpu_kernels):
    rows, width = 1 << 15, 64  # 8 MiB
    x = np.ones((6, width), np.float32)
    peak = peak_of_move(lambda a, src, dst: write_rows(a, mx.array(x), dst[:6]), rows, width,
                        want=lambda a, src, dst: written(a, x, dst[:6]))
    assert peak < rows * width * 4 // 8


def written(a: np.ndarray, x: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The oracle of write_rows: a with row dst[i] replaced by x[i]."""
    out = a.copy()
    out[dst] = x
    return out
