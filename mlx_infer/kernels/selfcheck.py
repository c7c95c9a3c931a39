"""The kernel self-check: every custom kernel a loaded model would use, run on this machine's device at the
model's shapes, compared with the pure-mx reference and timed against MLX's own operation.

    results = check_kernels(model_shapes(model, config))      # one KernelCheck per kernel, cached
    checked_gpu_kernels(model, config)                        # on Metal / CUDA: decide, record, wire qmm

Kernels (kernels/switch.py's names): "qmm" (the quantized matmul, at each quantized layer's shape and x of
1..16 rows: decode and the verify widths), "quant_attention" (attention over a quantized KV cache),
"paged_attention" (over the float paged pool, read in place) and "rmm_qmm" (RMM's gathered product). Each
case's operands are random (fixed seeds) in the model's dtype; the kernel's result is compared with a
float32 oracle (the reference in float32), the error being max |y - oracle| / max |oracle|, against a
tolerance by dtype (defaults.SELFCHECK_TOLERANCE). MLX's own operation is what runs where the kernel does
not: mx.quantized_matmul for qmm, the modules' pure-mx references (mx.dequantize / mx.take, then masked
softmax attention; the kept groups through mx.quantized_matmul) for the others. Cases are timed cheapest
first, each the median of SELFCHECK_REPEATS runs, until SELFCHECK_TIME_BUDGET_S of timing per kernel
(MLX's CPU quantized matmul is a scalar loop: a large float16 product takes seconds); the kernel is faster
when its total over the timed cases is smaller than MLX's.

Decision (policy "checked", the GPU's): a kernel is used where it passed (every case within the tolerance,
no error raised) and was faster; else MLX's op runs, and `reason` says why in one line. Policy "always"
(the CPU backend's default): the CPU kernels run as they always have (they are tested against the
reference in CI); the check there is informative. Results are cached under the user cache directory
(cache_dir()/kernel-checks), keyed by the device, MLX's version, the hash of the kernels' sources, the
kernels checked, the policy and the shapes: a second check reads them.
"""

import hashlib
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import defaults
from mlx_infer.paths import cached_json

from . import cpu, switch
from .attention import packed_bits, reference_quant_attention
from .gpu_attention import ATTN_GPU_MAX_ROWS, ATTN_HEAD_DIMS, cuda_quant_attention, metal_quant_attention
from .gpu_qmm import cuda_available, cuda_qmm, kernel_source_path, metal_available, metal_qmm
from .gpu_rmm import RMM_MAX_GROUPS, cuda_rmm_qmm, metal_rmm_qmm
from .paged_attention import PAGED_HEAD_DIM_MULTIPLE, reference_paged_attention
from .qmm import gpu_operands, reference_qmm
from .quantized import KERNEL_BITS, KERNEL_GROUP_SIZES, supports, use_gpu_qmm
from .rmm import group_keep, kept_columns, reference_rmm_qmm

__all__ = ["CACHE_KIND", "KERNEL_LABELS", "KernelCheck", "ModelShapes", "POLICIES", "check_kernels",
           "checked_gpu_kernels", "device_kernels", "device_name", "model_shapes", "sources_hash"]

#: The cache folder of the decisions (cache_dir() / CACHE_KIND).
CACHE_KIND = "kernel-checks"
#: What the user reads for each kernel name.
KERNEL_LABELS = {"qmm": "quantized matmul", "quant_attention": "quantized-KV attention",
                 "paged_attention": "paged attention", "rmm_qmm": "RMM gathered product"}
#: "checked": a kernel runs only where it passed and was faster; "always": it runs wherever it exists.
POLICIES = ("checked", "always")
#: Bumped when the cached results' meaning changes.
_VERSION = 1

Kernel = Callable[..., mx.array]


@dataclass(frozen=True)
class ModelShapes:
    """The shapes a model runs its kernels at.

    Attributes:
        linears: (N, K, bits, group_size) of each distinct quantized linear layer the kernels take.
        embeddings: the same for quantized embeddings used as the tied lm_head (qmm only; RMM leaves them).
        dtype: the activations' dtype name ("float16", ...).
        heads, kv_heads, head_dim: attention's query heads, KV heads and head dim (0: no attention checked).
    """

    linears: Tuple[Tuple[int, int, int, int], ...]
    embeddings: Tuple[Tuple[int, int, int, int], ...] = ()
    dtype: str = "float32"
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0


@dataclass(frozen=True)
class KernelCheck:
    """One kernel's check on this device.

    Attributes:
        name: switch.KERNEL_NAMES' name; label: what the user reads.
        device: where it ran (device_name()).
        max_error: largest error over the cases, relative to the oracle's largest magnitude (None: not run).
        tolerance: the largest error allowed.
        time_s, mlx_time_s: seconds of the kernel and of MLX's op, summed over the timed cases (None: not timed).
        passed: every case ran within the tolerance. faster: the kernel's time below MLX's.
        used: whether the engine runs the kernel here (else MLX's op). reason: why, in one line.
        cases, timed: cases checked and timed.
    """

    name: str
    label: str
    device: str
    max_error: Optional[float]
    tolerance: float
    time_s: Optional[float]
    mlx_time_s: Optional[float]
    passed: bool
    faster: bool
    used: bool
    reason: str
    cases: int = 0
    timed: int = 0


@dataclass
class _Case:
    """One shape of one kernel: run(fn) applies a kernel (or MLX's op) to the operands; oracle: the float32
    result; cost: multiply-adds (orders the timing)."""

    label: str
    run: Callable[[Kernel], mx.array]
    oracle: Callable[[], mx.array]
    cost: int


def device_name() -> str:
    """This machine's device as the check keys it: backend and device name ("metal Apple M2 Pro",
    "cpu x86_64 cpu-avx2")."""
    if mx.default_device() == mx.gpu:
        backend = "metal" if metal_available() else "cuda" if cuda_available() else "gpu"
        try:
            name = str(mx.device_info().get("device_name", ""))
        except Exception:  # an MLX without device_info on this backend
            name = ""
        return f"{backend} {name or platform.machine()}".strip()
    return f"cpu {platform.processor() or platform.machine()} {cpu.cpu_backend()}"


def sources_hash() -> str:
    """sha256 (hex, 16 digits) of every kernel source file: metal_kernels/, cuda_kernels/ and cpu_kernels/."""
    digest = hashlib.sha256()
    folders = [kernel_source_path("metal_kernels", "qmm.metal"), kernel_source_path("cuda_kernels", "metal_prelude.cuh")]
    roots = [p.parent for p in folders if p is not None] + [p for p in [cpu.source_dir()] if p is not None]
    for root in roots:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _layer_shape(layer: nn.Module) -> Tuple[int, int, int, int]:
    scales = layer["scales"]
    return int(scales.shape[0]), int(scales.shape[1] * layer.group_size), int(layer.bits), int(layer.group_size)


def model_shapes(model: nn.Module, config: Mapping) -> ModelShapes:
    """The shapes of `model`'s kernels: its quantized layers the kernels take (bits 4 / 8, group sizes 32 /
    64 / 128) and attention's heads from `config` (mlx-lm's config dict: num_attention_heads,
    num_key_value_heads, head_dim or hidden_size)."""
    linears, embeddings, dtype = set(), set(), None
    for _, layer in model.named_modules():
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and supports(layer) \
                and layer.bits in KERNEL_BITS and layer.group_size in KERNEL_GROUP_SIZES:
            (embeddings if isinstance(layer, nn.QuantizedEmbedding) else linears).add(_layer_shape(layer))
            dtype = dtype or layer["scales"].dtype
    heads = int(config.get("num_attention_heads") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0))
    name = str(dtype or mx.float32).split(".")[-1]
    return ModelShapes(tuple(sorted(linears)), tuple(sorted(embeddings)), name, heads, kv_heads, head_dim)


def _cpu_quant_attention(q, keys, values, length, scale, positions, group_size):
    return cpu.cpu_quant_attention(q, keys, values, length, scale, positions, group_size,
                                   packed_bits(keys, group_size)[0], packed_bits(values, group_size)[0])


def _gpu_qmm(run: Callable) -> Kernel:
    def kernel(x, w, scales, biases, group_size, bits):
        operands = gpu_operands(x, scales, biases)
        if operands is None:
            raise ValueError(f"scales of {scales.dtype} cannot be cast exactly to x's {x.dtype}")
        return run(x, w, *operands, group_size, bits)
    return kernel


def _gpu_rmm(run: Callable) -> Kernel:
    def kernel(x, w, scales, biases, group_size, bits, keep):
        operands = gpu_operands(x, scales, biases)
        if operands is None:
            raise ValueError(f"scales of {scales.dtype} cannot be cast exactly to x's {x.dtype}")
        return run(x, w, *operands, group_size, bits, keep)
    return kernel


def device_kernels() -> Tuple[str, Dict[str, Kernel]]:
    """(backend, name -> kernel) of the custom kernels this device has: 'metal' / 'cuda' (qmm, quantized-KV
    attention, RMM), 'cpu-<isa>' (all four) or 'reference' (none). Each kernel takes its reference's
    arguments (qmm: x, w, scales, biases, group_size, bits; rmm_qmm: those and keep; quant_attention:
    q, keys, values, length, scale, positions, group_size; paged_attention: q, k_pool, v_pool, index,
    lengths, q_pos, k_pos, scale)."""
    if metal_available():
        return "metal", {"qmm": _gpu_qmm(metal_qmm), "quant_attention": metal_quant_attention,
                         "rmm_qmm": _gpu_rmm(metal_rmm_qmm)}
    if cuda_available():
        return "cuda", {"qmm": _gpu_qmm(cuda_qmm), "quant_attention": cuda_quant_attention,
                        "rmm_qmm": _gpu_rmm(cuda_rmm_qmm)}
    backend = cpu.cpu_backend()
    if backend == "reference":
        return backend, {}
    return backend, {"qmm": cpu.cpu_qmm, "quant_attention": _cpu_quant_attention,
                     "paged_attention": cpu.cpu_paged_attention, "rmm_qmm": cpu.cpu_rmm_qmm}


def _dtype(name: str) -> mx.Dtype:
    return getattr(mx, name)


def _quantized(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, seed: int):
    """(w, scales, biases) of a random normal [n, k] weight in MLX's affine layout, scales / biases in dtype."""
    w, scales, biases = mx.quantize(mx.random.normal((n, k), key=mx.random.key(seed)) * 0.05,
                                    group_size=group_size, bits=bits)
    return w, scales.astype(dtype), biases.astype(dtype)


def _dequantized(w, scales, biases, group_size, bits) -> mx.array:
    return mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)


def _qmm_cases(shapes: ModelShapes, widths: Sequence[int], gpu: bool) -> List[_Case]:
    dtype, cases = _dtype(shapes.dtype), []
    for i, (n, k, bits, gs) in enumerate(shapes.linears + shapes.embeddings):
        w, s, b = _quantized(n, k, bits, gs, dtype, seed=i)
        wf = _dequantized(w, s, b, gs, bits)  # [N, K] float32, shared by the shape's widths
        for m in widths:
            x = mx.random.normal((m, k), key=mx.random.key(1000 + m)).astype(dtype)
            cases.append(_Case(f"N={n} K={k} {bits}-bit rows={m}",
                               lambda fn, x=x, w=w, s=s, b=b, gs=gs, bits=bits: fn(x, w, s, b, gs, bits),
                               lambda x=x, wf=wf: x.astype(mx.float32) @ wf.T, m * n * k))
    return cases


def _rmm_cases(shapes: ModelShapes, widths: Sequence[int], gpu: bool) -> List[_Case]:
    dtype, cases = _dtype(shapes.dtype), []
    for i, (n, k, bits, gs) in enumerate(shapes.linears):
        if gpu and k // gs > RMM_MAX_GROUPS:
            continue
        keep = group_keep(k, gs, defaults.SELFCHECK_RMM_RETENTION)
        w, s, b = _quantized(n, k, bits, gs, dtype, seed=i)
        wf = _dequantized(w, s, b, gs, bits)
        for m in widths:
            x = mx.random.normal((m, k), key=mx.random.key(2000 + m)).astype(dtype)
            cases.append(_Case(f"N={n} K={k} {bits}-bit keep={keep} rows={m}",
                               lambda fn, x=x, w=w, s=s, b=b, gs=gs, bits=bits, keep=keep: fn(x, w, s, b, gs, bits, keep),
                               lambda x=x, wf=wf, gs=gs, keep=keep: kept_columns(x.astype(mx.float32), gs, keep) @ wf.T,
                               m * n * keep * gs))
    return cases


def _kv_group_size(head_dim: int) -> int:
    return 64 if head_dim % 64 == 0 else 32


def _attention_cases(shapes: ModelShapes, widths: Sequence[int], gpu: bool) -> List[_Case]:
    n_kv, d, dtype, cases = shapes.kv_heads, shapes.head_dim, _dtype(shapes.dtype), []
    if not n_kv or d % 32 or (gpu and d not in ATTN_HEAD_DIMS):
        return cases
    n_rep, length, gs, scale = shapes.heads // n_kv, defaults.SELFCHECK_CONTEXT, _kv_group_size(d), d ** -0.5
    for bits in defaults.SELFCHECK_KV_BITS:
        keys, values = (_quantized(n_kv * length, d, bits, gs, dtype, seed=3000 + j) for j in (bits, bits + 1))
        keys, values = ([a.reshape(n_kv, length, -1) for a in packed] for packed in (keys, values))
        for positions in widths:
            if gpu and n_rep * positions > ATTN_GPU_MAX_ROWS:
                continue
            q = (mx.random.normal((n_kv, n_rep * positions, d), key=mx.random.key(4000 + positions))).astype(dtype)
            args = (keys, values, length, scale, positions, gs)
            cases.append(_Case(f"{n_kv} KV heads x {n_rep} D={d} {bits}-bit S={length} positions={positions}",
                               lambda fn, q=q, args=args: fn(q, *args),
                               lambda q=q, args=args: reference_quant_attention(q.astype(mx.float32), *args),
                               2 * n_kv * n_rep * positions * length * d))
    return cases


def _paged_cases(shapes: ModelShapes, widths: Sequence[int], gpu: bool) -> List[_Case]:
    n_kv, d, dtype, cases = shapes.kv_heads, shapes.head_dim, _dtype(shapes.dtype), []
    if not n_kv or d % PAGED_HEAD_DIM_MULTIPLE:
        return cases
    length, scale = defaults.SELFCHECK_CONTEXT, d ** -0.5
    rows = n_kv * length
    k_pool, v_pool = (mx.random.normal((rows, d), key=mx.random.key(5000 + j)).astype(dtype) for j in (0, 1))
    order = mx.random.permutation(length, key=mx.random.key(5002)).astype(mx.int32)  # a scattered token table
    index = (mx.arange(n_kv, dtype=mx.int32)[:, None] * length + order[None, :])[None]  # [1, n_kv, S]
    lengths, k_pos = mx.array([length], dtype=mx.int32), mx.arange(length, dtype=mx.int32)[None]
    for positions in widths:
        q = mx.random.normal((1, shapes.heads, positions, d), key=mx.random.key(6000 + positions)).astype(dtype)
        q_pos = mx.arange(length - positions, length, dtype=mx.int32)[None]
        args = (index, lengths, q_pos, k_pos, scale)
        cases.append(_Case(f"{n_kv} KV heads, {shapes.heads} heads D={d} S={length} positions={positions}",
                           lambda fn, q=q, args=args: fn(q, k_pool, v_pool, *args),
                           lambda q=q, args=args: reference_paged_attention(
                               q.astype(mx.float32), k_pool.astype(mx.float32), v_pool.astype(mx.float32), *args),
                           2 * shapes.heads * positions * length * d))
    return cases


#: name -> (cases builder, MLX's own operation, which widths: "qmm" or the others').
_KINDS = {
    "qmm": (_qmm_cases, reference_qmm, True),
    "quant_attention": (_attention_cases, reference_quant_attention, False),
    "paged_attention": (_paged_cases, reference_paged_attention, False),
    "rmm_qmm": (_rmm_cases, reference_rmm_qmm, False),
}


def _tolerance(dtype: str) -> float:
    if mx.default_device() == mx.cpu and cpu.int8_activations():
        return defaults.SELFCHECK_INT8_TOLERANCE
    return defaults.SELFCHECK_TOLERANCE.get(dtype, max(defaults.SELFCHECK_TOLERANCE.values()))


def _error(y: mx.array, oracle: mx.array) -> float:
    """max |y - oracle| / max |oracle| (inf where y is not finite or of another shape)."""
    if tuple(y.shape) != tuple(oracle.shape):
        return float("inf")
    diff = mx.abs(y.astype(mx.float32) - oracle)
    if not bool(mx.all(mx.isfinite(diff))):
        return float("inf")
    return float(mx.max(diff)) / max(float(mx.max(mx.abs(oracle))), 1e-30)


def _seconds(run: Callable[[], mx.array], repeats: int) -> float:
    """Median seconds of `repeats` evaluated runs after one untimed run."""
    mx.eval(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def _check_one(name: str, kernel: Optional[Kernel], shapes: ModelShapes, policy: str, device: str,
               qmm_widths: Sequence[int], widths: Sequence[int], time_budget_s: float, repeats: int) -> KernelCheck:
    """The check of one kernel (never raises: an error of the kernel, or of its cases, is its reason)."""
    build, mlx_op, is_qmm = _KINDS[name]
    tolerance = _tolerance(shapes.dtype)
    common = dict(name=name, label=KERNEL_LABELS[name], device=device, tolerance=tolerance)
    if kernel is None:
        return KernelCheck(**common, max_error=None, time_s=None, mlx_time_s=None, passed=False, faster=False,
                           used=False, reason="no custom kernel on this device: MLX's operations run")
    gpu = mx.default_device() == mx.gpu
    worst, worst_case, case = 0.0, "", None
    try:
        cases = sorted(build(shapes, qmm_widths if is_qmm else widths, gpu), key=lambda c: c.cost)
        if not cases:
            return KernelCheck(**common, max_error=None, time_s=None, mlx_time_s=None, passed=False, faster=False,
                               used=policy == "always", reason="the model has no shape this kernel takes here")
        for case in cases:
            err = _error(case.run(kernel), case.oracle())
            if not err <= worst:  # (inf and nan too)
                worst, worst_case = err, case.label
        timed, spent, k_time, m_time = 0, 0.0, 0.0, 0.0
        start = time.perf_counter()
        for case in cases:
            if spent >= time_budget_s:
                break
            k_time += _seconds(lambda: case.run(kernel), repeats)
            m_time += _seconds(lambda: case.run(mlx_op), repeats)
            timed += 1
            spent = time.perf_counter() - start
    except Exception as e:  # a kernel that does not build or run here: refused, one line
        where = f" ({case.label})" if case is not None else ""
        return KernelCheck(**common, max_error=None, time_s=None, mlx_time_s=None, passed=False, faster=False,
                           used=False, reason=f"refused: the kernel failed{where}: {_first_line(e)}")
    passed, faster = worst <= tolerance, k_time < m_time
    timing = f"{k_time * 1e3:.3g} ms against MLX's {m_time * 1e3:.3g} ms over {timed} of {len(cases)} cases"
    if not passed:
        used, reason = False, f"refused: max error {worst:.2e} above the tolerance {tolerance:.0e} ({worst_case})"
    elif not faster:
        used, reason = False, f"MLX's op is faster: {timing}"
    else:
        used, reason = True, f"correct and faster: {timing}"
    if policy == "always":
        found = reason if not used else f"correct and faster ({timing})"
        used, reason = True, f"the CPU backend always runs its kernels (tested in CI); this check: {found}"
    return KernelCheck(**common, max_error=worst, time_s=k_time, mlx_time_s=m_time, passed=passed, faster=faster,
                       used=used, reason=reason, cases=len(cases), timed=timed)


def _identity(fn: Kernel) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _from_cache(data: dict) -> Optional[List[KernelCheck]]:
    names = {f.name for f in fields(KernelCheck)}
    checks = data.get("checks")
    if data.get("version") != _VERSION or not isinstance(checks, list) or any(set(c) != names for c in checks):
        return None
    return [KernelCheck(**c) for c in checks]


def check_kernels(shapes: ModelShapes, kernels: Optional[Mapping[str, Kernel]] = None, policy: Optional[str] = None,
                  cache: bool = True, recheck: bool = False, say: Optional[Callable[[str], None]] = None,
                  qmm_widths: Sequence[int] = defaults.SELFCHECK_QMM_WIDTHS,
                  widths: Sequence[int] = defaults.SELFCHECK_WIDTHS,
                  time_budget_s: float = defaults.SELFCHECK_TIME_BUDGET_S,
                  repeats: int = defaults.SELFCHECK_REPEATS) -> List[KernelCheck]:
    """Check every kernel of switch.KERNEL_NAMES on this device at `shapes` (see the module docstring).

    Args:
        shapes: the model's shapes (model_shapes).
        kernels: name -> kernel to check (default: device_kernels(), this device's own); a name it lacks
            has no custom kernel (MLX's op runs).
        policy: "checked" (used only where passed and faster) or "always" (used wherever the kernel exists);
            default "always" on the CPU backend with its own kernels, else "checked".
        cache: read and keep the results under cache_dir()/CACHE_KIND; recheck: run again even when cached.
        say: called with one line before a check runs (not when its results are cached).
        qmm_widths: x's row counts for qmm; widths: query positions for attention and rows for RMM.
        time_budget_s: seconds of timing per kernel; repeats: timed runs per case.

    Returns:
        One KernelCheck per kernel name, in switch.KERNEL_NAMES' order.

    Raises:
        ValueError: an unknown policy or kernel name.
    """
    own = kernels is None
    backend, found = device_kernels() if own else ("injected", dict(kernels))
    unknown = set(found) - set(switch.KERNEL_NAMES)
    if unknown:
        raise ValueError(f"check_kernels: unknown kernel names {sorted(unknown)}; use {list(switch.KERNEL_NAMES)}")
    policy = policy or ("always" if own and backend.startswith("cpu-") else "checked")
    if policy not in POLICIES:
        raise ValueError(f"check_kernels: policy must be one of {POLICIES}, got {policy!r}")
    device = device_name()

    def run() -> dict:
        checks = [_check_one(name, found.get(name), shapes, policy, device, qmm_widths, widths, time_budget_s,
                             repeats) for name in switch.KERNEL_NAMES]
        return {"version": _VERSION, "checks": [asdict(c) for c in checks]}

    if not cache:
        return _from_cache(run())
    ident = json.dumps({"version": _VERSION, "device": device, "mlx": mx.__version__, "sources": sources_hash(),
                        "kernels": {n: _identity(f) for n, f in sorted(found.items())}, "policy": policy,
                        "shapes": asdict(shapes), "qmm_widths": list(qmm_widths), "widths": list(widths),
                        "context": defaults.SELFCHECK_CONTEXT, "tolerance": _tolerance(shapes.dtype)}, sort_keys=True)
    data = cached_json(CACHE_KIND, ident, run, valid=lambda d: not recheck and _from_cache(d) is not None, say=say,
                       message=f"checking mlx-infer's kernels on {device} against MLX's own operations",
                       stale="asked to check again")
    return _from_cache(data)


def checked_gpu_kernels(model: nn.Module, config: Mapping,
                        say: Optional[Callable[[str], None]] = None) -> List[KernelCheck]:
    """On Metal or CUDA: check this device's kernels at `model`'s shapes (cached once per device, MLX version,
    kernel sources and shapes), record the decisions (kernels/switch.py: quantized-KV attention and RMM run
    their kernel only where it was used) and, where the quantized matmul passed and was faster, swap
    `model`'s 4- / 8-bit quantized layers for the kernel layers (quantized.use_gpu_qmm), in place. Elsewhere
    (the CPU backend) nothing is checked or changed: returns [].

    Returns:
        The checks (empty off the GPU). Never raises for a kernel that fails: it is not used.
    """
    if mx.default_device() != mx.gpu or not (metal_available() or cuda_available()):
        return []
    results = check_kernels(model_shapes(model, config), say=say)
    switch.record({r.name: r.used for r in results})
    if switch.enabled("qmm"):
        use_gpu_qmm(model)
    return results
