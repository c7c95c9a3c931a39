"""backend.limit_malloc_arenas (the server's cap on glibc's malloc arenas): threads that allocate share the
capped arenas (glibc's malloc_stats lists one "Arena N:" per arena), the user's MALLOC_ARENA_MAX wins, and
without the cap the same threads spread over several arenas."""

import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt / malloc_stats only")

#: A child that applies the cap (argv[1]: "cap" or "no"), then has 8 threads each hold malloc'd blocks at once
#: and prints what limit_malloc_arenas returned; glibc's malloc_stats writes the arenas to stderr.
CHILD = """
import ctypes, ctypes.util, sys, threading
from mlx_infer.backend import limit_malloc_arenas
applied = limit_malloc_arenas(1) if sys.argv[1] == "cap" else None
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(8)
def work():
    blocks = [libc.malloc(4096) for _ in range(64)]
    barrier.wait()
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()
print(applied)
"""


def arenas(mode: str, env: dict) -> tuple:
    """(what limit_malloc_arenas returned, the number of arenas malloc_stats lists) in a child."""
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), sum(line.startswith("Arena ") for line in out.stderr.splitlines())


def test_threads_share_the_capped_arena_and_the_users_setting_wins():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert ctypes.util.find_library("c")
    assert arenas("cap", env) == ("True", 1)
    applied, spread = arenas("no", env)
    assert spread > 1  # without the cap the 8 threads got arenas of their own
    assert arenas("cap", {**env, "MALLOC_ARENA_MAX": "3"})[0] == "False"
