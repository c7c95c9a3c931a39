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
    given = [i for i, m in enumerate(masks) if m is not None]
    if given:  # every constrained row unpacked in one call (a batch's rows together)
        words = np.stack([np.asarray(masks[i], dtype=np.int32) for i in given])  # [R, W]
        rows[given] = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].view(bool)
    return rows


def one_hot_mask(token: int, vocab: int) -> np.ndarray:
    """The bitmask (int32 [ceil(V / 32)], `unpack`'s layout) allowing `token` only: the row of a token the
    grammar forces (speculative drafts, batched decoding's forced tokens)."""
    words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    words[token // 32] = np.uint32(1) << np.uint32(token % 32)
    return words.view(np.int32)


def allows(mask: np.ndarray, token: int, vocab: int) -> bool:
    """Whether the bitmask (int32 [W]) allows `token` (a token outside [0, vocab) is refused)."""
    if not 0 <= token < vocab:
        return False
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def apply_masks(logits: mx.array, masks: Sequence[Optional[np.ndarray]]) -> mx.array:
    """logits [B, V] float with each row's refused tokens set to -inf (masks: one per row, see `unpack`);
    logits as they are when every mask is None. Lazy."""
    if all(m is None for m in masks):
        return logits
    allowed = mx.array(unpack(masks, logits.shape[-1]))
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
