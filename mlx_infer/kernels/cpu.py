"""The CPU kernels: an MLX C++ extension (`cpu_kernels/`: Primitives with `eval_cpu`, AVX-512 / AVX2
chosen at run time, NEON or plain C++ elsewhere, products split over the cores), built against the MLX
this Python runs.

`pip install mlx-infer` ships the sources, not a binary: the extension is built on first use (or ahead
of time by `build_cpu_kernels()`) into `cache_dir()/kernels/<mlx version>-<python tag>-<arch>/`, under a
file lock so that two processes never build at once, with a note and its progress on stderr (1-2 minutes
on 2 cores, more while other work shares them). A first build compiles only the instruction set this CPU
runs best (and the one $MLX_INFER_KERNEL_ISA names); another variant asked for later is built then. The
build runs in a tree of its own, through `build_guard.py`: killing this process (Ctrl-C, SIGTERM, even
SIGKILL) stops cmake and its compilers too, and no build touches a tree another live build uses.
`MLX_INFER_KERNEL_DIR=DIR` loads the kernels from DIR when it holds a build of these sources (the tests
build once and share it; otherwise the cache's folder is used). It needs a C++ compiler, make or ninja,
CMake >= 3.27 and nanobind (`pip install 'mlx-infer[kernels]'` brings the last two). Without them, or
when a build failed (the reason is recorded and not retried until the sources, MLX, the tools or the
variants change), `available()` is False, `why_not()` says what is missing in one line, and callers use
the pure-mx reference.

    from mlx_infer.kernels import cpu
    if cpu.available():
        y = cpu.cpu_qmm(x, w, scales, biases, group_size=32, bits=4)   # [M, N]

`MLX_INFER_KERNELS=off` turns the kernels off (the reference runs); `MLX_INFER_KERNEL_THREADS` and
`MLX_INFER_KERNEL_ISA` (avx512, avx2, generic; avx512vnni and avx2int8 for the int8-activation
products, docs/kernels.md; a value naming none counts as unset, with a warning) pick the threads and
instruction set. The environment is read once per process (`refresh()` reads it again).
"""

import atexit
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional, Tuple

import filelock
import mlx.core as mx

from mlx_infer.errors import MlxInferError
from mlx_infer.kernels import cpu_build
from mlx_infer.paths import cache_dir, warn_not_cached, write_error

#: Environment variable that turns the kernels off when set to "off" (or "0").
KERNELS_ENV = "MLX_INFER_KERNELS"
#: Environment variable that picks the kernels' instruction set, and the variants it names (the int8
#: activations run only when asked for: avx512vnni, avx2int8; cpu_kernels/qmm.cpp's pick_kernel).
ISA_ENV = "MLX_INFER_KERNEL_ISA"
ISA_CHOICES = ("avx512", "avx2", "generic", "avx512vnni", "avx2int8")
#: Environment variable naming a folder of built kernels, used when it holds a build of these sources (and
#: of the variants wanted); the tests build once and point every subprocess there.
KERNEL_DIR_ENV = "MLX_INFER_KERNEL_DIR"
#: Oldest CMake that builds MLX extensions (MLX's CMake config requires it).
MIN_CMAKE = (3, 27)
#: Seconds a build (or a wait for another process's build) may take before it counts as failed.
BUILD_TIMEOUT_S = 900
#: The pip extra that brings the build tools.
KERNELS_EXTRA = "pip install 'mlx-infer[kernels]'"
#: The extension's module name (its PyInit symbol) and the sources it is built from.
MODULE_NAME = "_cpu_kernels"
SOURCE_PATTERNS = ("CMakeLists.txt", "*.h", "*.cpp")

_PACKAGE = Path(__file__).resolve().parents[1]


@dataclass
class _State:
    """What this process knows about the extension of one build directory: the loaded module, or why
    there is none (found once per directory; a process normally has one)."""

    module: Optional[ModuleType] = None
    reason: Optional[str] = None
    backend: str = "reference"  # cpu_backend()'s answer on the CPU device: "cpu-<isa>" with a module
    int8_bits: tuple = ()  # int8_bits()'s answer with a module


#: Temporary build folders of this process, per cache folder that could not be written.
_scratch_dirs: Dict[Path, Path] = {}
#: The extension found per build directory (a process normally uses one).
_states: Dict[Path, _State] = {}
#: The state in force, read from the environment on first use (None: not read yet; see refresh()).
_current: Optional[_State] = None


def source_dir() -> Optional[Path]:
    """The extension's sources: mlx_infer/cpu_kernels in an installed package, else cpu_kernels/ in the
    source tree beside the package; None when neither has them."""
    for base in (_PACKAGE, _PACKAGE.parent):
        path = base / "cpu_kernels"
        if (path / "CMakeLists.txt").is_file():
            return path
    return None


def build_dir() -> Path:
    """Where the extension is built and cached: $MLX_INFER_KERNEL_DIR when it holds a build of these
    sources with the variants wanted (wanted_variants()); else cache_dir()/kernels/<mlx version>-<python
    tag>-<arch>-<the sources' fingerprint>, one folder per build (so checkouts or virtual environments of
    other versions never rebuild over each other, nor swap the file another process is loading); when that
    folder cannot be written and holds no build of these sources, a temporary folder of this process
    (removed at exit; the kernels are built again on every run), with one warning."""
    shared = os.environ.get(KERNEL_DIR_ENV, "").strip()
    if shared and _has_build(Path(shared), _fingerprint(), wanted_variants()):
        return Path(shared)
    tag = f"{mx.__version__}-{sys.implementation.cache_tag}-{platform.machine()}-{_fingerprint()}"
    wanted = cache_dir() / "kernels" / tag
    if wanted in _scratch_dirs:
        return _scratch_dirs[wanted]
    error = write_error(wanted)
    if error is None or _has_build(wanted, _fingerprint(), wanted_variants()):
        return wanted  # (a build of these sources in a read-only folder: loading it writes nothing)
    warn_not_cached(wanted, error, "building the CPU kernels in a temporary folder (again on every run)")
    scratch = Path(tempfile.mkdtemp(prefix="mlx-infer-kernels-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    _scratch_dirs[wanted] = scratch
    return scratch


def module_path() -> Path:
    """The built extension's file inside build_dir()."""
    return build_dir() / _module_file()


def _module_file() -> str:
    return f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"


def wanted_variants() -> tuple:
    """The x86 variants the kernels need here (cpu_build.wanted_variants): the best this CPU runs, and
    the one $MLX_INFER_KERNEL_ISA names when the CPU runs it; () off x86."""
    return cpu_build.wanted_variants(os.environ.get(ISA_ENV, ""))


def built_variants(folder: Path) -> Optional[tuple]:
    """The x86 variants of the build in `folder` (all, for a build recorded before builds chose), or None
    when it holds no build."""
    record = _read_json(folder / "build.json")
    if "fingerprint" not in record:
        return None
    return tuple(record.get("variants", cpu_build.VARIANTS))


def _has_build(folder: Path, fingerprint: str, variants: tuple = ()) -> bool:
    """Whether `folder` holds a built extension of the sources with this fingerprint, with `variants`."""
    record = _read_json(folder / "build.json")
    return (record.get("fingerprint") == fingerprint and (folder / _module_file()).is_file()
            and set(variants) <= set(record.get("variants", cpu_build.VARIANTS)))


def _turned_off() -> bool:
    return os.environ.get(KERNELS_ENV, "").strip().lower() in ("off", "0", "false", "no")


def _cmake_version(cmake: str) -> Optional[Tuple[int, ...]]:
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"version (\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def find_cmake() -> Optional[str]:
    """A CMake >= MIN_CMAKE: the one pip installed beside this Python first, then PATH's; else None."""
    candidates = [str(Path(sys.executable).parent / "cmake"), shutil.which("cmake")]
    for cmake in candidates:
        if cmake and os.access(cmake, os.X_OK):
            version = _cmake_version(cmake)
            if version is not None and version >= MIN_CMAKE:
                return cmake
    return None


def find_compiler() -> Optional[str]:
    """The C++ compiler CMake would use ($CXX, c++, g++ or clang++), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


def missing_tools() -> Optional[str]:
    """One line saying which build tool is missing and how to get it, or None when all are there."""
    if source_dir() is None:
        return "the CPU kernel sources are not installed (reinstall mlx-infer from its source)"
    if find_compiler() is None:
        return "no C++ compiler (install g++ or clang++, e.g. apt-get install g++)"
    if shutil.which("make") is None and shutil.which("ninja") is None:
        return "neither make nor ninja is installed (apt-get install make)"
    if find_cmake() is None:
        return f"CMake >= {MIN_CMAKE[0]}.{MIN_CMAKE[1]} is missing ({KERNELS_EXTRA})"
    if importlib.util.find_spec("nanobind") is None:
        return f"nanobind is missing ({KERNELS_EXTRA})"
    return None


def _nanobind_version() -> Optional[str]:
    try:
        return importlib.metadata.version("nanobind")
    except importlib.metadata.PackageNotFoundError:
        return None


def _fingerprint() -> str:
    """What a build depends on: the sources, MLX, this Python and nanobind (a change rebuilds). Cheap: no
    tool is run, so finding a cached build costs milliseconds, and loading it needs no compiler."""
    digest = hashlib.sha256()
    src = source_dir()
    for pattern in SOURCE_PATTERNS:
        for path in sorted(src.glob(pattern)) if src else ():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    for part in (mx.__version__, sys.version, _nanobind_version()):
        digest.update(str(part).encode())
    return digest.hexdigest()[:16]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def build_cpu_kernels(force: bool = False, quiet: bool = False, variants: Optional[tuple] = None) -> Path:
    """Build the CPU kernels for this MLX and Python (once; later calls find them in the cache).

    Args:
        force: rebuild even when a build (or a recorded failure) for these sources exists.
        quiet: no note nor progress on stderr while building.
        variants: the x86 variants to build (of cpu_build.VARIANTS); None: wanted_variants(). A build
            keeps the variants an earlier build of the same sources in that folder had.

    Returns:
        The path of the built extension module.

    Raises:
        MlxInferError: a build tool is missing, or the build failed or ran past BUILD_TIMEOUT_S (the
            reason, with the log's path, is recorded in build_dir()/failed.json).
        filelock.Timeout: another process's build held the folder's lock past BUILD_TIMEOUT_S.
        KeyboardInterrupt: as raised; the build's processes are stopped first.
    """
    out = build_dir()
    fingerprint = _fingerprint()
    need = cpu_build.with_bases(wanted_variants() if variants is None else variants)
    if not force and _has_build(out, fingerprint, need):
        return out / _module_file()  # built before: loading it needs none of the build tools
    missing = missing_tools()
    if missing:
        raise MlxInferError(f"cannot build the CPU kernels: {missing}")
    out.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(out / "build.lock"), timeout=BUILD_TIMEOUT_S):
        if not force and _has_build(out, fingerprint, need):
            return out / _module_file()  # another process built it while we waited
        if _has_build(out, fingerprint):
            need = cpu_build.with_bases(need + built_variants(out))  # keep what the build there had
        failed = _read_json(out / "failed.json")
        if not force and failed.get("fingerprint") == fingerprint and failed.get("variants") == list(need):
            raise MlxInferError(failed.get("reason", "the CPU kernels failed to build"))
        cpu_build.remove_stale_trees(out)
        if not quiet:
            what = f" ({', '.join(need)})" if need else ""
            where = (f"once: 1-2 minutes on 2 cores; cached in {out}" if out not in _scratch_dirs.values()
                     else f"1-2 minutes on 2 cores, in {out}: the cache cannot be written")
            print(f"mlx-infer: building the CPU kernels{what} for MLX {mx.__version__} ({where})",
                  file=sys.stderr, flush=True)
        _compile(out, need, cpu_build.Progress(quiet))
        (out / "failed.json").unlink(missing_ok=True)
        _write_json(out / "build.json", {"fingerprint": fingerprint, "mlx": mx.__version__, "variants": list(need)})
    return out / _module_file()


def _compile(out: Path, variants: tuple, progress: cpu_build.Progress) -> None:
    """Configure and build the extension with `variants` in a new tree in `out`, copy the module into
    `out` (atomically: a process loading the old file keeps its own copy) and remove the tree (its object
    files; a rebuild starts afresh anyway). Raises MlxInferError, after recording the reason in
    out/failed.json, when the build fails."""
    log_path = out / "build.log"
    tree = cpu_build.new_tree(out)
    try:
        with open(log_path, "w") as log:
            configure = [find_cmake(), "-S", str(source_dir()), "-B", str(tree), *cpu_build.cmake_generator(),
                         f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release",
                         f"-DMLX_INFER_VARIANTS={';'.join(variants)}"]
            cpu_build.run_guarded(configure, tree, BUILD_TIMEOUT_S, log, progress)
            cpu_build.run_guarded([find_cmake(), "--build", str(tree), "--parallel", str(os.cpu_count() or 1)],
                                  tree, BUILD_TIMEOUT_S, log, progress)
            built = next(tree.glob(f"{MODULE_NAME}*{sysconfig.get_config_var('EXT_SUFFIX')}"))
        tmp = (out / _module_file()).with_suffix(".tmp")
        shutil.copy2(built, tmp)
        tmp.replace(out / _module_file())
    except (OSError, subprocess.SubprocessError, StopIteration) as exc:
        timed_out = isinstance(exc, subprocess.CalledProcessError) and exc.returncode == cpu_build.TIMED_OUT
        reason = (f"the CPU kernels failed to build ({f'past {BUILD_TIMEOUT_S} s' if timed_out else type(exc).__name__}"
                  f"; log: {log_path}); retry with mlx_infer.kernels.cpu.build_cpu_kernels(force=True)")
        _write_json(out / "failed.json", {"fingerprint": _fingerprint(), "variants": list(variants), "reason": reason})
        raise MlxInferError(reason) from exc
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    progress.done()


def self_test(module: ModuleType) -> None:
    """One tiny product through the built module, checked against its known value: a module built
    against another MLX or nanobind ABI loads but fails at its first call. Raises RuntimeError, or the
    call's TypeError / ValueError."""
    w = mx.zeros((3, 8), dtype=mx.uint32)  # [N=3, K*4/32]: K = 64, all codes 0, so W = biases
    scales, biases = mx.ones((3, 2)), mx.full((3, 2), 0.5)
    y = module.qmm(mx.ones((2, 64)), w, scales, biases, 32, 4, stream=mx.cpu)  # each output: 64 * 0.5
    if y.shape != (2, 3) or not mx.all(y == 32.0).item():
        raise RuntimeError("a known product came out wrong")


def _find() -> _State:
    try:
        path = build_cpu_kernels()
        spec = importlib.util.spec_from_file_location(f"mlx_infer.kernels.{MODULE_NAME}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (MlxInferError, ImportError, OSError, filelock.Timeout) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return _State(reason=f"{reason}; the CPU path uses MLX's own ops")
    try:
        self_test(module)
    except (RuntimeError, TypeError, ValueError) as exc:
        return _State(reason=f"the CPU kernels in {path} were built but do not run ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); rebuild them with "
                             "mlx_infer.kernels.cpu.build_cpu_kernels(force=True)")
    unknown = unknown_isa_request()
    if unknown is not None:
        warnings.warn(f"{ISA_ENV}={unknown} names no kernel variant (use one of {', '.join(ISA_CHOICES)}, or unset "
                      f"it); the CPU kernels run {module.isa()}, the best this CPU has", stacklevel=2)
    return _State(module=module, backend=f"cpu-{module.isa()}", int8_bits=tuple(module.int8_bits()))


def _load() -> _State:
    global _current
    if _current is None:
        if _turned_off():
            _current = _State(reason=f"turned off by {KERNELS_ENV}={os.environ[KERNELS_ENV]}")
        else:
            key = build_dir()
            if key not in _states:
                _states[key] = _find()
            _current = _states[key]
    return _current


def refresh() -> None:
    """Read the environment again at the next call ($MLX_INFER_KERNELS, the cache location): it is read
    once per process, as the kernels are called on every matmul."""
    global _current
    _current = None
    build_id.cache_clear()


def available() -> bool:
    """Whether the CPU kernels can run (building them on the first call when needed)."""
    return _load().module is not None


def why_not() -> Optional[str]:
    """None when the kernels are available, else one line: what is missing and how to get it."""
    return _load().reason


def _module() -> ModuleType:
    module = (_current or _load()).module
    if module is None:
        raise RuntimeError(f"the mlx-infer CPU kernels are not available: {why_not()}")
    return module


def isa() -> str:
    """The instruction set the kernels run with: 'avx512', 'avx2', 'neon' or 'generic' ('avx512vnni',
    'avx2int8' when MLX_INFER_KERNEL_ISA asks for them).

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
    """
    return _module().isa()


def int8_bits() -> tuple:
    """The weight bit widths (of 4 and 8) whose products round x to int8 in chunks of 32 on this instruction
    set (avx512vnni: 4 and 8; avx2int8: 4; others: none, every product in float32).

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
    """
    _module()  # raises when there are no kernels
    return (_current or _load()).int8_bits


def int8_variants() -> tuple:
    """The int8-activation variants this CPU can run, best first ('avx512vnni', 'avx2int8': values of
    $ISA_ENV), whichever variant runs now.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
    """
    return tuple(_module().int8_variants())


def unknown_isa_request() -> Optional[str]:
    """$ISA_ENV's value when it names none of ISA_CHOICES (any case), else None. The kernels then run the
    best variant this CPU has, as with it unset; loading them warns once."""
    value = os.environ.get(ISA_ENV, "").strip()
    return value if value and value.lower() not in ISA_CHOICES else None


def int8_activations() -> bool:
    """Whether quantized products here round x to int8 (MLX's default device is the CPU and int8_bits()
    is not empty). Then attention computes every query row as a decode step does, whatever the forward's
    width (kernels/paged_attention.py), so that a row's activations, and x's rounding of them, do not depend
    on how a prompt is chunked or batched or on the KV layout (docs/kernels.md#int8-activations-opt-in)."""
    state = _current or _load()
    return bool(state.int8_bits) and mx.default_device() == mx.cpu


@functools.lru_cache(maxsize=1)
def build_id() -> Optional[str]:
    """The fingerprint of the kernels in use (their sources, MLX, Python and nanobind: what a rebuild
    follows), None when they are not available. A timing measured on one build does not hold for another
    (speculative.target.measurement_key)."""
    return _fingerprint() if available() else None


def cpu_backend() -> str:
    """'cpu-<isa>' when MLX's default device is the CPU and the kernels are available (what the kernel
    modules' `*_backend()` report for their CPU kernel), else 'reference'."""
    state = _current or _load()  # every kernel call asks: the answer is kept with the loaded module
    return state.backend if mx.default_device() == mx.cpu else "reference"


def num_threads() -> int:
    """Threads a product is split over, the caller included ($MLX_INFER_KERNEL_THREADS, else one per
    core).

    Raises:
        RuntimeError: the kernels are not available.
    """
    return _module().num_threads()


def cpu_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
            bits: int, residual: Optional[mx.array] = None) -> mx.array:
    """y = x @ dequantize(w, scales, biases).T on the CPU kernel, reading each weight group once for all
    rows (equals mx.quantized_matmul(..., transpose=True) up to float32 rounding).

    Args:
        x: [..., K] float32, float16 or bfloat16 (any strides); the leading axes are M rows.
        w: [N, K * bits / 32] uint32, MLX's affine packing (value j of a word in bits [bits*j, bits*j+bits)).
        scales, biases: [N, K / group_size], float32/float16/bfloat16 (usually x's dtype).
        group_size: 32, 64 or 128.
        bits: 4 or 8.
        residual: optional float32 [..., N] added to a float32 product in the same operation (bit for
            bit `residual + y`: a decoder block's residual connection without an add of its own).

    Returns:
        y [..., N] in promote_types(x.dtype, scales.dtype), accumulated in float32; on the CPU stream.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: shapes, dtypes, bits or group size the kernel does not take; a residual of another
            shape or dtype, or with a product that is not float32.
    """
    return _module().qmm(x, w, scales, biases, group_size, bits, residual, stream=mx.cpu)


def cpu_rmm_qmm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                keep: int) -> mx.array:
    """RMM's reduced product on the CPU kernel (see kernels.rmm for the selection rule): each row of x
    [M, K] keeps its `keep` groups of largest sum |x|; y [M, N] in promote_types(x.dtype, scales.dtype),
    accumulated in float32. Selection runs inside the kernel, and only groups some row keeps are read
    from w, scales and biases (operands as cpu_qmm's).

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: bad operands, or keep outside [1, K / group_size].
    """
    return _module().rmm_qmm(x, w, scales, biases, group_size, bits, keep, stream=mx.cpu)


def cpu_quant_attention(q: mx.array, keys, values, length: int, scale: float, positions: int, group_size: int,
                        k_bits: int, v_bits: int, channel_keys: bool = False, with_lse: bool = False):
    """Attention over a quantized KV cache on the CPU kernel (see kernels.attention.quant_attention for the
    arguments): q [H, R, D] -> out [H, R, Dv] in q's dtype, accumulated in float32. channel_keys: keys in
    KIVI's layout (w [H, D, C * k_bits / 32], scales / biases [H, D, C / group_size]). with_lse: return
    (out float32, lse [H, R] float32), lse the log of the softmax denominator (to merge with other keys).

    Raises:
        MlxInferError: the kernels are not available (why_not() says why).
        ValueError: operands the kernel does not take.
    """
    out, lse = _module().quant_attention(q, *keys, *values, length, scale, positions, group_size, k_bits, v_bits,
                                         channel_keys, stream=mx.cpu)
    if with_lse:
        return out, lse
    return out if q.dtype == mx.float32 else out.astype(q.dtype)


def cpu_paged_attention(q: mx.array, k_pool: mx.array, v_pool: mx.array, index: mx.array, lengths: mx.array,
                        q_pos: mx.array, k_pos: mx.array, scale: float, window: int = 0) -> mx.array:
    """Attention of B requests' queries over their live tokens in a float paged KV pool, on the CPU kernel,
    reading each K/V row through the token table's row index (no gathered copy): each row read once for all
    n_rep * L query rows of its KV head, online softmax in float32 over tiles of 32 keys, split over the
    cores (flash-decoding partials merged). The oracle is kernels.paged_attention.reference_paged_attention.

    Args:
        q: [B, n_q, L, D] float32 / float16 / bfloat16 queries (RoPE applied).
        k_pool: [rows, D] one layer's keys of the pool (BlockPool.layer_kv(layer)[0]: row = head * slots + slot).
        v_pool: [rows, Dv] its values, k_pool's dtype (float32 / float16 / bfloat16); D, Dv multiples of 16.
            Both may have more leading dims (the same), taken together as the rows.
        index: int32 [B, n_kv, S] pool rows of request b's live tokens for KV head h, right-padded (n_q a
            multiple of n_kv: query head g reads KV head g // (n_q // n_kv)).
        lengths: int32 [B] live tokens of each request (entries of index past lengths[b] are not read).
        q_pos: int32 [B, L] original positions of the queries; k_pos: int32 [B, S] of the keys.
        scale: the softmax scale (usually D ** -0.5).
        window: sliding window in positions (0: none): query at p sees key at k iff k <= p and p - k < window.

    Returns:
        [B, n_q, L, Dv] in q's dtype (a query that sees no key gets zeros; an index entry outside
        [0, rows) is a key no query sees); on the CPU stream.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: operands the kernel does not take (shapes, dtypes, head dims, window < 0).
    """
    return _module().paged_attention(q, k_pool, v_pool, index, lengths, q_pos, k_pos, scale, window, stream=mx.cpu)


def cpu_paged_quant_attention(q: mx.array, keys, values, index: mx.array, lengths: mx.array, q_pos: mx.array,
                              k_pos: mx.array, scale: float, group_size: int, window: int = 0) -> mx.array:
    """cpu_paged_attention over a pool of quantized blocks: each K/V row, packed in MLX's affine layout,
    is dequantized into the kernel's tile scratch as it is read through the index (no gathered or
    dequantized copy). The oracle is kernels.paged_attention.reference_paged_quant_attention.

    Args:
        q: [B, n_q, L, D] float32 / float16 / bfloat16 queries (RoPE applied).
        keys: (codes uint32 [rows, D * k_bits / 32], scales, biases [rows, D / group_size]) one layer's keys
            of the pool (BlockPool.layer_kv(layer)[0]); values: the same for V (v_bits, Dv). Bits 4 or 8; D, Dv
            multiples of 32 and of group_size; scales and biases float16 / bfloat16 / float32, one dtype.
        index, lengths, q_pos, k_pos, scale, window: as cpu_paged_attention.
        group_size: values per scale / bias along head_dim (32, 64 or 128).

    Returns:
        [B, n_q, L, Dv] in q's dtype, as cpu_paged_attention.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: operands the kernel does not take.
    """
    return _module().paged_quant_attention(q, *keys, *values, index, lengths, q_pos, k_pos, scale, group_size, window,
                                           stream=mx.cpu)


def cpu_causal_softmax(scores: mx.array, scale: float, period: int, q0: int, window: int = 0) -> mx.array:
    """The causal softmax of one prefill tile's attention scores on the CPU kernel: vectorized e^x
    (AVX-512 / AVX2; MLX's CPU softmax calls the scalar libm exp per element), rows split over the cores,
    the scores' buffer reused for the result when MLX can donate it.

    Args:
        scores: [..., R, S] float32, q . k (unscaled); row r of each matrix is the query at position
            q0 + r % period (a tile of `period` queries, repeated for the heads of a GQA group), column j
            the key at position j.
        scale: the softmax scale (> 0; usually D ** -0.5).
        period: queries in the tile (>= 1).
        q0: position of the tile's first query (>= 0).
        window: sliding window in positions (0: none): the query at p sees key j iff j <= p and p - j < window.

    Returns:
        [..., R, S] float32: softmax(scale * scores) over the keys each row sees, 0 for the others.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: another dtype or ndim < 2, period < 1, q0 < 0, window < 0 or scale <= 0.
    """
    return _module().causal_softmax(scores, scale, period, q0, window, stream=mx.cpu)


def cpu_move_rows(a: mx.array, src: mx.array, dst: mx.array) -> mx.array:
    """a [R, W] (any dtype) with row dst[i] replaced by row src[i] of a, on the CPU kernel: the reads see a
    before any write (src and dst may overlap), and when MLX can donate a's buffer (nothing else holds a)
    the result takes it and only the M rows are copied; otherwise a is copied once first.

    Args:
        a: [R, W], any dtype and strides.
        src, dst: int32 [M], indices in [0, R) (an index outside is skipped: check them first).

    Returns:
        [R, W] in a's dtype, on the CPU stream.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: a not 2-D, or src / dst not int32 [M] of one size.
    """
    return _module().move_rows(a, src, dst, stream=mx.cpu)


def cpu_write_rows(a: mx.array, x: mx.array, dst: mx.array) -> mx.array:
    """a [R, W] with row dst[i] replaced by row i of x [..., W] (a's dtype; its leading axes flattened into M
    rows, any strides), dst int32 [M] in [0, R) (an index outside is skipped), on the CPU kernel: one
    operation, in place when MLX can donate a's buffer (as cpu_move_rows).

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: a not 2-D, x of another width or dtype, or dst not int32 [M].
    """
    return _module().write_rows(a, x, dst, stream=mx.cpu)


def cpu_rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """mx.fast.rms_norm(x, weight, eps) as one operation on the CPU kernel (MLX's CPU backend runs it as
    11): x / sqrt(mean(x^2) + eps) * weight, the mean in float32, the normalized row rounded to the output
    dtype before the weight's product.

    Args:
        x: [..., D] float32 / float16 / bfloat16, any strides.
        weight: [D], float.
        eps: >= 0.

    Returns:
        [..., D] in promote_types(x.dtype, weight.dtype), on the CPU stream.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: a dtype, a weight shape or an eps the kernel does not take.
    """
    return _module().rms_norm(x, weight, eps, stream=mx.cpu)


def cpu_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up (SwiGLU's gate, arXiv 2002.05202) as one operation on the CPU kernel, where mlx-lm's
    compiled `swiglu` runs through MLX's generated CPU kernel with a scalar exp, much slower (measured in
    docs/kernels.md).

    Args:
        gate, up: float32, one shape, any strides.

    Returns:
        gate * sigmoid(gate) * up, float32, gate's shape, on the CPU stream (sigmoid through the kernel
        variant's vector e^x, within 2 ulp).

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: another dtype or differing shapes.
    """
    return _module().swiglu(gate, up, stream=mx.cpu)


def cpu_swiglu_packed(gu: mx.array) -> mx.array:
    """cpu_swiglu of one packed product gu [..., 2F] float32 (gate in features [0, F), up in [F, 2F), as a
    fused gate / up product gives them; any strides) -> [..., F], without an operation splitting gu.
    Raises RuntimeError (no kernels) or ValueError (another dtype, an odd last axis)."""
    return _module().swiglu_packed(gu, stream=mx.cpu)


def cpu_geglu_packed(gu: mx.array) -> mx.array:
    """cpu_geglu of one packed product gu [..., 2F] float32 (gate, then up) -> [..., F], as cpu_swiglu_packed."""
    return _module().geglu_packed(gu, stream=mx.cpu)


def cpu_geglu(gate: mx.array, up: mx.array) -> mx.array:
    """gelu_approx(gate) * up (GeGLU's gate with GELU's tanh approximation, arXiv 2002.05202, as Gemma's MLP
    computes it) as one operation on the CPU kernel, where mlx's compiled `gelu_approx` runs through MLX's
    generated CPU kernel with a scalar tanh (docs/kernels.md).

    Args:
        gate, up: float32, one shape, any strides.

    Returns:
        gate * sigmoid(2 sqrt(2 / pi) (gate + 0.044715 gate^3)) * up (= 0.5 gate (1 + tanh(...)) * up),
        float32, gate's shape, on the CPU stream (sigmoid through the kernel variant's vector e^x).

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: another dtype or differing shapes.
    """
    return _module().geglu(gate, up, stream=mx.cpu)


def cpu_rope(x: mx.array, dims: int, traditional: bool, base: Optional[float], scale: float, offset,
             freqs: Optional[mx.array] = None) -> mx.array:
    """mx.fast.rope(x, dims, traditional=, base=, scale=, offset=, freqs=) as one operation on the CPU
    kernel (MLX's CPU backend runs it as 29), computed as MLX's own fallback (angles in float32).

    Args:
        x: [B, ..., T, D] float32 / float16 / bfloat16 (ndim >= 3), any strides.
        dims: features rotated (even, <= D); the rest are copied.
        traditional: rotate pairs (2i, 2i + 1) instead of (i, i + dims / 2).
        base: the frequency base (None with freqs).
        scale: positions are (t + offset) * scale.
        offset: int, or an integer mx.array scalar or [B] (one per batch row).
        freqs: [dims / 2] frequencies (theta_i = position / freqs[i]) instead of base.

    Returns:
        [B, ..., T, D] in x's dtype, row-contiguous, on the CPU stream.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: a dtype, ndim, dims, offset or freqs the kernel does not take.
    """
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return _module().rope(x, offset, dims, traditional, 1.0 if base is None else base, scale, freqs, stream=mx.cpu)


def cpu_rope_heads(q: mx.array, k: mx.array, v: mx.array, n_q: int, n_kv: int, dims: int, traditional: bool,
                   base: Optional[float], scale: float, offset, freqs: Optional[mx.array] = None) -> tuple:
    """Attention's heads from its input projections, q and k rotated as `cpu_rope` rotates them, as one
    operation on the CPU kernel (it replaces 3 reshapes, 3 transposes and 2 rope operations).

    Args:
        q: [B, T, n_q * D], k: [B, T, n_kv * D], v: [B, T, n_kv * Dv], one float dtype, any strides.
        n_q, n_kv: query and key / value heads.
        dims, traditional, base, scale, offset, freqs: as `cpu_rope`.

    Returns:
        (q [B, n_q, T, D], k [B, n_kv, T, D], v [B, n_kv, T, Dv]) row-contiguous, in q's dtype.

    Raises:
        RuntimeError: the kernels are not available (see why_not()).
        ValueError: dtypes, shapes, head counts, dims, offset or freqs that do not agree.
    """
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return tuple(_module().rope_heads(q, k, v, offset, n_q, n_kv, dims, traditional, 1.0 if base is None else base,
                                      scale, freqs, stream=mx.cpu))


def cpu_rope_heads_packed(qkv: mx.array, n_q: int, n_kv: int, dims: int, traditional: bool, base: Optional[float],
                          scale: float, offset, freqs: Optional[mx.array] = None) -> tuple:
    """cpu_rope_heads of one packed projection qkv [B, T, (n_q + 2 n_kv) * D] (q's, k's and v's columns in
    that order, as one fused q / k / v product gives them; any strides), without an operation splitting it:
    (q [B, n_q, T, D], k [B, n_kv, T, D], v [B, n_kv, T, D]). Raises RuntimeError (no kernels) or ValueError
    (a width that n_q + 2 n_kv heads do not split, dims, offset or freqs as cpu_rope_heads)."""
    if not isinstance(offset, mx.array):
        offset = mx.array(offset, dtype=mx.int32)
    return tuple(_module().rope_heads_packed(qkv, offset, n_q, n_kv, dims, traditional, 1.0 if base is None else base,
                                             scale, freqs, stream=mx.cpu))
