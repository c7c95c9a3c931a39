"""Allowed-token bitmasks applied to logits on the device: refused tokens get -inf, so that greedy, sampling
and speculative verification all pick among the allowed ones only. Pure MLX (llguidance.mlx's kernel is
Metal-only)."""

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np


def unpack(masks: Sequence[Optional[np.ndarray]], vocab: int) -> np.ndarray:
    """Bitmasks -> bool [B, V]: row i from masks[i] (int32 [W], bit t of word t // 32 = token t allowed), every
    token allowed where masks[i] is None (an unconstrained row)."""
    rows = np.ones((len(masks), vocab), dtype=bool)
    for i, m in enumerate(masks):
        if m is not None:
            rows[i] = np.unpackbits(np.ascontiguousarray(m).view(np.uint8), bitorder="little")[:vocab].astype(bool)
    return rows


def apply_masks(logits: mx.array, masks: Sequence[Optional[np.ndarray]]) -> mx.array:
    """logits [B, V] float with each row's refused tokens set to -inf (masks: one per row, see `unpack`);
    logits as they are when every mask is None. Lazy."""
    if all(m is None for m in masks):
        return logits
    allowed = mx.array(unpack(masks, logits.shape[-1]))
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
