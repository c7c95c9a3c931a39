"""The systems mlx-infer is timed against, on the same weights: mlx-lm's own generation on the MLX directory
the engine loaded (mlx_lm.load: MLX's own quantized matmul), and llama.cpp on the same GGUF through
llama-cpp-python or a `llama-bench` binary on PATH, when either is found."""

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from mlx_lm import batch_generate, load as mlx_lm_load, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from ..kv.quant_options import KV_GROUP_SIZES
from ..kv.session import probe_kv_layout
from .timing import time_tokens

try:  # optional peer: llama.cpp's Python binding
    import llama_cpp
except ImportError:  # not installed: the report says "llama.cpp: not found"
    llama_cpp = None

#: The largest KV group size mlx-lm quantizes with by default (generate_step's kv_group_size).
MLX_LM_KV_GROUP = 64


class MlxLmPeer:
    """mlx-lm's generation on an MLX directory (greedy: mlx-lm's default sampler is argmax).

    Args:
        mlx_dir: the directory mlx_lm.load opens (the engine's `source.mlx_dir`: a GGUF's cached conversion).
    """

    name = "mlx-lm"

    def __init__(self, mlx_dir: Path):
        self.model, self.tokenizer = mlx_lm_load(str(mlx_dir))
        self._kv_dims: Optional[Tuple[int, int]] = None

    def stream(self, ids: Sequence[int], max_tokens: int, kv_bits: Optional[int] = None,
               cache: Optional[list] = None) -> Iterator[int]:
        """Token ids of mlx_lm.stream_generate from `ids` (a fresh KV cache unless `cache` is given); with
        kv_bits its quantized KV cache from the first token (quantized_kv_start=0)."""
        extra = {}
        if kv_bits is not None:
            extra = {"kv_bits": kv_bits, "kv_group_size": self.kv_group_size(), "quantized_kv_start": 0}
        for r in stream_generate(self.model, self.tokenizer, list(ids), max_tokens=max_tokens,
                                 prompt_cache=cache, **extra):
            yield r.token

    def timed_kv(self, ids: Sequence[int], max_tokens: int, kv_bits: Optional[int]) -> dict:
        """`time_tokens` of a stream, plus "kv_bytes_per_token": the bytes of one token slot of its cache over
        all layers, K and V (scales and biases included; mlx-lm allocates slots 256 at a time)."""
        cache = make_prompt_cache(self.model)
        out = time_tokens(self.stream(ids, max_tokens, kv_bits, cache))
        out["kv_bytes_per_token"] = sum(c.nbytes / slots(c) for c in cache)
        return out

    def kv_group_size(self) -> Optional[int]:
        """The largest group size <= MLX_LM_KV_GROUP that divides the model's K and V head dims (None: none
        does, and mlx-lm cannot quantize this model's KV)."""
        if self._kv_dims is None:
            self._kv_dims = probe_kv_layout(self.model)[1:3]
        fits = [g for g in KV_GROUP_SIZES if g <= MLX_LM_KV_GROUP and all(d % g == 0 for d in self._kv_dims)]
        return max(fits) if fits else None

    def batch(self, prompts: List[List[int]], max_tokens: int, eos: Sequence[int]) -> List[List[int]]:
        """mlx_lm.batch_generate (its BatchGenerator) of the prompts together: the generated ids of each,
        EOS left out."""
        r = batch_generate(self.model, self.tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
        stop = set(eos)
        return [[int(t) for t in seq if int(t) not in stop] for seq in r.token_ids]


def slots(layer_cache) -> int:
    """Token slots allocated in one layer's mlx-lm cache (KVCache or QuantizedKVCache: [B, heads, slots, ...])."""
    keys = layer_cache.keys
    return max(1, (keys[0] if isinstance(keys, (tuple, list)) else keys).shape[2])


def llama_bench_path() -> Optional[str]:
    """The `llama-bench` binary on PATH, or None."""
    return shutil.which("llama-bench")


def llama_cpp_runner(gguf: Optional[Path], ids: Sequence[int], max_tokens: int) -> Tuple[Optional[Callable[[], dict]], str]:
    """(a runner timing llama.cpp's decoding of `ids` on the same GGUF, what it is) or (None, why not).

    llama-cpp-python first (the very token ids the other systems decode, a fresh context each run, as many
    threads as cores); else `llama-bench` (its own prompt of len(ids) tokens and `max_tokens` generated
    ones; its reported tokens/s, no TTFT). Without either: (None, "not found ...").
    """
    if gguf is None:
        return None, "not run: the model is not a GGUF file"
    if llama_cpp is not None:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(ids) + max_tokens + 8, n_threads=os.cpu_count(),
                              verbose=False)

        def run() -> dict:
            llm.reset()  # else it keeps the evaluated prompt and the next TTFT is no prefill
            return time_tokens(llm.create_completion(list(ids), max_tokens=max_tokens, temperature=0.0, stream=True))

        return run, f"llama-cpp-python {llama_cpp.__version__}"
    binary = llama_bench_path()
    if binary is not None:
        return (lambda: llama_bench(binary, gguf, len(ids), max_tokens)), f"llama-bench ({binary})"
    return None, "not found (pip install llama-cpp-python, or put llama-bench on PATH)"


def llama_bench(binary: str, gguf: Path, prompt_tokens: int, max_tokens: int) -> dict:
    """One `llama-bench` run (-r 1, JSON output): its prompt and generation rates as `time_tokens` keys
    (ttft_s from the prompt rate).

    Raises:
        RuntimeError: llama-bench failed or printed no results (its stderr's last line)."""
    cmd = [binary, "-m", str(gguf), "-p", str(prompt_tokens), "-n", str(max_tokens), "-r", "1",
           "-t", str(os.cpu_count()), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rows = json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else []
    if not rows:
        raise RuntimeError(f"llama-bench failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    pp = [r for r in rows if r.get("n_prompt", 0) > 0]
    tg = [r for r in rows if r.get("n_gen", 0) > 0]
    decode = float(tg[0]["avg_ts"]) if tg else 0.0
    ttft = prompt_tokens / float(pp[0]["avg_ts"]) if pp else float("nan")
    return {"ttft_s": ttft, "decode_tps": decode, "total_s": ttft + max_tokens / decode if decode else ttft,
            "tokens": max_tokens}

