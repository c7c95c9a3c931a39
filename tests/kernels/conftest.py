"""Fixtures of the CPU kernel tests: the extension, built here (as CI builds it on a fresh machine)."""

import mlx_infer  # noqa: F401  (first: the optimized BLAS, as users get it)
import pytest

from mlx_infer.kernels import cpu


@pytest.fixture(scope="session")
def cpu_kernels(mlx_infer_cache):
    """The CPU kernels module (mlx_infer.kernels.cpu), built into the session's cache. Skips only where no
    C++ compiler exists; a missing build tool or a failed build is an error."""
    if cpu.find_compiler() is None:
        pytest.skip("no C++ compiler here: the CPU kernels cannot be built")
    cpu.build_cpu_kernels(quiet=True)
    cpu.refresh()  # found again in the session's cache
    assert cpu.available(), cpu.why_not()
    return cpu


@pytest.fixture
def fresh_cpu(monkeypatch):
    """For tests that change the kernels' environment ($MLX_INFER_KERNELS, the cache) with monkeypatch: the
    CPU module reads it again now, and again once monkeypatch has restored it."""
    cpu.refresh()
    yield monkeypatch
    cpu.refresh()
