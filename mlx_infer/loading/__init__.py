"""Where models come from: GGUF files, MLX / HF directories, HF repo ids, the embedded default."""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from ..backend import backend_name, prefer_float_weights
from ..errors import MlxInferError, ModelNotFoundError
from ..kernels import cpu as cpu_kernels
from ..kernels.linear import supports, use_kernels
from ..kernels.qmm import qmm_backend
from ..kernels.selfcheck import checked_gpu_kernels
from ..kv.attention_hook import install as install_attention
from . import default, gguf, hub

WEIGHTS_MODES = ("auto", "native", "float32")


@dataclass
class ModelSource:
    """Where a loaded model came from.

    Attributes:
        name: what the user asked for ("default" when nothing).
        kind: "gguf", "mlx-dir", "hf-repo" or "default".
        path: the file or directory read.
        mlx_dir: the MLX directory mlx-lm loaded (the GGUF's cached conversion for GGUF files).
        weights: "native" (as stored, quantized when the file is) or "float32" (CPU fast path).
        kernels: the backend of mlx-infer's quantized matmul kernel the quantized layers run on
            (kernels.qmm.qmm_backend(), e.g. "cpu-avx512"), or None: MLX's own quantized matmul, or no
            quantized layers.
        rmm: the RMM retention the model's linear layers were reduced with (`--rmm`), in its canonical form
            (str(Retention)); None: exact.
    """

    name: str
    kind: str
    path: Path
    mlx_dir: Path
    weights: str = "native"
    kernels: Optional[str] = None
    rmm: Optional[str] = None


def resolve(model: Optional[str], progress: Optional[Callable] = None) -> ModelSource:
    """Find the MLX directory for a model spec, converting or downloading as needed.

    Args:
        model: a .gguf path, an MLX / HF directory, a HF repo id ('org/name'), or None for the default.
        progress: callable(done, total, desc) for conversion and download progress.

    Raises:
        ModelNotFoundError, InvalidGGUFError, UnsupportedModelError.
    """
    say = (lambda msg: progress(0, 0, msg)) if progress else None
    if model is None or model == "default":
        path = default.default_model_path(say)
        return ModelSource("default", "default", path, gguf.cached_conversion(path, progress))
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" or path.is_file():
        return ModelSource(model, "gguf", path, gguf.cached_conversion(path, progress))
    if path.exists():
        return ModelSource(model, "mlx-dir", path, hub.local_model_dir(path))
    if hub.looks_like_repo_id(model):
        mlx_dir = hub.download_repo(model)
        return ModelSource(model, "hf-repo", mlx_dir, mlx_dir)
    raise ModelNotFoundError(
        f"no model at {model!r}; give a .gguf file, an MLX model directory or a Hugging Face repo id (org/name)"
    )


def to_float32(model: nn.Module) -> nn.Module:
    """Dequantize every quantized layer and cast all weights to float32 (in place)."""
    model = dequantize_model(model)
    model.update(
        nn.utils.tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a, model.parameters())
    )
    mx.eval(model.parameters())
    return model


def load_model(
    model: Optional[str] = None, weights: str = "auto", progress: Optional[Callable] = None,
    prepare: Optional[Callable[[nn.Module, dict, "ModelSource"], None]] = None,
) -> Tuple[nn.Module, object, dict, ModelSource]:
    """Load a model and its tokenizer.

    Args:
        model: see `resolve`.
        weights: "native" keeps the stored (often quantized) weights; "float32" dequantizes them;
            "auto" keeps them on the CPU backend when mlx-infer's CPU kernels are available (they run the
            quantized layers), else picks float32 on the CPU backend with an optimized BLAS when memory
            allows. Native quantized layers run on the CPU kernels whenever they are available
            (`MLX_INFER_KERNELS=off` turns them off).
        progress: see `resolve`.
        prepare: called with (model, config, source) on the lazily loaded mlx-lm model, before its weights are
            evaluated and its layers swapped for the kernels' (distributed/: a rank's shard of the model).

    Returns:
        (model, tokenizer (mlx-lm TokenizerWrapper), config dict, ModelSource).

    Raises:
        MlxInferError and subclasses for bad input.
    """
    if weights not in WEIGHTS_MODES:
        raise MlxInferError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}")
    source = resolve(model, progress)
    try:
        net, tokenizer, config = mlx_lm_load(str(source.mlx_dir), return_config=True, lazy=prepare is not None)
    except ValueError as e:
        if "not supported" in str(e).lower():
            raise MlxInferError(f"{source.name}: {e}") from e
        raise
    if prepare is not None:
        prepare(net, config, source)
        mx.eval(net.parameters())
    quantized = any(supports(m) for _, m in net.named_modules())
    cpu_here = backend_name() == "cpu" and cpu_kernels.available()
    kernels = quantized and weights != "float32" and cpu_here
    if weights == "auto":
        weights = "float32" if not kernels and prefer_float_weights(_float_bytes(net)) else "native"
    if weights == "float32":
        net = to_float32(net)
    if cpu_here:
        use_kernels(net)  # the quantized layers (native weights), RMSNorm and RoPE
    else:  # Metal / CUDA: the custom kernels that passed their check on this device (cached), else MLX's ops
        checked_gpu_kernels(net, config, (lambda msg: progress(0, 0, msg)) if progress else None)
    install_attention(net)  # attention through mlx-infer's layers (kv/attention_hook.py): kernels, quantized KV
    if kernels:
        source.kernels = qmm_backend()
    source.weights = weights
    return net, tokenizer, config, source


def _float_bytes(net: nn.Module) -> int:
    """Bytes the model's weights would take as float32 (quantized weights counted unpacked)."""
    total = 0
    for _, module in net.named_modules():
        for key, a in module.parameters().items():
            if not isinstance(a, mx.array) or key in ("scales", "biases"):
                continue
            bits = getattr(module, "bits", None) if key == "weight" else None
            total += 4 * (a.size * 32 // bits if bits else a.size)
    return total
