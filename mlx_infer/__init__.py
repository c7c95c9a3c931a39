"""mlx-infer: an MLX-native local LLM runtime.

    import mlx_infer
    engine = mlx_infer.load()            # the embedded default model (SmolLM2-135M-Instruct Q4_1)
    print(engine.generate("What is the capital of France?").text)

Importing the package is light: it loads the optimized BLAS (before anything imports MLX) and names the
public API. Each public name's module, and with it MLX, mlx-lm and transformers (seconds of imports), is
imported when the name is first used (PEP 562's module __getattr__), so that `import mlx_infer.cli...`,
`mlx-infer --help` and a bad flag answer at once. This is the library's one deferred import: every module
below imports at its top (tests/test_structure.py).
"""

from .blas import preload_optimized_blas

# Before mlx.core is imported anywhere: MLX's CPU backend then uses an optimized BLAS.
preload_optimized_blas()

import importlib  # noqa: E402
from typing import TYPE_CHECKING, Any, List  # noqa: E402

from .errors import (DiskWriteError, DistributedError, EngineBusyError, GenerationError,  # noqa: E402
                     InvalidGGUFError, MlxInferError, ModelNotFoundError, RequestError, RunnerClosedError, UnsupportedModelError)
from .rmm.options import Retention  # noqa: E402

if TYPE_CHECKING:  # the lazily named ones, for type checkers and readers
    from .api import load
    from .batch import BatchRunner, RequestHandle
    from .engine import Engine, GenerationResult, GenerationStats, GenerationStep
    from .generation.sampling import SamplingParams
    from .kv.errors import KVBudgetError

__version__ = "0.1.0"
#: The public API (docs/api.md; tests/test_public_api.py holds every name here to a docstring and to the docs).
__all__ = [
    "load", "Engine", "SamplingParams", "GenerationResult", "GenerationStats", "GenerationStep",
    "BatchRunner", "RequestHandle", "Retention",
    "MlxInferError", "ModelNotFoundError", "UnsupportedModelError", "InvalidGGUFError", "KVBudgetError",
    "RequestError", "RunnerClosedError", "GenerationError", "EngineBusyError", "DiskWriteError", "DistributedError",
    "__version__",
]

#: The module of each public name imported on first use (those whose modules import MLX).
LAZY = {
    "load": ".api", "Engine": ".engine", "GenerationResult": ".engine", "GenerationStats": ".engine",
    "GenerationStep": ".engine", "SamplingParams": ".generation.sampling", "BatchRunner": ".batch",
    "RequestHandle": ".batch", "KVBudgetError": ".kv.errors",
}


def __getattr__(name: str) -> Any:
    """A public name of LAZY, its module imported on first use (then kept as a plain attribute).

    Raises:
        AttributeError: `name` is not a public name of the package (nor a submodule imported so far).
    """
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(LAZY))
