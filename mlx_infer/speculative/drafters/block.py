"""What DFlash and DSpark drafters share: the drafter-side context of target features (only committed
positions), the block forward, fitting a checkpoint to a target, and drawing draft tokens.

Context contract with the loop (see loop.py): before `propose(context, gamma)` the drafter has received the
target taps of exactly the positions 0..len(context)-2 (every committed token but the pending one, the
anchor): the prompt head in `begin(..., hidden=)`, then after each round the anchor and the accepted drafts
(n + 1 rows) in `update(..., hidden=)`.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ...errors import MlxInferError
from .. import target as target_parts
from ..verify import probabilities, process_logits
from .backbone import Backbone
from .base import Drafter


def check_fits(what: str, target: nn.Module, hidden: int, vocab: int, num_target_layers: int,
               layer_ids: Sequence[int], mask_token_id: int) -> None:
    """Raise MlxInferError unless a drafter with these sizes fits the target model.

    Args:
        what: the drafter, for the message ("DFlash drafter /path").
        target: the target mlx-lm model.
        hidden: the drafter's hidden size (must equal the target's H).
        vocab: the drafter's vocab_size (must equal the target's embedding rows).
        num_target_layers: the target layer count the drafter was trained on.
        layer_ids: tapped target layers (each < the target's layer count).
        mask_token_id: the block filler token (< vocab).
    """
    t_layers, t_hidden, t_vocab = target_parts.dims(target)
    problems = []
    if hidden != t_hidden:
        problems.append(f"hidden size {hidden} (target: {t_hidden})")
    if vocab != t_vocab:
        problems.append(f"vocabulary {vocab} (target: {t_vocab})")
    if num_target_layers != t_layers:
        problems.append(f"num_target_layers {num_target_layers} (target: {t_layers} layers)")
    if any(not 0 <= i < t_layers for i in layer_ids):
        problems.append(f"target_layer_ids {list(layer_ids)} (target: {t_layers} layers)")
    if not 0 <= mask_token_id < t_vocab:
        problems.append(f"mask_token_id {mask_token_id} (target vocabulary: {t_vocab})")
    if problems:
        raise MlxInferError(f"{what} does not fit this target: {'; '.join(problems)}; use the drafter made for this model")


class BlockDrafter(Drafter):
    """Base of the block drafters.

    Args:
        model: the Backbone (with `block_size`, `mask_token_id`, `target_layer_ids` attributes).
        embed: token ids [B] -> [B, H] embeddings of the block inputs.
        head: [g, H] -> [g, V] logits.
    """

    wants_hidden = True

    def __init__(self, model: Backbone, embed: Callable, head: Callable):
        self.model = model
        self.embed, self.head = embed, head
        self.block_size = int(model.block_size)
        self.mask_token_id = int(model.mask_token_id)
        self.target_layer_ids = list(model.target_layer_ids)
        self.act_dtype = embed(mx.array([0])).dtype  # what the head expects
        if self.act_dtype == mx.float32 and model.fc.weight.dtype != mx.float32:
            # a half-precision drafter next to a float32 target (the CPU fast path, where half-precision
            # matmuls do not go through the optimized BLAS): run it in float32 too (cast in place)
            model.set_dtype(mx.float32)
        self.params = None
        self.cache = model.make_cache()
        self.pending: List[mx.array] = []  # [1, C, n*H] feature rows not yet in the cache

    def begin(self, prompt_ids: Sequence[int], params, hidden: Optional[mx.array] = None) -> None:
        """hidden: [1, len(prompt_ids) - 1, n*H] taps of the prompt head (None for a one-token prompt)."""
        self.params = params
        self.cache = self.model.make_cache()
        self.pending = [] if hidden is None else [hidden]

    def update(self, n_accepted: int, committed: Sequence[int], hidden: Optional[mx.array] = None) -> None:
        """hidden: [1, n_accepted + 1, n*H] taps of the anchor and the accepted drafts."""
        if hidden is None:
            raise RuntimeError(f"{self.name} drafter needs the target's hidden states (drafter.wants_hidden)")
        self.pending.append(hidden)

    def block_hidden(self, context: Sequence[int]) -> mx.array:
        """[B, H] normed hidden states of the block [anchor] + [mask] * (B - 1), anchor = context[-1] at
        position len(context) - 1; consumes the pending context rows into the cache."""
        rows = sum(int(p.shape[1]) for p in self.pending)
        if self.cache[0].offset + rows != len(context) - 1:
            raise RuntimeError(
                f"drafter context has {self.cache[0].offset + rows} rows, expected {len(context) - 1}"
            )
        feats = None
        if self.pending:
            feats = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=1)
        self.pending = []
        ids = mx.array([int(context[-1])] + [self.mask_token_id] * (self.block_size - 1), dtype=mx.uint32)
        return self.model.hidden(self.embed(ids)[None], feats, self.cache)[0]

    def logits(self, h: mx.array) -> mx.array:
        """[g, H] -> [g, V] float32 logits through the head."""
        return self.head(h.astype(self.act_dtype)).astype(mx.float32)

    def choose(self, logits: mx.array) -> Tuple[mx.array, Optional[mx.array]]:
        """Draw one token per row of [g, V] logits: argmax when greedy (q None), else a sample from the
        processed distribution (temperature, top-p, min-p, top-k as the target) with q = [g, V] its
        probabilities. Returns ([g] uint32 tokens, q)."""
        if self.params is None or self.params.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.uint32), None
        scaled = process_logits(logits, (), (), self.params)
        return mx.random.categorical(scaled).astype(mx.uint32), probabilities(scaled)
