"""The one place mlx-infer reaches into mlx-lm's attention: model modules call
`scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)`, a name each imports
from mlx_lm.models.base. `install(model)` rebinds that name in the modules of the model's layers to
`attention`, which hands
- a QuantKVCache layer, or a PagedKVCache layer, to its fused kernel (over the packed K/V, where prefill
  chunks run the tiled prefill attention over the dequantized rows; over the pool);
- another causal prefill chunk (at least PREFILL_MIN_QUERIES queries, on the CPU) to the tiled prefill
  attention of kernels/prefill_attention.py (where the products round x to int8, a chunk over mlx-lm's
  dense KVCache goes to the paged kernel as a decode step does, below: kernels/dense_attention.dense_fits);
- a batched step's layer (BatchLayerCache) to the paged-attention kernel over the block pool, and a
  compiled one-token step's (StepCache, generation/compiled.py) to it over its KVCache buffer or pool planes;
- a decode or verify step over mlx-lm's dense KVCache to the paged kernel reading the cache's buffer in
  place (kernels/dense_attention.py);
- everything else (other caches, masks or shapes the kernels do not take, attention sinks) to mlx-lm's own
  function, unchanged.
Inside an RMM `reduced_products` scope (rmm/attention.py) it first reduces QK^T (the queries) and PV.
Models whose modules do not use the name still run on a quantized cache through the float K/V it returns.
"""

import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.cache import KVCache

from ..kernels.dense_attention import dense_attention, dense_fits
from ..kernels.prefill_attention import prefill_attention, prefill_fits
from ..rmm.attention import active_products, pv_attention, reduce_queries
from .batch import BatchLayerCache
from .cache import PagedKVCache
from .quant_cache import QuantKVCache
from .step_cache import StepCache


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
    if isinstance(cache, (QuantKVCache, BatchLayerCache, PagedKVCache, StepCache)) and sinks is None:
        out = cache.fused_attention(queries, scale, mask)
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
