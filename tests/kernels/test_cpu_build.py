"""The CPU kernels' build (issue 52, defects 4 and 6): a process killed while it builds leaves no cmake, make
or compiler running, a later build never touches the tree of a build still alive and succeeds; a first
build compiles only the variant this CPU runs best (and the one MLX_INFER_KERNEL_ISA asks for); the
build's progress comes from cmake's "[ 45%]" lines.

The kill tests run the build in a subprocess with a stand-in `cmake` (written here: it starts two
long-running children, as make and a compiler would, and waits), chosen by the subprocess itself through
`cpu.find_cmake`, so that they need no real 1-2 minute build."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_infer.kernels import cpu, cpu_build

#: Seconds to wait for something that takes well under a second on an idle machine (only a hang fails).
WAIT_S = 300

FAKE_CMAKE = """#!/bin/sh
# cmake's stand-in: configuring does nothing; building writes the module into the tree and exits when
# FAKE_CMAKE_OK names it, else starts two long-running children, notes their pids and its own, and waits.
case " $* " in
  *" --build "*)
    if [ -n "$FAKE_CMAKE_OK" ]; then : > "$2/$FAKE_CMAKE_OK"; echo "[100%] Built target _cpu_kernels"; exit 0; fi
    sleep 3600 &
    echo $! >> "$FAKE_CMAKE_PIDS"
    sh -c 'sleep 3600; echo never' &
    echo $! >> "$FAKE_CMAKE_PIDS"
    echo $$ >> "$FAKE_CMAKE_PIDS"
    echo "[ 10%] Building CXX object qmm.cpp.o"
    wait ;;
esac
exit 0
"""

#: The build, in a process of its own, with the stand-in cmake given as argv[1].
DRIVER = "import sys\nfrom mlx_infer.kernels import cpu\ncpu.find_cmake = lambda: sys.argv[1]\n" \
         "print(cpu.build_cpu_kernels(quiet=True))\n"


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {WAIT_S} s for {what}")
        time.sleep(0.05)


@pytest.fixture
def fake_build(tmp_path):
    """(env, cmake): the environment of a build into a fresh cache (not the session's shared kernels)
    and the stand-in cmake."""
    cmake = tmp_path / "cmake"
    cmake.write_text(FAKE_CMAKE)
    cmake.chmod(0o755)
    env = dict(os.environ, MLX_INFER_CACHE=str(tmp_path / "cache"), FAKE_CMAKE_PIDS=str(tmp_path / "pids"))
    env.pop(cpu.KERNEL_DIR_ENV, None)
    return env, str(cmake)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
@pytest.mark.skipif(cpu.missing_tools() is not None, reason="needs the build tools")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_killed_build_leaves_nothing_running(fake_build, tmp_path, sig):
    env, cmake = fake_build
    pids = tmp_path / "pids"
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, cmake], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: pids.is_file() and len(pids.read_text().split()) == 3 or driver.poll() is not None,
                   "the build to start")
        assert driver.poll() is None, driver.communicate()
        build = [int(p) for p in pids.read_text().split()]
        assert all(running(p) for p in build)
        (tree,) = (tmp_path / "cache" / "kernels").glob("*/build-*")
        cpu_build.remove_stale_trees(tree.parent)  # another process's build: its builder is alive
        assert tree.is_dir()
        driver.send_signal(sig)
        driver.communicate(timeout=WAIT_S)
        wait_until(lambda: not any(running(p) for p in build), "the build's processes to stop")
    finally:
        driver.kill()
        for pid in [int(p) for p in pids.read_text().split()] if pids.is_file() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    wait_until(lambda: not cpu_build.builder_alive(tree), "the guard to exit")  # (right after its group)
    cpu_build.remove_stale_trees(tree.parent)  # its builder is gone now
    assert not tree.exists()
    env["FAKE_CMAKE_OK"] = cpu._module_file()
    done = subprocess.run([sys.executable, "-c", DRIVER, cmake], env=env, capture_output=True, text=True,
                          timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    module = Path(done.stdout.strip().splitlines()[-1])
    assert module.is_file() and module.parent == tree.parent
    assert list(module.parent.glob("build-*")) == []


ZEN3 = frozenset("fpu sse2 avx avx2 fma f16c bmi2".split())
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}


@pytest.mark.skipif(not cpu_build.is_x86(), reason="the variants are x86's")
def test_a_build_holds_the_variant_this_cpu_runs_and_the_one_asked_for():
    assert cpu_build.wanted_variants("", ZEN3) == ("avx2",)
    assert cpu_build.wanted_variants("AVX2INT8", ZEN3) == ("avx2", "avx2int8")
    assert cpu_build.wanted_variants("avx512", ZEN3) == ("avx2",)  # a variant this CPU lacks: not built
    assert cpu_build.wanted_variants("bogus", ZEN3) == ("avx2",)
    assert cpu_build.wanted_variants("", ZEN4) == ("avx512",)
    assert cpu_build.wanted_variants("avx512vnni", ZEN4) == ("avx512", "avx512vnni")
    assert cpu_build.wanted_variants("avx2", ZEN4) == ("avx512", "avx2")
    assert cpu_build.wanted_variants("", frozenset({"sse2"})) == ()  # the generic C++ only
    assert cpu_build.runnable_variants(ZEN3) == ("avx2", "avx2int8")
    assert cpu_build.runnable_variants(ZEN4) == cpu_build.VARIANTS
    assert cpu_build.with_bases(["avx512vnni"]) == ("avx512", "avx512vnni")
    with pytest.raises(ValueError, match="unknown kernel variants"):
        cpu_build.with_bases(["sse"])


def test_a_build_with_fewer_variants_does_not_count_for_more(tmp_path):
    (tmp_path / cpu._module_file()).write_bytes(b"")
    (tmp_path / "build.json").write_text('{"fingerprint": "f", "variants": ["avx2"]}')
    assert cpu._has_build(tmp_path, "f", ("avx2",))
    assert not cpu._has_build(tmp_path, "f", ("avx2", "avx2int8"))
    assert not cpu._has_build(tmp_path, "g", ("avx2",))
    (tmp_path / "build.json").write_text('{"fingerprint": "f"}')  # recorded before builds chose: all
    assert cpu._has_build(tmp_path, "f", cpu_build.VARIANTS)


def test_progress_from_cmake_lines():
    assert cpu_build.build_percent("[ 45%] Building CXX object CMakeFiles/x.dir/qmm.cpp.o") == 45
    assert cpu_build.build_percent("[100%] Built target _cpu_kernels") == 100
    assert cpu_build.build_percent("[9/18] Building CXX object qmm.cpp.o") == 50
    assert cpu_build.build_percent("-- Configuring done (2.2s)") is None


class Sink:
    def __init__(self, tty: bool):
        self.text, self.tty = "", tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return self.tty


def test_progress_lines():
    """A line per quarter into a log or pipe, one line rewritten in place on a terminal, none when quiet."""
    lines = [f"[{p:3d}%] Building CXX object f{p}.o\n" for p in (5, 10, 30, 40, 55, 80, 95, 100)]
    for tty in (False, True):
        sink = Sink(tty)
        progress = cpu_build.Progress(False, sink)
        for line in lines:
            progress(line)
        progress.done()
        if not tty:
            shown = sink.text.splitlines()
            assert [s.rsplit(": ", 1)[1] for s in shown[:-1]] == ["30%", "55%", "80%"]
            assert shown[-1].startswith("mlx-infer: built the CPU kernels in ")
        else:  # each new percentage over the last, then the time
            assert sink.text.count("\n") == 1 and sink.text.count("\r") == len(lines) + 1
            assert sink.text.rstrip().endswith(" s") and "\rmlx-infer: building the CPU kernels:  95%" in sink.text
    quiet = Sink(False)
    progress = cpu_build.Progress(True, quiet)
    for line in lines:
        progress(line)
    progress.done()
    assert quiet.text == ""


@pytest.mark.slow
@pytest.mark.skipif(not cpu_build.is_x86() or cpu_build.cpu_flags() is None, reason="x86 Linux")
def test_a_first_build_compiles_only_this_cpus_variant(tmp_path):
    """A real build into a fresh cache (1-2 minutes on 2 cores): the best variant only, and it runs."""
    env = dict(os.environ, MLX_INFER_CACHE=str(tmp_path / "cache"))
    env.pop(cpu.KERNEL_DIR_ENV, None)
    env.pop(cpu.ISA_ENV, None)
    code = ("import json; from mlx_infer.kernels import cpu; assert cpu.available(), cpu.why_not(); "
            "print(json.dumps([cpu.isa(), json.loads((cpu.build_dir() / 'build.json').read_text())['variants']]))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr
    isa, variants = json.loads(done.stdout.strip().splitlines()[-1])
    best = cpu_build.wanted_variants("")
    assert variants == list(best) and isa == (best[0] if best else "generic")
    assert "mlx-infer: built the CPU kernels in" in done.stderr
