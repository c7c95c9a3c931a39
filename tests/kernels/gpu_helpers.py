"""Helpers of the GPU kernel tests (no GPU needed): the golden Metal source MLX generates, compiled against
metal_kernels/host/metal_shim.h and run under the Metal execution-model emulator (metal_emu.h); the CUDA
source in the form `mx.fast.cuda_kernel` builds it, compiled with nvcc (nvcc_or_skip: a failure instead of a
skip where $MLX_INFER_REQUIRE_NVCC is 1) and, unchanged, with g++ against cuda_kernels/host/cuda_emu.h, run
under the same execution-model emulator (build_cuda_emulator); numpy oracles of MLX's affine quantization.

Golden source: on an MLX without Metal, calling an `mx.fast.metal_kernel` object with verbose=True inside
`mx.export_function` tracing prints the Metal source MLX would compile (signature, template and
host_name instantiation included) to the C++ stdout; it is captured at the file-descriptor level.
"""

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
METAL_HOST = REPO / "metal_kernels" / "host"
CUDA_HOST = REPO / "cuda_kernels" / "host"

#: Thread attributes Metal passes as kernel arguments (the names MLX recognizes in a body).
METAL_THREAD_ATTRIBUTES = frozenset({
    "dispatch_quadgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup", "grid_origin", "grid_size", "quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup", "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup",
    "thread_execution_width", "thread_index_in_quadgroup", "thread_index_in_simdgroup",
    "thread_index_in_threadgroup", "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threadgroups_per_grid", "threads_per_grid", "threads_per_simdgroup",
    "threads_per_threadgroup"})

#: g++ flags of the shim compiles: unknown ([[kernel]], [[buffer(i)]], ...) attributes are Metal's.
SHIM_FLAGS = ("-std=c++17", "-Wall", "-Werror", "-Wno-attributes", "-Wno-unknown-pragmas", "-Wno-unused-variable",
              "-Wno-unused-but-set-variable")
EMU_FLAGS = ("-std=c++17", "-O1", "-pthread", "-Wno-attributes", "-Wno-unknown-pragmas")

#: Where emulator builds are kept between runs, keyed by a hash of everything that goes into them.
EMU_CACHE = Path(os.environ.get("MLX_INFER_EMU_CACHE", Path(tempfile.gettempdir()) / "mlx-infer-metal-emu"))

_BANNER = re.compile(r"Generated source code for `([^`]+)`:\n```\n(.*?)\n```\n", re.S)
_PARAM = re.compile(r"^\s*(?P<type>.+?)\s*(?P<name>\w+)\s*\[\[(?P<attr>[^\]]+)\]\],?\s*$")


@dataclass(frozen=True)
class MetalParam:
    """One parameter of a generated kernel: its type text, name and attribute ('buffer(2)' or a thread
    attribute name)."""

    type: str
    name: str
    attr: str

    @property
    def is_buffer(self) -> bool:
        return self.attr.startswith("buffer(")


@dataclass(frozen=True)
class GoldenKernel:
    """A kernel as MLX generated it: the full Metal source, its host name, the template declaration and the
    template arguments of its instantiation ("<float, 3>"; both "" for a kernel without template), and its
    parameters in signature order."""

    name: str
    source: str
    template_decl: str
    template_args: str
    params: Tuple[MetalParam, ...]


def capture_fd_stdout(fn: Callable[[], None]) -> str:
    """Run fn with file descriptor 1 redirected to a temporary file; return what was written there
    (C++ std::cout included)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode()


def parse_golden(source: str) -> GoldenKernel:
    """Split a generated Metal source into host name, template declaration, parameters and instantiation."""
    head = re.search(r"(template <[^\n]*>\n)?\[\[kernel\]\] void (\w+)\(\n(.*?)\) \{\n", source, re.S)
    if head is None:
        raise AssertionError(f"no kernel signature in the generated source:\n{source[:2000]}")
    name = head.group(2)
    params = []
    for line in head.group(3).split("\n"):
        m = _PARAM.match(line)
        if m is None:
            raise AssertionError(f"unparsed parameter line {line!r} of {name}")
        params.append(MetalParam(m.group("type"), m.group("name"), m.group("attr")))
    template_decl, template_args = (head.group(1) or "").strip(), ""
    if template_decl:
        inst = re.search(r"decltype\(" + re.escape(name) + r"<(.*?)>\) " + re.escape(name) + "<", source)
        if inst is None:
            raise AssertionError(f"no host_name instantiation of the template kernel {name}")
        template_args = f"<{inst.group(1)}>"
    return GoldenKernel(name=name, source=source, template_decl=template_decl, template_args=template_args,
                        params=tuple(params))


def golden_metal_sources(calls: Sequence[Callable[[], mx.array]]) -> List[GoldenKernel]:
    """The Metal sources MLX generates for kernel calls (each a callable that calls an mx.fast.metal_kernel
    object with verbose=True and returns its output), traced in one mx.export_function; one GoldenKernel
    per distinct kernel name, in call order."""
    def traced(_):
        return [call() for call in calls]

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "golden.mlxfn")
        text = capture_fd_stdout(lambda: mx.export_function(path, traced, mx.zeros((1,))))
    kernels: Dict[str, GoldenKernel] = {}
    for _, source in _BANNER.findall(text):
        kernel = parse_golden(source)
        kernels.setdefault(kernel.name, kernel)
    return list(kernels.values())


def compile_shim_syntax(kernels: Sequence[GoldenKernel], workdir: Path) -> subprocess.CompletedProcess:
    """g++ -fsyntax-only of the golden sources (every instantiation) against metal_shim.h."""
    tu = workdir / "golden_syntax.cpp"
    tu.write_text('#include "metal_shim.h"\n#include "metal_poison.h"\n' +
                  "\n".join(k.source for k in kernels))
    return subprocess.run(["g++", *SHIM_FLAGS, "-fsyntax-only", "-I", str(METAL_HOST), str(tu)],
                          capture_output=True, text=True)


def _declaration(k: GoldenKernel) -> str:
    params = ",\n  ".join(f"{p.type} {p.name}" for p in k.params)
    return f"{k.template_decl}\nvoid {k.name}(\n  {params});\n".lstrip()


def _launcher(k: GoldenKernel, index: int) -> str:
    args = []
    b = 0
    for p in k.params:
        if p.is_buffer:
            args.append(f"({p.type})bufs[{b}]")
            b += 1
        elif p.attr in METAL_THREAD_ATTRIBUTES and p.attr == p.name:
            args.append(f"t.{p.name}")
        else:
            raise AssertionError(f"{k.name}: parameter {p.name} [[{p.attr}]] is not emulated")
    call = f"{k.name}{k.template_args}(" + ", ".join(args) + ");"
    return (f"static std::string run_{index}(void** bufs, uint3 grid, uint3 tg, int workers) {{\n"
            f"  return emu::launch(grid, tg, [=](const emu::ThreadAttrs& t) {{ {call} }}, workers);\n}}\n")


_EMU_MAIN = r"""
#include <cstdio>
#include <fstream>
#include <sys/mman.h>

// A buffer whose last byte sits right before a PROT_NONE page: reads or writes past its end fault.
static void* guarded(size_t nbytes) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t pages = (nbytes + page - 1) / page + 1;
  char* base = static_cast<char*>(mmap(nullptr, (pages + 1) * page, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  mprotect(base + pages * page, page, PROT_NONE);
  return base + pages * page - nbytes;
}

// usage: emu NAME GX GY GZ TX TY TZ WORKERS (i|o):PATH:NBYTES ... [l:BUFFER:OFFSET:NBYTES ...]
// (an `l` spec makes bytes [OFFSET, OFFSET + NBYTES) of buffer BUFFER, page-aligned, unreadable: a read faults)
int main(int argc, char** argv) {
  if (argc < 9) { std::fprintf(stderr, "usage: emu NAME GX GY GZ TX TY TZ WORKERS BUFFERS...\n"); return 2; }
  const std::string name = argv[1];
  const uint3 grid = {uint(std::stoul(argv[2])), uint(std::stoul(argv[3])), uint(std::stoul(argv[4]))};
  const uint3 tg = {uint(std::stoul(argv[5])), uint(std::stoul(argv[6])), uint(std::stoul(argv[7]))};
  const int workers = std::stoi(argv[8]);
  std::vector<void*> bufs;
  std::vector<std::pair<std::string, size_t>> outs;
  std::vector<void*> out_ptrs;
  std::vector<std::string> locks;
  for (int i = 9; i < argc; ++i) {
    const std::string spec = argv[i];
    if (spec[0] == 'l') { locks.push_back(spec); continue; }
    const size_t a = spec.find(':'), b = spec.rfind(':');
    const std::string path = spec.substr(a + 1, b - a - 1);
    const size_t nbytes = std::stoul(spec.substr(b + 1));
    void* p = guarded(nbytes);
    if (spec[0] == 'i') {
      std::ifstream f(path, std::ios::binary);
      f.read(static_cast<char*>(p), std::streamsize(nbytes));
      if (size_t(f.gcount()) != nbytes) { std::fprintf(stderr, "short read of %s\n", path.c_str()); return 2; }
    } else {
      std::memset(p, 0xff, nbytes);  // NaN for float outputs: an element never written shows up
      outs.emplace_back(path, nbytes);
      out_ptrs.push_back(p);
    }
    bufs.push_back(p);
  }
  for (const std::string& spec : locks) {
    const size_t a = spec.find(':'), b = spec.find(':', a + 1), c = spec.rfind(':');
    const size_t buffer = std::stoul(spec.substr(a + 1, b - a - 1));
    const size_t offset = std::stoul(spec.substr(b + 1, c - b - 1)), nbytes = std::stoul(spec.substr(c + 1));
    if (buffer >= bufs.size() || mprotect(static_cast<char*>(bufs[buffer]) + offset, nbytes, PROT_NONE) != 0) {
      std::fprintf(stderr, "cannot lock %s\n", spec.c_str());
      return 2;
    }
  }
  for (int i = 0; i < kInstances; ++i) {
    if (name == kNames[i]) {
      const std::string err = kRuns[i](bufs.data(), grid, tg, workers);
      if (!err.empty()) { std::fprintf(stderr, "emulation error: %s\n", err.c_str()); return 3; }
      for (size_t o = 0; o < outs.size(); ++o) {
        std::ofstream f(outs[o].first, std::ios::binary);
        f.write(static_cast<const char*>(out_ptrs[o]), std::streamsize(outs[o].second));
      }
      return 0;
    }
  }
  std::fprintf(stderr, "no kernel %s in this emulator\n", name.c_str());
  return 2;
}
"""


def build_emulator(kernels: Sequence[GoldenKernel], jobs: int = 2) -> Path:
    """An executable that runs the golden kernels under metal_emu.h (cached by content hash).

    The golden sources are split over `jobs` translation units (each: metal_emu.h, metal_poison.h, the
    sources) compiled in parallel; the launchers, in their own unit, see only the kernels' declarations.
    """
    kernels = list(kernels)
    chunks = [kernels[i::jobs] for i in range(jobs) if kernels[i::jobs]]
    units = {f"kernels_{i}.cpp": '#include "metal_emu.h"\n#include "metal_poison.h"\n' +
             "\n".join(k.source for k in chunk) for i, chunk in enumerate(chunks)}
    launch = ['#include "metal_emu.h"\n'] + [_declaration(k) for k in kernels]
    launch += [_launcher(k, i) for i, k in enumerate(kernels)]
    units["launch.cpp"] = "".join(launch) + _launch_table(kernels) + _EMU_MAIN
    return _build_cached(units, (METAL_HOST,))


def _launch_table(kernels: Sequence) -> str:
    """The emulator main's table of kernels: kInstances, kNames and kRuns (run_<i> for kernel i)."""
    return (f"static const int kInstances = {len(kernels)};\n"
            "static const char* kNames[] = {" + ", ".join(f'"{k.name}"' for k in kernels) + "};\n"
            "static std::string (*kRuns[])(void**, uint3, uint3, int) = {" +
            ", ".join(f"run_{i}" for i in range(len(kernels))) + "};\n")


def _build_cached(units: Dict[str, str], include_dirs: Sequence[Path]) -> Path:
    """Compile the translation units (name -> text) in parallel with EMU_FLAGS and the include directories, and
    link them into an executable, kept in EMU_CACHE under a hash of the units, the flags and every header of
    metal_kernels/host and cuda_kernels/host; returns its path. Raises AssertionError with the compiler's log."""
    digest = hashlib.sha256()
    for header in sorted([*METAL_HOST.rglob("*.h"), *CUDA_HOST.rglob("*.h"), *CUDA_HOST.rglob("*.cuh")]):
        digest.update(str(header.relative_to(REPO)).encode() + header.read_bytes())
    for name in sorted(units):
        digest.update(name.encode() + units[name].encode())
    digest.update(" ".join([*EMU_FLAGS, *map(str, include_dirs)]).encode())
    out = EMU_CACHE / digest.hexdigest()[:20]
    exe = out / "emu"
    if exe.exists():
        return exe
    includes = [arg for d in include_dirs for arg in ("-I", str(d))]
    build = Path(tempfile.mkdtemp(prefix="build-", dir=_ensure(EMU_CACHE)))
    procs = []
    for name, text in units.items():
        (build / name).write_text(text)
        procs.append(subprocess.Popen(["g++", *EMU_FLAGS, *includes, "-c", name, "-o", name + ".o"],
                                      cwd=build, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    failed = [log for p, log in zip(procs, logs) if p.returncode != 0]
    if failed:
        raise AssertionError("emulator build failed:\n" + "\n".join(log[-6000:] for log in failed))
    objects = [name + ".o" for name in units]
    subprocess.run(["g++", "-pthread", *objects, "-o", "emu"], cwd=build, check=True)
    if out.exists():
        shutil.rmtree(build, ignore_errors=True)
    else:
        os.replace(build, out)
    return exe


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


#: The emulator's page size: the granularity of run_emulated's `locked` byte ranges.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def run_emulated(exe: Path, kernel: Union[GoldenKernel, "CudaKernel"], inputs: Dict[str, np.ndarray],
                 outputs: Dict[str, Tuple[Tuple[int, ...], np.dtype]], grid: Sequence[int],
                 threadgroup: Sequence[int], workers: int = 2,
                 locked: Optional[Dict[str, Sequence[Tuple[int, int]]]] = None) -> Dict[str, np.ndarray]:
    """Run one emulated kernel (of build_emulator or build_cuda_emulator): inputs by name (raw bytes, in the
    buffer order of the signature), outputs by name (shape, numpy dtype; bfloat16 as uint16). `locked` names,
    per input, byte ranges (offset, nbytes) the kernel must never touch: they are made unreadable (PROT_NONE), so
    any access faults (reported like an access past the end of a buffer); the input's size and the ranges must
    be multiples of PAGE_SIZE. Raises AssertionError with the emulator's message."""
    locked = locked or {}
    with tempfile.TemporaryDirectory() as tmp:
        specs = []
        locks = []
        buffer = 0
        for p in kernel.params:
            if not p.is_buffer:
                continue
            if p.name in inputs:
                data = np.ascontiguousarray(inputs[p.name])
                path = os.path.join(tmp, p.name + ".in")
                data.tofile(path)
                specs.append(f"i:{path}:{data.nbytes}")
                for offset, nbytes in locked.get(p.name, ()):
                    if data.nbytes % PAGE_SIZE or offset % PAGE_SIZE or nbytes % PAGE_SIZE or \
                            not 0 <= offset < offset + nbytes <= data.nbytes:
                        raise AssertionError(f"locked range ({offset}, {nbytes}) of {p.name} ({data.nbytes} bytes) "
                                             f"is not made of whole pages of {PAGE_SIZE} bytes inside it")
                    locks.append(f"l:{buffer}:{offset}:{nbytes}")
            elif p.name in outputs:
                shape, dtype = outputs[p.name]
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                specs.append(f"o:{os.path.join(tmp, p.name + '.out')}:{nbytes}")
            else:
                raise AssertionError(f"no data for buffer {p.name} of {kernel.name}")
            buffer += 1
        unknown = set(locked) - set(inputs)
        if unknown:
            raise AssertionError(f"locked ranges for {sorted(unknown)}, which are not inputs of {kernel.name}")
        cmd = [str(exe), kernel.name, *map(str, grid), *map(str, threadgroup), str(workers), *specs, *locks]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode < 0:
            raise AssertionError(f"emulated {kernel.name} killed by signal {-proc.returncode} (an access past the "
                                 f"end of a buffer faults on its guard page, an access to a locked range too) "
                                 f"{proc.stderr.strip()}")
        if proc.returncode != 0:
            raise AssertionError(f"emulated {kernel.name} failed (rc {proc.returncode}): {proc.stderr.strip()}")
        return {name: np.fromfile(os.path.join(tmp, name + ".out"), dtype=dtype).reshape(shape)
                for name, (shape, dtype) in outputs.items()}


# --- data and oracles -------------------------------------------------------------------------------

def to_numpy(a: mx.array) -> np.ndarray:
    """An mx.array as numpy: bfloat16 as its uint16 bit patterns, everything else as itself."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def as_float64(a: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """Values of a numpy array holding `dtype` data (bfloat16 as uint16 bits) as float64."""
    if dtype == mx.bfloat16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@dataclass(frozen=True)
class QmmCase:
    """Operands of one qmm check: x [M, K], w [N, K*bits/32] uint32, scales / biases [N, K/gs] in x's dtype."""

    x: mx.array
    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int


def random_case(rows: int, k: int, n: int, group_size: int, bits: int, dtype: mx.Dtype, seed: int) -> QmmCase:
    """Random operands: packed words uniform over all bit patterns (every quantized value occurs), scales
    and biases of either sign, x standard normal; all exactly representable in dtype."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.integers(0, 2 ** 32, size=(n, k * bits // 32), dtype=np.uint64).astype(np.uint32))
    groups = k // group_size
    scales = mx.array(rng.uniform(-0.05, 0.05, size=(n, groups)).astype(np.float32)).astype(dtype)
    biases = mx.array(rng.uniform(-0.5, 0.5, size=(n, groups)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    return QmmCase(x, w, scales, biases, group_size, bits)


def oracle(case: QmmCase) -> Tuple[np.ndarray, np.ndarray]:
    """(y, bound): y [M, N] float64 from MLX's own dequantization (in float32, from the same operands) times
    x in float64; bound [M, N] = |W| @ |x|, the scale of float32 accumulation error."""
    weights = mx.dequantize(case.w, case.scales.astype(mx.float32), case.biases.astype(mx.float32),
                            group_size=case.group_size, bits=case.bits)
    wd = np.array(weights).astype(np.float64)   # [N, K]
    xd = np.array(case.x.astype(mx.float32)).astype(np.float64)  # [M, K]
    return xd @ wd.T, np.abs(xd) @ np.abs(wd).T


#: Relative rounding unit of each output dtype.
OUTPUT_EPS = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}
#: Float32 accumulation error allowed, relative to |W| @ |x| (K <= a few thousand terms).
ACCUMULATION_RTOL = 1e-5


#: Absolute slack for outputs near zero: half the smallest subnormal step of float16 (2^-24).
OUTPUT_ATOL = 2.0 ** -25


def _allowed(ref: np.ndarray, bound: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    eps = OUTPUT_EPS[dtype]
    return (1 + eps) * ACCUMULATION_RTOL * bound + eps * np.abs(ref) + OUTPUT_ATOL


def assert_close_to_oracle(y: np.ndarray, case: QmmCase, label: str) -> None:
    """y (numpy, in x's dtype; bfloat16 as uint16) within float32 accumulation error plus one rounding of
    the output dtype of the float64 oracle, elementwise."""
    ref, bound = oracle(case)
    got = as_float64(y, case.x.dtype)
    allowed = _allowed(ref, bound, case.x.dtype)
    err = np.abs(got - ref)
    bad = ~(err <= allowed)  # NaN counts as bad
    assert not bad.any(), (f"{label}: {int(bad.sum())} of {bad.size} outputs off; worst error "
                           f"{float(np.nanmax(err / allowed)):.3g}x the allowed bound; first at "
                           f"{np.argwhere(bad)[0].tolist()}: got {got[bad][0]!r}, want {ref[bad][0]!r}")


def max_error_ratio(y: np.ndarray, case: QmmCase) -> float:
    """The largest |y - oracle| / allowed bound (inf where y is NaN): > 1 means assert_close_to_oracle fails."""
    ref, bound = oracle(case)
    got = as_float64(y, case.x.dtype)
    allowed = _allowed(ref, bound, case.x.dtype)
    ratio = np.abs(got - ref) / allowed
    return float("inf") if np.isnan(ratio).any() else float(ratio.max())


def gxx() -> Optional[str]:
    """Path of g++, or None."""
    return shutil.which("g++")


#: Why the emulator cannot run here, or None: it needs g++ and glibc's ucontext fibers (Linux).
EMULATOR_MISSING = ("needs g++" if gxx() is None else
                    "the emulator's fibers are Linux ucontext" if not sys.platform.startswith("linux") else None)


#: Set to 1 where nvcc must be found (.ci/run sets it on a machine with an NVIDIA GPU or a CUDA toolkit; a CI job
#: may set it itself): the tests that compile with nvcc then fail instead of skipping when it is missing.
REQUIRE_NVCC_ENV = "MLX_INFER_REQUIRE_NVCC"
#: Where a CUDA toolkit puts nvcc when it is not on PATH ($CUDA_HOME/bin comes first).
NVCC_STANDARD_PATHS = ("/usr/local/cuda/bin/nvcc",)


def nvcc() -> Optional[str]:
    """Path of nvcc: on PATH, else in $CUDA_HOME/bin or NVCC_STANDARD_PATHS; None where there is none."""
    found = shutil.which("nvcc")
    if found is not None:
        return found
    home = os.environ.get("CUDA_HOME")
    candidates = ([os.path.join(home, "bin", "nvcc")] if home else []) + list(NVCC_STANDARD_PATHS)
    return next((path for path in candidates if os.access(path, os.X_OK)), None)


def nvcc_or_skip() -> str:
    """Path of nvcc. Where there is none: fails the calling test when $MLX_INFER_REQUIRE_NVCC is 1 (this machine
    is supposed to compile the CUDA kernels), skips it otherwise."""
    path = nvcc()
    if path is None:
        if os.environ.get(REQUIRE_NVCC_ENV) == "1":
            pytest.fail(f"nvcc not found (PATH, $CUDA_HOME/bin, {', '.join(NVCC_STANDARD_PATHS)}) but "
                        f"{REQUIRE_NVCC_ENV}=1 says this machine compiles the CUDA kernels: install the CUDA toolkit "
                        f"or put nvcc on PATH", pytrace=False)
        pytest.skip(f"nvcc is not installed ({REQUIRE_NVCC_ENV}=1 makes this a failure)")
    return path


# --- the CUDA source, as mx.fast.cuda_kernel builds it --------------------------------------------------

#: dtype -> the CUDA type MLX's dtype_to_cuda_type names.
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.uint32: "uint32_t",
              mx.int32: "int32_t", mx.uint16: "uint16_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
#: dtype -> MLX's get_type_string, used in kernel names.
MLX_TYPE_NAMES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.uint32: "uint32_t",
                  mx.int32: "int32_t", mx.uint16: "uint16_t", mx.uint8: "uint8_t", mx.bool_: "bool"}
#: MLX's CUDA default header, put before a custom kernel's own header.
CUDA_DEFAULT_HEADER = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
                       "#define inf cuda::std::numeric_limits<float>::infinity()\n\n")


def cuda_kernel_name(name: str, template: Sequence[Tuple[str, object]]) -> str:
    """custom_kernel_<name> plus MLX's hash of the template arguments (_<int>, _t / _f, _<dtype>)."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append("_" + MLX_TYPE_NAMES[value])
    return f"custom_kernel_{name}" + "".join(parts)


def mlx_cuda_source(name: str, header: str, body: str, inputs: Sequence[Tuple[str, mx.Dtype]],
                    outputs: Sequence[Tuple[str, mx.Dtype]], template: Sequence[Tuple[str, object]]) -> str:
    """The source `mx.fast.cuda_kernel` (MLX 0.32, backend/cuda/custom_kernel.cpp build_kernel) compiles for a
    kernel: default header, the kernel's header, then in namespace mlx::core::cu a __global__ function with
    `const T* input` / `T* output` parameters, the template constants as constexpr / using declarations, and
    the body. (Shape / stride parameters, which MLX adds when a body names `<input>_shape`, are not needed
    by the bodies here: their use raises.)"""
    for in_name, _ in inputs:
        if any(f"{in_name}_{suffix}" in body for suffix in ("shape", "strides", "ndim")):
            raise NotImplementedError(f"{in_name}_shape / _strides / _ndim parameters are not reproduced")
    params = [f"    const {CUDA_TYPES[dtype]}* {n}" for n, dtype in inputs]
    params += [f"    {CUDA_TYPES[dtype]}* {n}" for n, dtype in outputs]
    constants = []
    for const_name, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {const_name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {const_name} = {value};\n")
        else:
            constants.append(f"  using {const_name} = {CUDA_TYPES[value]};\n")
    return (CUDA_DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {cuda_kernel_name(name, template)}(\n" + ",\n".join(params) + ") {\n" +
            "".join(constants) + ("\n" if constants else "") + body + "\n}\n\n} // namespace mlx::core::cu\n")


def nvcc_compile(source: str, workdir: Path, stem: str, arch: str = "sm_90") -> subprocess.CompletedProcess:
    """nvcc -arch=<arch> -c of a CUDA source against the stand-in MLX device header (cuda_kernels/host);
    -Xptxas -v reports registers and spills on stderr. Skips (or fails: nvcc_or_skip) the calling test where
    there is no nvcc."""
    compiler = nvcc_or_skip()
    path = workdir / f"{stem}.cu"
    path.write_text(source)
    return subprocess.run([compiler, f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-Werror", "all-warnings",
                           "-I", str(CUDA_HOST), "-c", str(path), "-o", str(workdir / f"{stem}.o")],
                          capture_output=True, text=True)


# --- the CUDA source on the CPU: cuda_kernels/host/cuda_emu.h ---------------------------------------------

#: Include directory of the emulated CUDA builds (before CUDA_HOST): stand-ins for MLX's device header and
#: <cooperative_groups.h> that bring in cuda_kernels/host/cuda_emu.h, so the source compiles unchanged.
CUDA_EMU_HOST = CUDA_HOST / "emu"
#: The line of mlx_cuda_source that ends the kernel's header and opens the kernel's namespace.
_CUDA_NAMESPACE = "namespace mlx::core::cu {\n"


@dataclass(frozen=True)
class CudaKernel:
    """A kernel as `mx.fast.cuda_kernel` builds it (mlx_cuda_source): the __global__ function's name (in
    mlx::core::cu), the full source, and its parameters in signature order: every one a buffer (inputs, then
    outputs), with attr 'buffer(i)', so run_emulated takes a CudaKernel as it takes a GoldenKernel."""

    name: str
    source: str
    params: Tuple[MetalParam, ...]

    @property
    def header(self) -> str:
        """Everything before the kernel's namespace: MLX's default header and the kernel's own (the prelude)."""
        return self.source.split(_CUDA_NAMESPACE, 1)[0]


def mlx_cuda_kernel(name: str, header: str, body: str, inputs: Sequence[Tuple[str, mx.Dtype]],
                    outputs: Sequence[Tuple[str, mx.Dtype]], template: Sequence[Tuple[str, object]]) -> CudaKernel:
    """The CudaKernel of mlx_cuda_source's arguments."""
    params = [MetalParam(f"const {CUDA_TYPES[dtype]}*", n, f"buffer({i})") for i, (n, dtype) in enumerate(inputs)]
    params += [MetalParam(f"{CUDA_TYPES[dtype]}*", n, f"buffer({len(inputs) + i})")
               for i, (n, dtype) in enumerate(outputs)]
    return CudaKernel(name=cuda_kernel_name(name, template),
                      source=mlx_cuda_source(name, header, body, inputs, outputs, template), params=tuple(params))


def _cuda_launcher(k: CudaKernel, index: int) -> str:
    args = ", ".join(f"({p.type})bufs[{i}]" for i, p in enumerate(k.params))
    return (f"static std::string run_{index}(void** bufs, uint3 grid, uint3 tg, int workers) {{\n"
            f"  return emu::launch(grid, tg, [=](const emu::ThreadAttrs&) {{ mlx::core::cu::{k.name}({args}); }}, "
            f"workers);\n}}\n")


def build_cuda_emulator(kernels: Sequence[CudaKernel], jobs: int = 2) -> Path:
    """An executable that runs the CUDA kernels, their sources unchanged, under cuda_kernels/host/cuda_emu.h
    (cached by content hash; run them with run_emulated). The sources are split over `jobs` translation units
    compiled in parallel; the launchers, in their own unit, see only the kernels' declarations. All kernels
    must share one header (prelude): the prelude's inline functions are one definition per program, so a
    modified prelude needs an executable of its own (AssertionError otherwise)."""
    kernels = list(kernels)
    headers = {k.header for k in kernels}
    assert len(headers) == 1, "kernels with different headers (preludes) need emulators of their own"
    chunks = [kernels[i::jobs] for i in range(jobs) if kernels[i::jobs]]
    units = {f"kernels_{i}.cpp": "\n".join(k.source for k in chunk) for i, chunk in enumerate(chunks)}
    launch = ['#include "cuda_emu.h"\n\nnamespace mlx::core::cu {\n']
    launch += [f"void {k.name}({', '.join(f'{p.type} {p.name}' for p in k.params)});\n" for k in kernels]
    launch.append("}  // namespace mlx::core::cu\n\n")
    launch += [_cuda_launcher(k, i) for i, k in enumerate(kernels)]
    units["launch.cpp"] = "".join(launch) + _launch_table(kernels) + _EMU_MAIN
    return _build_cached(units, (CUDA_EMU_HOST, CUDA_HOST))


#: One-line logic errors in the CUDA prelude (cuda_kernels/metal_prelude.cuh), name -> (text, replacement): the
#: emulated kernels built with the edited prelude must give wrong results (or an emulation error).
PRELUDE_MUTATIONS = {
    # simd_sum as a butterfly over 16 lanes: each half-warp sums only itself.
    "simd_sum_over_16_lanes": ("for (int offset = 16; offset > 0; offset >>= 1) {\n    v += __shfl_xor_sync",
                               "for (int offset = 8; offset > 0; offset >>= 1) {\n    v += __shfl_xor_sync"),
    "simd_max_over_16_lanes": ("for (int offset = 16; offset > 0; offset >>= 1) {\n    const U o",
                               "for (int offset = 8; offset > 0; offset >>= 1) {\n    const U o"),
    "lane_index_mod_16": ("#define thread_index_in_simdgroup (threadIdx.x & 31u)",
                          "#define thread_index_in_simdgroup (threadIdx.x & 15u)"),
    "simdgroups_of_16_threads": ("#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)",
                                 "#define simdgroup_index_in_threadgroup (threadIdx.x >> 4)"),
    "threadgroup_barrier_does_nothing": ("void threadgroup_barrier(mem_flags) { __syncthreads(); }",
                                         "void threadgroup_barrier(mem_flags) {}"),
    "shuffle_xor_with_half_the_mask": ("return __shfl_xor_sync(0xffffffffu, v, mask);",
                                       "return __shfl_xor_sync(0xffffffffu, v, mask >> 1);"),
    # A half-warp member mask where all 32 lanes call: undefined on a GPU, an error under the emulator.
    "simd_sum_with_a_half_warp_mask": ("v += __shfl_xor_sync(0xffffffffu, v, offset);",
                                       "v += __shfl_xor_sync(0x0000ffffu, v, offset);"),
}


def mutated_prelude(prelude: str, name: str) -> str:
    """The prelude with PRELUDE_MUTATIONS[name] applied (its text must occur exactly once)."""
    old, new = PRELUDE_MUTATIONS[name]
    assert prelude.count(old) == 1, f"{old!r} changed in the prelude: update PRELUDE_MUTATIONS[{name!r}]"
    return prelude.replace(old, new)


# --- attention over a quantized KV cache (test_metal_attention.py, test_cuda_attention.py) ---------------

#: Names of the dtypes of AttnConfig.


def ptxas_entries(ptxas: str) -> List[Tuple[str, int, int, int, int, int]]:
    """Per kernel in nvcc's -Xptxas -v output: (name, stack bytes, spill stores, spill loads, registers,
    shared memory bytes)."""
    out = []
    for block in re.split(r"ptxas info\s+: Compiling entry function '", ptxas)[1:]:
        name = block.split("'", 1)[0]
        stack, stores, loads = map(int, re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block).groups())
        regs = int(re.search(r"Used (\d+) registers", block).group(1))
        smem = re.search(r"(\d+) bytes smem", block)
        out.append((name, stack, stores, loads, regs, int(smem.group(1)) if smem else 0))
    return out


def assert_compiles_without_spills(sources: List[str], tmp_path, smem_limit: int) -> None:
    """Compile the CUDA `sources` in one unit with nvcc and assert one entry per source, none with stack,
    spills, more than 255 registers or more than smem_limit bytes of shared memory."""
    result = nvcc_compile("\n".join(sources), tmp_path, "all")
    assert result.returncode == 0, result.stderr[-6000:]
    entries = ptxas_entries(result.stderr)
    assert len(entries) == len(sources)
    for name, stack, stores, loads, regs, smem in entries:
        assert (stack, stores, loads) == (0, 0, 0), f"{name}: {stack} B stack, {stores}/{loads} B spills"
        assert regs <= 255 and smem <= smem_limit, (name, regs, smem)


ATTN_DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


@dataclass(frozen=True)
class AttnConfig:
    """One attention check: n_kv heads, n_rep query heads per KV head, P positions (R = n_rep * P rows), head
    dims D / Dv, K / V bits, group size, q's dtype and the scales' dtype (names of ATTN_DTYPES), S valid of C cache
    rows, and the split length (None: the default)."""

    n_kv: int
    n_rep: int
    positions: int
    dim: int
    v_dim: int
    k_bits: int
    v_bits: int
    group_size: int
    dtype: str
    scale_dtype: str
    length: int
    capacity: int
    split_length: Optional[int] = None

    @property
    def rows(self) -> int:
        return self.n_rep * self.positions

    @property
    def id(self) -> str:
        split = f"-split{self.split_length}" if self.split_length else ""
        return (f"{self.dtype}-s{self.scale_dtype}-k{self.k_bits}v{self.v_bits}-g{self.group_size}-D{self.dim}"
                f"x{self.v_dim}-rep{self.n_rep}-P{self.positions}-S{self.length}of{self.capacity}{split}")


#: Shapes the real-device attention tests (Metal and CUDA) run: decode and verify rows, GQA groups, head dims
#: 64 / 128 / 256, mixed bits, long caches with room past their length.
ATTN_DEVICE_CONFIGS = (
    AttnConfig(8, 1, 1, 64, 64, 8, 8, 64, "f16", "f16", 1000, 1024),
    AttnConfig(8, 3, 1, 128, 128, 4, 4, 64, "bf16", "bf16", 3001, 4096),
    AttnConfig(4, 4, 4, 256, 256, 8, 4, 32, "f16", "f16", 777, 800),
    AttnConfig(2, 3, 4, 128, 128, 8, 8, 128, "f32", "f16", 5000, 5120),
    AttnConfig(2, 3, 4, 64, 64, 4, 4, 32, "f32", "f32", 99, 128),
)


@dataclass(frozen=True)
class AttnCase:
    """Operands: q [n_kv, R, D], keys / values (w, scales, biases) with C rows; plus the scalar arguments."""

    config: AttnConfig
    q: mx.array
    keys: Tuple[mx.array, mx.array, mx.array]
    values: Tuple[mx.array, mx.array, mx.array]
    scale: float

    def args(self):
        c = self.config
        return (self.q, self.keys, self.values, c.length, self.scale, c.positions, c.group_size)


def _packed(rng, n_kv, capacity, length, dim, bits, group_size, dtype):
    w = mx.array(rng.integers(0, 2 ** 32, size=(n_kv, capacity, dim * bits // 32), dtype=np.uint64)
                 .astype(np.uint32))
    groups = dim // group_size
    step = 1.0 / ((1 << bits) - 1)  # dequantized values within about [-1, 1]
    scales = mx.array((rng.uniform(0.5 * step, 2.0 * step, size=(n_kv, capacity, groups))
                      * rng.choice([-1.0, 1.0], size=(n_kv, capacity, groups))).astype(np.float32)).astype(dtype)
    biases = mx.array(rng.uniform(-1.0, 1.0, size=(n_kv, capacity, groups)).astype(np.float32)).astype(dtype)
    past = mx.arange(capacity)[None, :, None] >= length  # rows past S: NaN scales, so a read of them shows
    return w, mx.where(past, float("nan"), scales).astype(dtype), biases


def make_case(config: AttnConfig, seed: int = 0) -> AttnCase:
    """Random operands: packed words uniform over all bit patterns, dequantized K / V within about [-1, 1],
    q normal with standard deviation 2 (so the softmax is far from uniform), scale D ** -0.5. The cache rows
    past S have random words and NaN scales: a kernel that reads them gives NaN."""
    c = config
    rng = np.random.default_rng(seed + zlib.crc32(c.id.encode()))
    dtype, sdtype = ATTN_DTYPES[c.dtype], ATTN_DTYPES[c.scale_dtype]
    q = mx.array(2.0 * rng.standard_normal((c.n_kv, c.rows, c.dim)).astype(np.float32)).astype(dtype)
    keys = _packed(rng, c.n_kv, c.capacity, c.length, c.dim, c.k_bits, c.group_size, sdtype)
    values = _packed(rng, c.n_kv, c.capacity, c.length, c.v_dim, c.v_bits, c.group_size, sdtype)
    return AttnCase(config=c, q=q, keys=keys, values=values, scale=c.dim ** -0.5)


def dequantize64(packed, dim: int, bits: int, group_size: int, dtype: mx.Dtype) -> np.ndarray:
    """MLX's affine dequantization in float64: value d of a row is scales[d // gs] * q_d + biases[d // gs], q_d
    the bits [bits * (d % vpw), ...) of word d // vpw."""
    w, scales, biases = (to_numpy(a) for a in packed)
    vpw = 32 // bits
    shifts = (bits * np.arange(vpw, dtype=np.uint32))
    quant = ((w[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(*w.shape[:-1], dim)
    s = np.repeat(as_float64(scales, dtype), group_size, axis=-1)
    b = np.repeat(as_float64(biases, dtype), group_size, axis=-1)
    return s * quant.astype(np.float64) + b


def attention_oracle(case: AttnCase) -> Tuple[np.ndarray, np.ndarray]:
    """(out, bound): out [n_kv, R, Dv] float64; bound [n_kv, R, Dv] = sum_s p_s |v_s| * (1 + max_s |score|), the
    scale of the float32 error of the kernel (a relative error e of a score moves p_s by |score| e)."""
    c = case.config
    sdtype = ATTN_DTYPES[c.scale_dtype]
    k = dequantize64([a[:, :c.length] for a in case.keys], c.dim, c.k_bits, c.group_size, sdtype)
    v = dequantize64([a[:, :c.length] for a in case.values], c.v_dim, c.v_bits, c.group_size, sdtype)
    q = as_float64(to_numpy(case.q), ATTN_DTYPES[c.dtype]) * case.scale
    scores = q @ k.transpose(0, 2, 1)  # [n_kv, R, S]
    last = c.length - c.positions + np.arange(c.rows) % c.positions
    visible = np.arange(c.length)[None, :] <= last[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    worst = np.where(visible[None], np.abs(scores), 0.0).max(axis=-1, keepdims=True)
    return p @ v, (p @ np.abs(v)) * (1.0 + worst)


#: Float32 error allowed relative to the oracle's bound (dot products of <= 256 terms, exp, sums of <= 1024).
ATTN_RTOL = 2e-6


def attention_error_ratio(out: np.ndarray, case: AttnCase) -> float:
    """max |out - oracle| / allowed, allowed = ATTN_RTOL * bound + eps * |oracle| + OUTPUT_ATOL (eps: the output
    dtype's unit roundoff); inf where out has a NaN. <= 1 passes."""
    dtype = ATTN_DTYPES[case.config.dtype]
    ref, bound = attention_oracle(case)
    got = as_float64(out, dtype)
    allowed = ATTN_RTOL * bound + OUTPUT_EPS[dtype] * np.abs(ref) + OUTPUT_ATOL
    ratio = np.abs(got - ref) / allowed
    return float("inf") if np.isnan(ratio).any() else float(ratio.max())


def assert_attention_close(out: np.ndarray, case: AttnCase, label: str) -> None:
    ratio = attention_error_ratio(out, case)
    assert ratio <= 1.0, f"{label}: worst error {ratio:.3g}x the allowed bound"


# --- RMM's reduced quantized matmul (test_metal_rmm.py, test_cuda_rmm.py) --------------------------------

#: One RMM check: (rows, K, N, group size, bits, dtype name of ATTN_DTYPES, keep).
RmmConfig = Tuple[int, int, int, int, int, str, int]


@dataclass(frozen=True)
class RmmCase:
    """Operands of one rmm_qmm check: the qmm operands (x [M, K], w, scales, biases), keep, and the selection
    the oracle makes (kept [M, G] bool, from mlx_infer.kernels.rmm.group_mask)."""

    qmm: QmmCase
    keep: int
    kept: np.ndarray

    @property
    def used(self) -> np.ndarray:
        """[G] bool: groups some row keeps."""
        return self.kept.any(axis=0)

    def masked(self) -> QmmCase:
        """The qmm case whose product is the reduced one: x with each row's dropped groups zeroed."""
        q = self.qmm
        cols = mx.array(np.repeat(self.kept, q.group_size, axis=1))
        return QmmCase(mx.where(cols, q.x, mx.zeros_like(q.x)), q.w, q.scales, q.biases, q.group_size, q.bits)


def rmm_activations(rng: np.random.Generator, rows: int, k: int, group_size: int, kinds: Sequence[str],
                    small_groups: Sequence[int] = ()) -> np.ndarray:
    """x [rows, K] float32 of multiples of 1/16 below 16 in magnitude (exact in float16 and bfloat16; every sum
    of |x| over a group exact in float32, in any order, so a kernel's scores equal the oracle's bit for bit).
    Row m is kinds[m % len(kinds)]:
      "levels": each group a signed permutation of one base vector times a level in {1, 2, 3}: many groups share
                their score exactly;
      "flat":   every group a signed permutation of one base vector: all scores equal (index order decides);
      "random": independent values (scores mostly distinct).
    Groups in small_groups get magnitude 1/16 everywhere: below every other group's score in every row."""
    groups = k // group_size
    x = np.empty((rows, groups, group_size), np.float32)
    for m in range(rows):
        kind = kinds[m % len(kinds)]
        if kind == "random":
            x[m] = np.clip(np.rint(rng.standard_normal((groups, group_size)) * 16), -255, 255) / 16
            x[m][x[m] == 0] = 2 / 16
            continue
        if kind not in ("levels", "flat"):
            raise ValueError(f"unknown row kind {kind!r}")
        base = rng.integers(2, 86, size=group_size) / 16
        levels = rng.integers(1, 4, size=groups) if kind == "levels" else np.ones(groups, np.int64)
        for g in range(groups):
            x[m, g] = rng.permutation(base) * levels[g] * rng.choice([-1.0, 1.0], size=group_size)
    for g in small_groups:
        x[:, g] = rng.choice([-1.0, 1.0], size=(rows, group_size)) / 16
    return x.reshape(rows, k)


def rmm_case(c: RmmConfig, kinds: Sequence[str] = ("levels", "flat", "random"),
             small_groups: Sequence[int] = ()) -> RmmCase:
    """Operands of one RMM check: w, scales, biases as random_case makes them, x from rmm_activations, and the
    oracle's selection (group_mask of x)."""
    from mlx_infer.kernels.rmm import group_mask

    rows, k, n, gs, bits, dtype, keep = c
    seed = 7919 * rows + k + n + gs + bits + 31 * keep
    base = random_case(rows, k, n, gs, bits, ATTN_DTYPES[dtype], seed=seed)
    rng = np.random.default_rng(seed + 1)
    x = mx.array(rmm_activations(rng, rows, k, gs, kinds, small_groups)).astype(ATTN_DTYPES[dtype])
    kept = np.array(group_mask(x, gs, keep))
    return RmmCase(QmmCase(x, base.w, base.scales, base.biases, gs, bits), keep, kept)


def rmm_case_id(c: RmmConfig) -> str:
    rows, k, n, gs, bits, dtype, keep = c
    return f"{dtype}-b{bits}-g{gs}-m{rows}-{k}x{n}-keep{keep}"
