"""What a benchmark ran on: the chip or CPU model, cores, memory, OS, Python, MLX and mlx-lm versions, the
backend and BLAS (the rest of `mlx-infer doctor --json`, which kernels run, is merged in by the CLI)."""

import os
import platform
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx

from ..backend import backend_name, blas_in_use, total_memory_bytes


def cpu_model() -> str:
    """The CPU's or chip's marketing name: /proc/cpuinfo's "model name" on Linux, sysctl's
    machdep.cpu.brand_string on macOS ("Apple M3 Pro"), else platform.processor() or the machine type."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(errors="replace"), re.M)
        if found:
            return found.group(1).strip()
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except OSError:
            pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str:
    """An installed distribution's version, or "not installed"."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def describe() -> dict:
    """The machine as plain JSON-ready values: cpu, cores, memory_bytes, os, python, mlx, mlx_lm, backend,
    device (MLX's default device and its name where MLX gives one), blas."""
    try:
        device_name = mx.device_info().get("device_name")
    except Exception:  # an MLX without device_info, or none on this backend
        device_name = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": total_memory_bytes(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": package_version("mlx-lm"),
        "mlx_infer": package_version("mlx-infer"),
        "backend": backend_name(),
        "device": str(mx.default_device()) + (f" ({device_name})" if device_name else ""),
        "blas": blas_in_use(),
    }
