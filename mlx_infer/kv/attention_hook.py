"""Where attention reaches the KV cache: `install(model)` swaps the model's attention blocks for mlx-infer's own
layers (kv/attention_layer.py: CacheAttention, kernels/rope.KernelRoPEAttention; at load, and by the Engine,
the BatchScheduler and the draft-model drafter for a model handed in), which call `attention(queries, keys,
values, cache=..., scale=..., mask=...)`: mlx-lm's `scaled_dot_product_attention` on the kernels where they
apply. Nothing in mlx-lm's modules is rebound: another model of theirs in the process attends as mlx-lm
wrote it. `attention` hands
- a cache that attends itself (an AttendingCache: a quantized cache, a paged one, a batched step's layer,
  a compiled one-token step's StepCache) to its `fused_attention` (the fused kernel over the packed K/V or
  the pool, where prefill chunks over a quantized cache run the tiled prefill attention over the dequantized
  rows; a batched or compiled step's over the block pool or its KVCache buffer), unless it answers None;
- another causal prefill chunk (at least PREFILL_MIN_QUERIES queries, on the CPU) to the tiled prefill
  attention of kernels/prefill_attention.py (where the products round x to int8, a chunk over mlx-lm's
  dense KVCache goes to the paged kernel as a decode step does, below: kernels/dense_attention.dense_fits);
- a decode or verify step over mlx-lm's dense KVCache to the paged kernel reading the cache's buffer in
  place (kernels/dense_attention.py);
- everything else (other caches, masks or shapes the kernels do not take, attention sinks) to mlx-lm's own
  function, unchanged.
Inside an RMM `reduced_products` scope (rmm/attention.py) it first reduces QK^T (the queries) and PV.
Models whose attention is not one of the project's layers still run on a quantized cache through the float
K/V it returns.
"""

from typing import Callable, Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.cache import KVCache

from ..kernels.dense_attention import dense_attention, dense_fits
from ..kernels.prefill_attention import prefill_attention, prefill_fits
from ..rmm.attention import active_products, pv_attention, reduce_queries
from .attention_layer import use_attention

__all__ = ["AttendingCache", "attention", "fused_attention_of", "install", "mlx_lm_attention"]


class AttendingCache(Protocol):
    """A KV cache that runs attention over what it holds itself (kv/quant_cache.QuantKVCache,
    kv/cache.PagedKVCache, kv/batch.BatchLayerCache, kv/step_cache.StepCache): declared by having the method,
    which `fused_attention_of` looks up (a runtime isinstance check against a Protocol inspects its members on
    every call, and `attention` asks once per layer per forward)."""

    def fused_attention(self, queries: mx.array, scale: float, mask) -> Optional[mx.array]:
        """Attention of queries [B, n_q, L, D] over the cache's keys and values after this forward's update
        (`mask` as mlx-lm passes it: None, "causal" or an array): [B, n_q, L, Dv] in the queries' dtype, or
        None where it does not apply (the caller then attends over the K/V update_and_fetch returned)."""


def fused_attention_of(cache) -> Optional[Callable]:
    """`cache.fused_attention` when `cache` is an AttendingCache, else None (mlx-lm's caches, no cache)."""
    return getattr(cache, "fused_attention", None)


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's scaled_dot_product_attention, on the kernels where they apply (see the module docstring).
    queries [B, n_q, L, D], keys / values [B, n_kv, S, D] -> [B, n_q, L, Dv]. In an RMM reduced_products
    scope, the queries are reduced over head_dim first (qk < 1), and PV runs reduced over tokens (pv < 1)."""
    products = active_products()
    if products is not None:
        qk, pv = products
        if qk < 1.0:
            queries = reduce_queries(queries, qk)
        if pv < 1.0 and sinks is None:
            return pv_attention(queries, keys, values, scale, mask, pv)
    fused = fused_attention_of(cache) if sinks is None else None
    if fused is not None:
        out = fused(queries, scale, mask)
        if out is not None:
            return out
    if type(cache) is KVCache and sinks is None and _dense_decode(queries, keys, values, cache, mask):
        return dense_attention(queries, cache.keys, cache.values, cache.offset, scale)
    if sinks is None and prefill_fits(queries, keys, mask):
        return prefill_attention(queries, keys, values, scale)
    return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _dense_decode(queries: mx.array, keys: mx.array, values: mx.array, cache: KVCache, mask) -> bool:
    """Whether a decode / verify step over mlx-lm's dense KVCache runs on dense_attention: the keys are its
    buffer's first `offset` tokens (what update_and_fetch returned), the mask None (one query) or "causal",
    and the kernel takes the shapes."""
    L = queries.shape[2]
    causal = (mask is None and L == 1) or (isinstance(mask, str) and mask == "causal")
    return (causal and isinstance(cache.keys, mx.array) and keys.shape[2] == cache.offset
            and dense_fits(L, keys.shape[3], values.shape[3]))


def install(model: nn.Module) -> int:
    """Swap `model`'s attention blocks (mlx-lm's llama / qwen2 / qwen3 / gemma3 ones, and the kernel twins) for
    mlx-infer's layers calling `attention`, in place (kv/attention_layer.use_attention; idempotent).
    Returns how many blocks call it (0: a model of other classes, left as it is)."""
    return use_attention(model, attention)
