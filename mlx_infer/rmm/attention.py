"""RMM on the attention products (arXiv 2608.13426), applied by the attention hook (kv/attention_hook.py)
while a `reduced_products(qk, pv)` scope is open:

- QK^T over head_dim: each query row (per head, so per query head under GQA) keeps the ceil(qk * D)
  entries of largest |q|; the scores are then (q with the rest zeroed) . k, exactly the reduced product.
- PV over tokens: each row keeps the ceil(pv * n) keys of largest probability among its n visible keys;
  the others' probabilities are dropped and not renormalized (as the paper), then P V.

Both are computed with mx ops (the accuracy path: no kernel skips the dropped work yet, so they save no
time). Selection is per row, so a prompt gives the same result in one chunk or token by token.
"""

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Optional, Tuple

import mlx.core as mx

from .layers import index_mask

#: (qk, pv) of the open scope, None outside one.
_PRODUCTS: ContextVar[Optional[Tuple[float, float]]] = ContextVar("mlx_infer_rmm_products", default=None)

__all__ = ["active_products", "pv_attention", "reduce_queries", "reduced_products"]


@contextmanager
def reduced_products(qk: float = 1.0, pv: float = 1.0) -> Iterator[None]:
    """Within the scope, attention through the hook reduces QK^T to rho = qk and PV to rho = pv (a no-op
    scope when both are 1)."""
    token = _PRODUCTS.set((qk, pv)) if qk < 1.0 or pv < 1.0 else None
    try:
        yield
    finally:
        if token is not None:
            _PRODUCTS.reset(token)


def active_products() -> Optional[Tuple[float, float]]:
    """(qk, pv) of the open reduced_products scope, or None."""
    return _PRODUCTS.get()


def reduce_queries(queries: mx.array, qk: float) -> mx.array:
    """queries [B, n_q, L, D] with all but the ceil(qk * D) entries of largest |q| of each row zeroed."""
    keep = max(1, math.ceil(qk * queries.shape[-1] - 1e-9))
    return mx.where(index_mask(queries, keep), queries, mx.zeros_like(queries))


def _visible(mask, rows: int, keys: int) -> Optional[mx.array]:
    """The mask as bool [.., L, S] (True: visible), None when every key is visible; additive masks count
    -inf entries as hidden."""
    if mask is None:
        return None
    if isinstance(mask, str):  # "causal": row l sees keys s <= S - L + l
        return mx.arange(keys)[None, :] <= (keys - rows + mx.arange(rows))[:, None]
    return mask if mask.dtype == mx.bool_ else mask > -math.inf


def pv_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, pv: float) -> mx.array:
    """Attention with PV reduced over tokens: queries [B, n_q, L, D], keys [B, n_kv, S, D], values
    [B, n_kv, S, Dv], mask None / "causal" / bool or additive [.., L, S] -> [B, n_q, L, Dv] in queries'
    dtype (computed in float32)."""
    b, n_q, rows, d = queries.shape
    n_kv, n_keys = keys.shape[1], keys.shape[2]
    q = queries.astype(mx.float32).reshape(b, n_kv, n_q // n_kv, rows, d)  # [B, n_kv, rep, L, D]
    k = keys.astype(mx.float32)[:, :, None]  # [B, n_kv, 1, S, D]
    v = values.astype(mx.float32)[:, :, None]  # [B, n_kv, 1, S, Dv]
    scores = (q * scale) @ k.swapaxes(-1, -2)  # [B, n_kv, rep, L, S]
    visible = _visible(mask, rows, n_keys)
    if visible is not None:
        scores = mx.where(visible, scores, -math.inf)
        if mask is not None and not isinstance(mask, str) and mask.dtype != mx.bool_:
            scores = scores + mx.where(visible, mask.astype(mx.float32), 0.0)
    p = mx.softmax(scores, axis=-1, precise=True)
    count = visible.sum(axis=-1, keepdims=True) if visible is not None else mx.array(n_keys)  # [.., L, 1]
    keep = mx.maximum(1, mx.ceil(pv * count.astype(mx.float32) - 1e-6))
    ranks = mx.argsort(mx.argsort(-p, axis=-1), axis=-1)  # 0 for the most probable key
    p = mx.where(ranks < keep, p, 0.0)
    out = p @ v  # [B, n_kv, rep, L, Dv]
    return out.reshape(b, n_q, rows, values.shape[-1]).astype(queries.dtype)
