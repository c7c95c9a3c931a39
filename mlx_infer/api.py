"""`mlx_infer.load`: a model in, an Engine out (the package's __init__ names it; see there)."""

import inspect
from typing import Any, Callable, Optional, Union

from .engine import Engine
from .errors import MlxInferError
from .loading import load_model
from .rmm.apply import reduce_model
from .rmm.options import Retention, parse_rmm


def load(model: Optional[str] = None, *, weights: str = "auto",
         progress: Optional[Callable[[int, int, str], None]] = None, kv_cache: str = "dense",
         kv_budget: Union[None, int, float, str] = None, block_size: int = 16,
         rmm: Union[None, str, Retention] = None, **kv_quant: Any) -> Engine:
    """Load a model and return an Engine.

    Args:
        model: a .gguf file, an MLX / Hugging Face model directory, a Hugging Face repo id
            ('org/name'), or None for the embedded default (SmolLM2-135M-Instruct Q4_1).
        weights: "auto" (quantized weights on the CPU kernels when available, else float32 on the CPU backend with an optimized BLAS, else as stored),
            "native" (as stored) or "float32".
        progress: callable(done, total, description) for download / conversion progress.
        kv_cache, kv_budget, block_size: the KV cache ("dense", default, or "paged"), its budget and block
            size (see Engine.configure_kv).
        rmm: reduced matrix multiplication (arXiv 2608.13426; lossy): retention ratios per component,
            e.g. "attn=0.5,mlp=0.9,qk=0.75" or a preset (see mlx_infer.rmm.options), or a parsed Retention;
            None: exact. The stats report it in its canonical form (str(Retention)).
        kv_quant: kv_bits, kv_scheme, kv_quant_start, kv_group_size, kv_residual, kv_rotate: quantized KV (see Engine.configure_kv).

    Raises:
        MlxInferError: a missing model, unreachable repo, corrupt or unsupported GGUF, a bad rmm (not a
            string, a bad item, or a layer range that selects none of the model's layers), an option
            load() does not take.
    """
    known = set(inspect.signature(Engine.configure_kv).parameters) - {"self", "kv_cache", "kv_budget", "block_size"}
    unknown = sorted(set(kv_quant) - known)
    if unknown:  # checked before any model work, as rmm
        raise MlxInferError(f"load() got an unknown option {unknown[0]!r}; it takes model, weights, progress, "
                            f"kv_cache, kv_budget, block_size, rmm, {', '.join(sorted(known))} (sampling, "
                            "speculative and eviction options go to engine.generate)")
    retention = parse_rmm(rmm)  # checked before any model work
    net, tokenizer, config, source = load_model(model, weights=weights, progress=progress)
    if retention is not None:
        reduce_model(net, retention)
        source.rmm = str(retention)
    return Engine(net, tokenizer, config, source, kv_cache=kv_cache, kv_budget=kv_budget, block_size=block_size,
                  rmm=retention, **kv_quant)
