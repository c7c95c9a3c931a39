"""The pieces of the CPU kernels' build that mlx_infer.kernels.cpu puts together: which x86 variants to
compile, a cmake command run so that it never outlives this process, the build's progress on stderr, and
the removal of build trees that killed builds left behind.

A first build compiles one instruction set, the best this CPU runs (and the variant $MLX_INFER_KERNEL_ISA
names, when it runs here): on a 2-core AVX2 Zen 3 that is about half of building all four. A variant asked
for later is built then, with those already built (cpu.build_cpu_kernels).
"""

import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from mlx_infer.kernels.build_guard import TIMED_OUT  # noqa: F401  (the guard's exit status past its time limit)

try:
    import fcntl
except ImportError:  # (Windows: no flock; build trees are then never taken for stale)
    fcntl = None

#: The x86 variants a build may hold (cpu_kernels/CMakeLists.txt's MLX_INFER_VARIANTS); the generic C++
#: variant is always built, and off x86 none of these.
VARIANTS = ("avx512", "avx2", "avx512vnni", "avx2int8")
#: The int8-activation variants extend a plain one: building one builds the other.
VARIANT_BASE = {"avx512vnni": "avx512", "avx2int8": "avx2"}
#: /proc/cpuinfo flags each variant needs (cpu_kernels/qmm.cpp's x86_features).
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
VARIANT_FLAGS = {
    "avx512": _AVX512_FLAGS,
    "avx2": ("avx2", "fma"),
    "avx512vnni": (*_AVX512_FLAGS, "avx512_vnni"),
    "avx2int8": ("avx2", "fma"),
}
#: The script that runs each cmake command (see its docstring), started with `python -I`.
GUARD = Path(__file__).with_name("build_guard.py")
#: The file in each build tree that its builder (build_guard.py) holds locked while it runs.
TREE_LOCK = ".builder.lock"
#: Prefix of the build trees' names inside a kernels folder (one fresh tree per build).
TREE_PREFIX = "build-"
#: Seconds to wait for the guard to stop a build this process gave up on (it stops it within ~10 s).
GUARD_EXIT_S = 30

_PERCENT = re.compile(r"^\[\s*(\d+)%\]")  # make: "[ 45%] Building CXX object ..."
_FRACTION = re.compile(r"^\[(\d+)/(\d+)\]")  # ninja: "[9/17] Building CXX object ..."


def is_x86() -> bool:
    """Whether this machine is x86-64 (where the variants exist)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> Optional[frozenset]:
    """The CPU's feature flags (Linux's /proc/cpuinfo `flags` line), or None where they cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def with_bases(variants: Iterable[str]) -> tuple:
    """The variants with the plain variant each int8 one extends, in VARIANTS' order. Raises ValueError
    for a name not in VARIANTS."""
    chosen = set(variants)
    unknown = chosen - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown kernel variants {sorted(unknown)}: use {', '.join(VARIANTS)}")
    chosen |= {VARIANT_BASE[v] for v in chosen if v in VARIANT_BASE}
    return tuple(v for v in VARIANTS if v in chosen)


def runnable_variants(flags: Optional[frozenset] = None) -> tuple:
    """The variants this CPU runs, in VARIANTS' order: () off x86; all of them where the flags cannot be
    read (macOS on Intel: built as before this choice existed). `flags`: cpu_flags() when None."""
    if not is_x86():
        return ()
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return VARIANTS
    return tuple(v for v in VARIANTS if set(VARIANT_FLAGS[v]) <= flags)


def wanted_variants(asked: str, flags: Optional[frozenset] = None) -> tuple:
    """What a build must hold: the best plain variant this CPU runs (avx512, else avx2, else none: the
    generic one), and `asked` ($MLX_INFER_KERNEL_ISA's value, any case) when it names a variant the CPU
    runs, with its base. () off x86; all variants where the CPU's flags cannot be read."""
    if not is_x86():
        return ()
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return VARIANTS
    runnable = runnable_variants(flags)
    want = [v for v in ("avx512", "avx2") if v in runnable][:1]
    asked = asked.strip().lower()
    if asked in runnable:
        want.append(asked)
    return with_bases(want)


def build_percent(line: str) -> Optional[int]:
    """The build's progress in a line of its output (make's "[ 45%]", ninja's "[9/17]"), 0-100, or None."""
    if (m := _PERCENT.match(line)) is not None:
        return int(m.group(1))
    if (m := _FRACTION.match(line)) is not None and int(m.group(2)) > 0:
        return 100 * int(m.group(1)) // int(m.group(2))
    return None


class Progress:
    """The build's progress on stderr: one line rewritten in place on a terminal, else a line at each
    quarter; nothing when quiet. Call it with each line of the build's output; `done()` at the end."""

    def __init__(self, quiet: bool, stream=None):
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.shown = 0
        self.start = time.monotonic()

    def __call__(self, line: str) -> None:
        percent = build_percent(line)
        if self.quiet or percent is None or percent <= self.shown:
            return
        if self.tty:
            print(f"\rmlx-infer: building the CPU kernels: {percent:3d}%", end="", file=self.stream, flush=True)
        elif percent // 25 > self.shown // 25 and percent < 100:
            print(f"mlx-infer: building the CPU kernels: {percent}%", file=self.stream, flush=True)
        self.shown = percent

    def done(self) -> float:
        """Say the build finished (with its wall time) and return that time in seconds."""
        seconds = time.monotonic() - self.start
        if not self.quiet:
            line = f"mlx-infer: built the CPU kernels in {seconds:.0f} s"
            if self.tty and self.shown:  # over the progress line, padded to its width
                line = f"\r{line:<42}"
            print(line, file=self.stream, flush=True)
        return seconds


def builder_alive(tree: Path) -> bool:
    """Whether the build in `tree` still runs: its builder (build_guard.py) holds the tree's lock until
    every process of the build is gone. False where locks do not exist (Windows)."""
    if fcntl is None:
        return False
    try:
        with open(tree / TREE_LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def remove_stale_trees(folder: Path) -> None:
    """Remove the build trees in `folder` that no build uses any more (a killed build's, or the `build`
    tree of older versions); a tree whose builder is still alive is left alone."""
    for tree in folder.glob("build*"):
        if tree.is_dir() and not builder_alive(tree):
            shutil.rmtree(tree, ignore_errors=True)


def run_guarded(cmd: list, tree: Path, timeout_s: float, log, on_line: Callable[[str], None]) -> None:
    """Run one build command through build_guard.py: its output to `log` (a text file) and, line by line,
    to `on_line`; the command and its children in a process group of their own that the guard stops when
    this process gives up (an exception here, KeyboardInterrupt included) or dies, or after `timeout_s`.

    Raises:
        subprocess.CalledProcessError: the command failed or ran past timeout_s (returncode 124).
        OSError: Python or the guard could not be started.
    """
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    guard = subprocess.Popen([sys.executable, "-I", str(GUARD), str(tree / TREE_LOCK), str(timeout_s), "--", *cmd],
                             cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, errors="replace", start_new_session=True)
    try:
        for line in guard.stdout:
            log.write(line)
            log.flush()  # (the log can be followed while it builds)
            on_line(line)
        rc = guard.wait()
    except BaseException:
        guard.stdin.close()  # the guard stops the build's process group, then exits
        try:
            guard.wait(GUARD_EXIT_S)
        except subprocess.TimeoutExpired:
            guard.kill()
        raise
    finally:
        log.flush()
    guard.stdin.close()
    guard.stdout.close()
    if rc != 0:
        raise subprocess.CalledProcessError(rc, cmd)


def cmake_generator() -> list:
    """CMake's generator arguments: Ninja where make is missing, else CMake's default (Unix Makefiles)."""
    return ["-G", "Ninja"] if shutil.which("make") is None else []


def new_tree(folder: Path) -> Path:
    """A new, empty build tree in `folder` (one per build: a tree is never shared, nor reused)."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=TREE_PREFIX, dir=folder))
