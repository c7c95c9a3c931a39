"""The dispatcher (mlx_infer.kernels.qmm): backend choice, batched x, the wide (prefill) path with its
tiles, and the fallback to the pure-mx reference when the CPU kernels are off, missing or failed to
build. Tolerances as in test_cpu_qmm.py."""

import json
import types

import mlx.core as mx
import pytest

from qmm_helpers import magnitude, oracle, quantized
from mlx_infer.errors import MlxInferError
from mlx_infer.kernels import cpu
from mlx_infer.kernels.qmm import QMM_MAX_ROWS, WIDE_TILE_ROWS, qmm, qmm_backend, reference_qmm, wide_qmm

FLOAT32_TOL = 1e-5


def within(y, x, w, scales, biases, group_size, bits, tol=FLOAT32_TOL) -> bool:
    x2 = x.reshape(-1, x.shape[-1])
    ref = oracle(x2, w, scales, biases, group_size, bits)
    bound = tol * magnitude(x2, w, scales, biases, group_size, bits)
    return mx.all(mx.abs(y.reshape(ref.shape).astype(mx.float32) - ref) <= bound).item()


def test_backend_names_the_cpu_kernel(cpu_kernels):
    assert mx.default_device() == mx.cpu
    assert qmm_backend() == f"cpu-{cpu_kernels.isa()}"


def test_skinny_and_wide_batched_x(cpu_kernels):
    w, scales, biases = quantized(200, 128, 32, 4, mx.float16, seed=3)
    for shape in ((1, 1, 128), (2, 8, 128), (1, QMM_MAX_ROWS + 1, 128), (3, 40, 128), (1, 300, 128)):
        x = mx.random.normal(shape, key=mx.random.key(sum(shape)))
        y = qmm(x, w, scales, biases, 32, 4)
        assert y.shape == (*shape[:-1], 200) and y.dtype == mx.float32
        assert within(y, x, w, scales, biases, 32, 4), shape


def test_wide_path_tiles(cpu_kernels):
    """More weight rows than one wide tile: the tiles' products are concatenated in order."""
    n = WIDE_TILE_ROWS + 37
    w, scales, biases = quantized(n, 64, 32, 8, mx.float32, seed=9)
    x = mx.random.normal((20, 64), key=mx.random.key(1))
    y = wide_qmm(x, w, scales, biases, 32, 8)
    assert y.shape == (20, n)
    assert within(y, x, w, scales, biases, 32, 8)


def test_wide_path_keeps_half_precision_dtype(cpu_kernels):
    w, scales, biases = quantized(48, 128, 64, 4, mx.bfloat16, seed=2)
    x = mx.random.normal((30, 128), key=mx.random.key(5)).astype(mx.bfloat16)
    y = qmm(x, w, scales, biases, 64, 4)
    assert y.dtype == mx.bfloat16
    ref = oracle(x, w, scales, biases, 64, 4)
    assert mx.all(mx.abs(y.astype(mx.float32) - ref) <= 2**-7 * mx.abs(ref) + 1e-5
                  * magnitude(x, w, scales, biases, 64, 4)).item()


def test_turned_off_falls_back_to_the_reference(cpu_kernels, fresh_cpu):
    fresh_cpu.setenv(cpu.KERNELS_ENV, "off")
    assert not cpu.available()
    assert cpu.KERNELS_ENV in cpu.why_not()
    assert qmm_backend() == "reference"
    w, scales, biases = quantized(70, 256, 32, 4, mx.float32, seed=4)
    x = mx.random.normal((5, 256), key=mx.random.key(8))
    assert mx.array_equal(qmm(x, w, scales, biases, 32, 4), reference_qmm(x, w, scales, biases, 32, 4)).item()
    xw = mx.random.normal((33, 256), key=mx.random.key(9))  # the wide path without the kernels
    assert within(qmm(xw, w, scales, biases, 32, 4), xw, w, scales, biases, 32, 4)
    with pytest.raises(RuntimeError, match="not available"):
        cpu.cpu_qmm(x, w, scales, biases, 32, 4)


def test_missing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler" in cpu.missing_tools()
    with pytest.raises(MlxInferError, match="no C\\+\\+ compiler"):
        cpu.build_cpu_kernels(force=True)  # a rebuild; a cached build still loads without a compiler


def test_failed_build_is_recorded_and_falls_back(cpu_kernels, fresh_cpu, tmp_path):
    """A build that fails leaves its reason in failed.json, is not retried for the same sources, and the
    CPU path runs the reference."""
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.27)\nproject(x CXX)\n"
                                           "add_library(x SHARED missing_file.cpp)\n")
    fresh_cpu.setattr(cpu, "source_dir", lambda: broken)
    fresh_cpu.setenv("MLX_INFER_CACHE", str(tmp_path / "cache"))
    assert not cpu.available()
    assert "failed to build" in cpu.why_not()
    record = json.loads((cpu.build_dir() / "failed.json").read_text())
    assert "failed to build" in record["reason"]
    log = cpu.build_dir() / "build.log"
    stamp = log.stat().st_mtime_ns
    with pytest.raises(MlxInferError, match="failed to build"):
        cpu.build_cpu_kernels()  # the recorded failure, without running CMake again
    assert log.stat().st_mtime_ns == stamp
    assert qmm_backend() == "reference"
    w, scales, biases = quantized(16, 64, 32, 4, mx.float32)
    x = mx.random.normal((2, 64), key=mx.random.key(0))
    assert mx.array_equal(qmm(x, w, scales, biases, 32, 4), reference_qmm(x, w, scales, biases, 32, 4)).item()


def test_self_test_refuses_a_module_that_computes_wrong(cpu_kernels):
    """A module built against another ABI loads but misbehaves at its first call: the check at load time
    (a product of known value) passed for the real module (it is available) and refuses a wrong one."""
    assert cpu.available()
    wrong = types.SimpleNamespace(qmm=lambda x, w, s, b, gs, bits, stream=None: mx.zeros((x.shape[0], w.shape[0])))
    with pytest.raises(RuntimeError, match="wrong"):
        cpu.self_test(wrong)


def test_an_unwritable_cache_builds_in_a_temporary_folder(fresh_cpu, tmp_path):
    """A cache folder that cannot be written (here: under a plain file) warns once and builds the kernels in
    a temporary folder of the process instead of turning them off."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    fresh_cpu.setenv("MLX_INFER_CACHE", str(blocker / "cache"))
    fresh_cpu.delenv(cpu.KERNEL_DIR_ENV, raising=False)  # (not the session's shared build)
    with pytest.warns(UserWarning, match="building the CPU kernels in a temporary folder"):
        first = cpu.build_dir()
    assert first.is_dir() and not str(first).startswith(str(blocker))
    assert cpu.build_dir() == first  # the same folder for the rest of the process, no second warning
    assert cpu.module_path().parent == first


def test_each_build_has_its_own_folder(cpu_kernels, fresh_cpu):
    """Builds of other sources (another checkout or version) live in folders of their own beside this one,
    so they never rebuild over each other; a finished build keeps its module, not its object files."""
    here = cpu.build_dir()
    assert here.name.endswith(cpu.build_id()) and cpu.module_path().is_file()
    assert not (here / "build").exists()
    fresh_cpu.setattr(cpu, "_fingerprint", lambda: "0" * 16)
    other = cpu.build_dir()
    assert other != here and other.parent == here.parent and other.name.endswith("0" * 16)
