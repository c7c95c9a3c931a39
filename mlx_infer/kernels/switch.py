"""Which GPU kernels this process may run: the decisions of the kernel self-check (kernels/selfcheck.py),
recorded once per device when a model loads on Metal or CUDA.

A custom GPU kernel runs only where its check, on this device and MLX version, found it correct and faster
than MLX's own operation; until a check has been recorded every GPU kernel is off (MLX's operations run).
The CPU backend does not consult this: its kernels always run there (tested against the reference in CI).

Kernel names: "qmm" (the quantized skinny matmul), "quant_attention" (attention over a quantized KV cache),
"paged_attention" (over the paged KV pool) and "rmm_qmm" (RMM's gathered product).
"""

from typing import Dict, Mapping

__all__ = ["KERNEL_NAMES", "decisions", "enabled", "record", "reset"]

#: The kernels the self-check decides on.
KERNEL_NAMES = ("qmm", "quant_attention", "paged_attention", "rmm_qmm")

_enabled: Dict[str, bool] = {}


def record(decided: Mapping[str, bool]) -> None:
    """Record the self-check's decisions: name -> whether its custom kernel runs on this device (names
    not given keep their decision; a kernel never recorded stays off)."""
    _enabled.update({name: bool(on) for name, on in decided.items()})


def enabled(name: str) -> bool:
    """Whether the custom GPU kernel `name` passed its check here (False until a check is recorded)."""
    return _enabled.get(name, False)


def decisions() -> Dict[str, bool]:
    """A copy of the decisions recorded in this process."""
    return dict(_enabled)


def reset() -> None:
    """Forget every decision (every GPU kernel off again)."""
    _enabled.clear()
