"""Helpers of the CLI tests (a module of its own: the conftest modules of the test folders share one name,
so test modules import these from here, never `from conftest import ...`)."""

import os
import shutil
import sys
from pathlib import Path
from typing import Optional

#: Per-command limit, there only to fail a hang: loading takes ~5-10 s and decoding ~8 tokens/s on a busy
#: 2-core CPU, and the CPU kernels are shared (tests/conftest.py), but how long a command takes depends on
#: the machine and what else runs on it.
TIMEOUT_S = 900


def entry_point() -> Optional[str]:
    """The `mlx-infer` script of the interpreter running the tests (its venv's bin dir), else PATH's."""
    here = Path(sys.executable).parent / ("mlx-infer.exe" if os.name == "nt" else "mlx-infer")
    return str(here) if here.exists() else shutil.which("mlx-infer")


def cli_env(**extra: str) -> dict:
    """The environment of a CLI run: never reach the network, wide rich output."""
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def assert_user_error(proc, contains: str = "") -> str:
    """Bad input: exit code 2, nothing on stdout, one `error: ...` line on stderr, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert contains.lower() in lines[0].lower(), lines[0]
    return lines[0]
