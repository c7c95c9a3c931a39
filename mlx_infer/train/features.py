"""Target features for training: ONE teacher-forced target forward per sequence, capturing the taps of
every position (capture.TargetTaps) and, for DSpark, the target's next-token distribution (top-k).

The tap convention is the drafters' (Hugging Face): tap i is the output of decoder layer i. Row j of the
features is the target's state after reading tokens[0..j]; a block anchored at position a sees rows < a.
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..speculative.capture import TargetTaps
from .data import TrainSequence

#: Features are kept in float16 between the target pass and training (half the memory of float32).
FEATURE_DTYPE = mx.float16


@dataclass
class SequenceFeatures:
    """What training needs of one sequence.

    Attributes:
        tokens: [L] int32 token ids.
        start: first response position.
        feats: [L, n*H] float16, the taps concatenated along features.
        top_ids: [L, K] int32, the target's K most likely next tokens at each position (None unless asked).
        top_probs: [L, K] float32, their probabilities (softmax over the full vocabulary).
    """

    tokens: mx.array
    start: int
    feats: mx.array
    top_ids: Optional[mx.array] = None
    top_probs: Optional[mx.array] = None

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def sequence_features(target: nn.Module, layer_ids: Sequence[int], seq: TrainSequence,
                      top_k: int = 0) -> SequenceFeatures:
    """One teacher-forced forward of `target` over seq.tokens (no KV cache).

    Args:
        target: the target mlx-lm model.
        layer_ids: tapped decoder layers (the drafter's target_layer_ids).
        seq: the sequence.
        top_k: keep the target's top-k next-token probabilities per position (0: skip; DSpark's L1 term).

    Raises:
        MlxInferError: a tap index outside the target's layers.
    """
    ids = mx.array(seq.tokens, dtype=mx.int32)
    with TargetTaps(target, layer_ids) as taps:
        logits = target(ids[None])
        feats = taps.features()[0].astype(FEATURE_DTYPE)
    top_ids = top_probs = None
    if top_k:
        logits = logits[0].astype(mx.float32)
        k = min(int(top_k), int(logits.shape[-1]))
        top_ids = mx.argpartition(-logits, k - 1, axis=-1)[:, :k].astype(mx.int32)
        logz = mx.logsumexp(logits, axis=-1, keepdims=True)
        top_probs = mx.exp(mx.take_along_axis(logits, top_ids, axis=-1) - logz)
        mx.eval(feats, top_ids, top_probs)
    else:
        mx.eval(feats)
    return SequenceFeatures(ids, seq.start, feats, top_ids, top_probs)


def all_features(target: nn.Module, layer_ids: Sequence[int], sequences: Sequence[TrainSequence],
                 top_k: int = 0, progress: Optional[Callable[[int, int], None]] = None) -> List[SequenceFeatures]:
    """`sequence_features` for each sequence; progress(done, total) after each."""
    out = []
    for i, s in enumerate(sequences):
        out.append(sequence_features(target, layer_ids, s, top_k))
        if progress:
            progress(i + 1, len(sequences))
    return out
