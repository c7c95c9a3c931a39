"""Training batches of blocks: random anchors among response positions, and the tensors that index them.

A block anchored at position a is [x_a] + [mask] * (B - 1) at positions a..a+B-1; its queries see the
context rows (target features) of positions < a and the rows of their own block, never another block.
DFlash slot k (1..B-1) predicts x_{a+k}, so a <= L - B; DSpark slot k (0..B-1) predicts x_{a+k+1}, so
a <= L - B - 1 (`all_slots`). Anchors start at the first response position (the first one the
speculative loop drafts from).
"""

import random
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx

from .features import SequenceFeatures


def anchor_range(f: SequenceFeatures, block: int, all_slots: bool) -> range:
    """Valid anchors of a sequence (possibly empty)."""
    last = f.length - block - (1 if all_slots else 0)
    return range(max(f.start, 0), last + 1)


def usable(features: Sequence[SequenceFeatures], block: int, all_slots: bool) -> List[SequenceFeatures]:
    """The sequences with at least one valid anchor (a response long enough for one block)."""
    return [f for f in features if len(anchor_range(f, block, all_slots))]


def sample_anchors(rng: random.Random, f: SequenceFeatures, n: int, block: int, all_slots: bool) -> List[int]:
    """n anchors of one sequence, sorted: without replacement when there are enough, else with.

    Raises:
        ValueError: the sequence has no valid anchor.
    """
    r = anchor_range(f, block, all_slots)
    if not len(r):
        raise ValueError("sequence too short for one block")
    picks = rng.sample(r, n) if len(r) >= n else [rng.choice(r) for _ in range(n)]
    return sorted(picks)


@dataclass
class Batch:
    """S sequences (padded to a common length Lp) with A anchors each.

    Attributes:
        feats: [S, Lp, n*H] float16 context features (padding rows zero; never visible: anchors < length).
        tokens: [S, Lp] int32 token ids (padding 0).
        anchors: [S, A] int32 anchor positions.
        top_ids, top_probs: [S, Lp, K] the target's top-k next-token distribution (None for DFlash).
    """

    feats: mx.array
    tokens: mx.array
    anchors: mx.array
    top_ids: Optional[mx.array] = None
    top_probs: Optional[mx.array] = None

    @property
    def blocks(self) -> int:
        return int(self.anchors.shape[0] * self.anchors.shape[1])


def _pad(a: mx.array, length: int) -> mx.array:
    extra = length - a.shape[0]
    if extra <= 0:
        return a[:length]
    return mx.concatenate([a, mx.zeros((extra,) + tuple(a.shape[1:]), a.dtype)], axis=0)


def make_batch(items: Sequence[SequenceFeatures], anchors: Sequence[Sequence[int]], block: int) -> Batch:
    """Stack sequences and their anchors (each list the same length A) into a Batch.

    Only the positions a block can reach are kept: Lp = max anchor + B + 1 (capped at the longest sequence).
    """
    reach = max(max(a) for a in anchors) + block + 1
    length = min(reach, max(f.length for f in items))
    feats = mx.stack([_pad(f.feats, length) for f in items])
    tokens = mx.stack([_pad(f.tokens, length) for f in items])
    top_ids = top_probs = None
    if items[0].top_ids is not None:
        top_ids = mx.stack([_pad(f.top_ids, length) for f in items])
        top_probs = mx.stack([_pad(f.top_probs, length) for f in items])
    return Batch(feats, tokens, mx.array(anchors, dtype=mx.int32), top_ids, top_probs)


def gather_positions(x: mx.array, positions: mx.array) -> mx.array:
    """x [S, L, ...] at positions [S, A, B] -> [S, A, B, ...] (positions must be < L)."""
    S, A, B = positions.shape
    flat = positions.reshape(S, A * B)
    if x.ndim == 2:
        return mx.take_along_axis(x, flat, axis=1).reshape(S, A, B)
    idx = flat.reshape(S, A * B, *([1] * (x.ndim - 2)))
    idx = mx.broadcast_to(idx, (S, A * B) + tuple(x.shape[2:]))
    return mx.take_along_axis(x, idx, axis=1).reshape(S, A, B, *x.shape[2:])
