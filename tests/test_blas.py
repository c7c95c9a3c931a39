"""The CPU fast path's BLAS: OpenBLAS preloaded with the kernel family the CPU supports."""

import json
import os
import platform
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import blas as backend

AVX512 = {"sse3", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}


def test_kernel_family_from_flags():
    assert backend.openblas_core_for(AVX512) == "SkylakeX"
    assert backend.openblas_core_for({"sse3", "avx", "avx2", "fma"}) == "Haswell"
    assert backend.openblas_core_for(AVX512 - {"avx512bw"}) == "Haswell"  # AVX-512 F alone (Knights) is not SkylakeX
    assert backend.openblas_core_for({"sse3", "avx"}) is None
    assert backend.openblas_core_for(set()) is None


def _blas_in_a_fresh_process(env_extra: dict) -> dict:
    code = ("import os, json, mlx_infer; from mlx_infer import blas as backend; "
            "print(json.dumps({'blas': backend.blas_in_use(), 'core': backend.openblas_core(), "
            "'env': os.environ.get('OPENBLAS_CORETYPE')}))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_x86_openblas = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64" or backend.find_openblas() is None,
    reason="the kernel family is chosen for OpenBLAS on x86-64 Linux, and no OpenBLAS is installed here")


@needs_x86_openblas
def test_kernels_follow_the_cpu_and_leave_the_environment_alone():
    info = _blas_in_a_fresh_process({})
    expected = backend.openblas_core_for(backend.cpu_flags())
    if expected is None:
        pytest.skip("this CPU has neither AVX2 nor AVX-512: OpenBLAS chooses alone")
    assert info["core"] == expected
    assert f"{expected} kernels" in info["blas"]
    assert info["env"] is None  # set only while the library initialized


@needs_x86_openblas
def test_a_users_coretype_wins():
    info = _blas_in_a_fresh_process({"OPENBLAS_CORETYPE": "Prescott"})
    assert info["core"] == "Prescott"
    assert info["env"] == "Prescott"


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (9, 576, 49152 // 8), (64, 1536, 576), (257, 7, 5)])
def test_float_matmul_is_right_on_the_chosen_kernels(m, k, n):
    """MLX's float32 matmul (OpenBLAS sgemm here) against a float64 product, both operand layouts."""
    rng = np.random.default_rng(m * k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    want = a.astype(np.float64) @ w.T.astype(np.float64)
    for got in (mx.array(a) @ mx.array(w).T, mx.array(a) @ mx.array(np.ascontiguousarray(w.T))):
        err = np.abs(np.array(got) - want).max()
        assert err < 1e-5 * np.sqrt(k) * np.abs(want).max(), err


SPIN_CODE = """
import json, os, threading, time
import mlx_infer
import mlx.core as mx

def helper_cpu_s():  # CPU seconds of every thread but this one (OpenBLAS's workers among them)
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != threading.get_native_id():
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")

a = mx.random.normal((1024, 1024))
mx.eval(a @ a)
mx.eval(a @ a)  # OpenBLAS's workers took part: now they idle
before = helper_cpu_s()
time.sleep(0.3)
print(json.dumps({"idle_cpu_s": helper_cpu_s() - before, "env": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}))
"""


def _idle_spin(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", SPIN_CODE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or backend.find_openblas() is None or (os.cpu_count() or 1) < 2,
                    reason="needs Linux's /proc, a system OpenBLAS and 2 CPUs (a threaded OpenBLAS)")
def test_idle_openblas_workers_sleep_soon():
    """After a threaded product OpenBLAS's idle workers sleep within 2 ** OPENBLAS_THREAD_TIMEOUT_LOG2 cycles
    (the helper threads use no CPU while the process sleeps 0.3 s), where OpenBLAS's own default (a user's
    OPENBLAS_THREAD_TIMEOUT=28, which wins) spins them for about 0.1 s; the variable is not left behind."""
    ours, theirs = _idle_spin({}), _idle_spin({"OPENBLAS_THREAD_TIMEOUT": "28"})
    assert ours["env"] is None and theirs["env"] == "28"
    assert theirs["idle_cpu_s"] >= 0.03, theirs
    assert ours["idle_cpu_s"] <= 0.02, ours
