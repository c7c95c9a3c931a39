"""The one place mlx-infer reaches into mlx-lm's attention: model modules call
`scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)`, a name each imports
from mlx_lm.models.base. `install(model)` rebinds that name in the modules of the model's layers to
`attention`, which hands a QuantKVCache layer (or a PagedKVCache over quantized blocks) to the fused kernel
over its packed K/V, a batched step's
layer (BatchLayerCache) to the paged-attention kernel over the block pool, a causal prefill chunk (at least PREFILL_MIN_QUERIES queries,
on the CPU) to the tiled prefill attention of kernels/prefill_attention.py, and everything else (decode on
other float caches, masks or shapes the kernels do not take, attention sinks) to mlx-lm's own function,
unchanged.
Inside an RMM `reduced_products` scope (rmm/attention.py) it first reduces QK^T (the queries) and PV.
Models whose modules do not use the name still run on a quantized cache through the float K/V it returns.
"""

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

from ..kernels.prefill_attention import prefill_attention, prefill_fits
from ..rmm.attention import active_products, pv_attention, reduce_queries
from .batch import BatchLayerCache
from .cache import PagedKVCache
from .quant_cache import QuantKVCache


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's scaled_dot_product_attention, with the fused quantized-KV kernel for a QuantKVCache (and a
    PagedKVCache over quantized blocks), the paged-attention kernel for a BatchLayerCache (whose keys / values are then left uncomputed), and the
    tiled prefill attention for a causal chunk of at least PREFILL_MIN_QUERIES queries on the CPU.
    queries [B, n_q, L, D], keys / values [B, n_kv, S, D] -> [B, n_q, L, Dv]. In an RMM reduced_products
    scope, the queries are reduced over head_dim first (qk < 1), and PV runs reduced over tokens (pv < 1)."""
    products = active_products()
    if products is not None:
        qk, pv = products
        if qk < 1.0:
            queries = reduce_queries(queries, qk)
        if pv < 1.0 and sinks is None:
            return pv_attention(queries, keys, values, scale, mask, pv)
    if isinstance(cache, (QuantKVCache, BatchLayerCache, PagedKVCache)) and sinks is None:
        out = cache.fused_attention(queries, scale, mask)
        if out is not None:
            return out
    if sinks is None and prefill_fits(queries, keys, mask):
        return prefill_attention(queries, keys, values, scale)
    return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install(model: nn.Module) -> int:
    """Rebind scaled_dot_product_attention to `attention` in the mlx-lm modules of `model`'s layers (once
    per module; idempotent). Returns how many modules use it."""
    hooked = 0
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is mlx_lm_attention:
            module.scaled_dot_product_attention = attention
        hooked += getattr(module, "scaled_dot_product_attention", None) is attention
    return hooked
