"""Training losses of the block drafters.

DFlash (arXiv 2602.06036): slot k (1..B-1) of the block anchored at a predicts x_{a+k}; the loss is the
mean cross-entropy weighted by w_k = exp(-(k-1)/decay) (decay 7 for B=16, 5 for B=10, 4 for B=8): early
slots matter most, since a draft is accepted only up to its first miss.

DSpark (deepseek-ai/DeepSpec, the DSpark paper): all B slots predict (slot k predicts x_{a+k+1}), the
Markov head is teacher-forced (its previous token is the true x_{a+k}), and per slot
    0.1 * CE + 0.9 * L1(softmax(draft), softmax(target)) + BCE(confidence, 1 - 0.5 * L1)
weighted by exp(-k/4). 1 - 0.5 * L1 = sum_v min(p_v, q_v) is the probability that speculative sampling
accepts the slot's draft, what the confidence head estimates. The target's distribution is kept as its
top-K (features.py): L1 ~= sum_topK |q - p| + (1 - sum_topK q), exact when p has no mass outside the top K
(the error is at most the target's mass outside it).

All losses are float32 scalars (natural-log units: nats for CE, probability mass for L1).
"""

from typing import Callable, Dict, Tuple

import mlx.core as mx
import mlx.nn as nn

from .batches import Batch, gather_positions
from .forward import blocks_hidden

#: Published DFlash decays per block size.
_DECAYS = {16: 7.0, 10: 5.0, 8: 4.0}


def default_decay(block: int) -> float:
    """The DFlash loss decay for block size B (the published values; about B/2 - 1 otherwise, >= 1)."""
    return _DECAYS.get(int(block), max(1.0, block / 2.0 - 1.0))


def block_inputs(batch: Batch, mask_token_id: int, block: int) -> mx.array:
    """[S, A, B] int32 block input ids: [x_a] + [mask] * (B - 1)."""
    anchor_tok = gather_positions(batch.tokens, batch.anchors[:, :, None])  # [S, A, 1]
    masks = mx.full(anchor_tok.shape[:2] + (block - 1,), mask_token_id, dtype=mx.int32)
    return mx.concatenate([anchor_tok.astype(mx.int32), masks], axis=-1)


def _positions(batch: Batch, block: int, shift: int) -> mx.array:
    return batch.anchors[:, :, None] + shift + mx.arange(block)[None, None, :]


def dflash_loss(model, batch: Batch, embed: Callable, head: Callable, decay: float) -> Tuple[mx.array, Dict]:
    """Weighted cross-entropy of a DFlash drafter on a batch.

    Args:
        model: DFlashModel (trainable).
        batch: Batch (anchors valid for DFlash).
        embed: the target's frozen embedding, ids -> [..., H].
        head: the target's frozen lm_head, [..., H] -> [..., V].
        decay: w_k = exp(-(k - 1) / decay).

    Returns:
        (loss scalar, {"ce": per-slot mean CE [B-1], "hit": per-slot argmax == label rate [B-1]}) as arrays.
    """
    B = model.block_size
    emb = mx.stop_gradient(embed(block_inputs(batch, model.mask_token_id, B)))
    h = blocks_hidden(model, batch.feats, emb, batch.anchors)  # [S, A, B, H]
    logits = head(h[:, :, 1:]).astype(mx.float32)  # [S, A, B-1, V]
    labels = gather_positions(batch.tokens, _positions(batch, B - 1, 1))  # x_{a+1..a+B-1}
    ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    w = mx.exp(-mx.arange(B - 1, dtype=mx.float32) / decay)
    loss = (ce * w).sum() / (w.sum() * ce.shape[0] * ce.shape[1])
    hit = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
    return loss, {"ce": ce.mean(axis=(0, 1)), "hit": hit}


def dspark_outputs(model, batch: Batch):
    """The DSpark drafter's teacher-forced outputs on a batch.

    Returns:
        (logits [S, A, B, V] float32, confidence logits [S, A, B] float32 or None, labels [S, A, B] int32,
        h [S, A, B, H]).
    """
    B = model.block_size
    emb = mx.stop_gradient(model.embed_tokens(block_inputs(batch, model.mask_token_id, B)))
    h = blocks_hidden(model, batch.feats, emb, batch.anchors)
    prev = gather_positions(batch.tokens, _positions(batch, B, 0))  # x_a .. x_{a+B-1}
    labels = gather_positions(batch.tokens, _positions(batch, B, 1))  # x_{a+1} .. x_{a+B}
    e = model.markov_head.markov_w1(prev)  # [S, A, B, r]
    logits = model.lm_head(h).astype(mx.float32) + model.markov_head.markov_w2(e).astype(mx.float32)
    conf = None
    if model.has_confidence:
        x = mx.concatenate([h, e.astype(h.dtype)], axis=-1) if model.confidence_with_markov else h
        conf = model.confidence_head.proj(x)[..., 0].astype(mx.float32)
    return logits, conf, labels, h


def dspark_loss(model, batch: Batch, ce_weight: float = 0.1, l1_weight: float = 0.9,
                conf_weight: float = 1.0, decay: float = 4.0) -> Tuple[mx.array, Dict]:
    """The DSpark loss on a batch (batch.top_ids / top_probs required).

    Returns:
        (loss scalar, {"ce": [B], "l1": [B], "hit": [S, A, B] argmax == label}).
    """
    B = model.block_size
    logits, conf, labels, _ = dspark_outputs(model, batch)
    logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ce = -mx.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]
    where = _positions(batch, B, 0)
    p_ids = gather_positions(batch.top_ids, where)  # [S, A, B, K]
    p_top = gather_positions(batch.top_probs, where)
    q_top = mx.exp(mx.take_along_axis(logq, p_ids, axis=-1))
    l1 = mx.abs(q_top - p_top).sum(axis=-1) + mx.maximum(1.0 - q_top.sum(axis=-1), 0.0)
    per = ce_weight * ce + l1_weight * l1
    if conf is not None:
        accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        per = per + conf_weight * (nn.softplus(conf) - accept * conf)  # BCE with logits
    w = mx.exp(-mx.arange(B, dtype=mx.float32) / decay)
    loss = (per * w).sum() / (w.sum() * per.shape[0] * per.shape[1])
    hit = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32)
    return loss, {"ce": ce.mean(axis=(0, 1)), "l1": l1.mean(axis=(0, 1)), "hit": hit}


def accepted_lengths(hit: mx.array) -> mx.array:
    """[..., g] per-slot hits -> [...] number of leading hits (greedy accepted drafts of each block)."""
    return mx.cumprod(hit, axis=-1).sum(axis=-1)


__all__ = ["default_decay", "dflash_loss", "dspark_loss", "dspark_outputs", "accepted_lengths"]
