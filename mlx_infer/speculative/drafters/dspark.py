"""DSpark block drafter (DeepSeek DeepSpec, the DSpark paper in that repo): the DFlash backbone with
anchor-as-first-prediction (all B slots predict: slot k's token follows slot k-1's, B inputs -> B drafts),
a low-rank Markov head and a confidence head, and confidence-scheduled verification.

    logits_k = lm_head(h_k) + W2(W1[x_{k-1}])          x_0 = anchor, W1: Embedding(V, r), W2: Linear(r, V)
    c_k      = sigmoid(w^T [h_k ; W1[x_{k-1}]] + b)    (or w^T h_k + b without `confidence_head_with_markov`)

Drafts are drawn left to right (argmax when greedy; sampled otherwise, with q = the processed distribution
each token was drawn from). The number verified comes from a ConfidenceSchedule (confidence.py).

Checkpoint format: config.json = a copy of the target's config plus flat keys (`architectures:
["Qwen3DSparkModel"]`, num_target_layers, num_hidden_layers, block_size, mask_token_id, target_layer_ids,
enable_confidence_head, confidence_head_with_markov, markov_rank, markov_head_type "vanilla",
tie_word_embeddings false, layer_types); tensors = DFlash's + embed_tokens.weight, lm_head.weight (copies of
the target's), markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [V, r],
confidence_head.proj.weight [1, H (+ r)], confidence_head.proj.bias [1].
"""

from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ...errors import MlxInferError
from ..capture import default_layer_ids
from ..confidence import ConfidenceSchedule
from .backbone import Backbone, BackboneConfig, backbone_config, backbone_keys
from .base import Draft, Worth
from .block import BlockDrafter, check_fits
from .checkpoint import load_strict, read_checkpoint, require, resolve_dir, write_checkpoint

ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel")


class MarkovHead(nn.Module):
    """Rank-r bigram correction: W1 = Embedding(V, r), W2 = Linear(r, V, no bias)."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)


class ConfidenceHead(nn.Module):
    """proj: Linear(in_dims -> 1) with bias; sigmoid applied by the caller."""

    def __init__(self, in_dims: int):
        super().__init__()
        self.proj = nn.Linear(in_dims, 1)


class DSparkModel(Backbone):
    """The DSpark network.

    Args:
        cfg: BackboneConfig.
        block_size: B (B inputs, B drafts).
        mask_token_id, target_layer_ids, num_target_layers, vocab_size: as DFlashModel.
        markov_rank: r.
        confidence: whether the confidence head exists; confidence_with_markov: its input is [h ; W1[prev]].
        base_config: the target config copied into config.json on save (optional).
    """

    def __init__(self, cfg: BackboneConfig, block_size: int, mask_token_id: int, target_layer_ids: Sequence[int],
                 num_target_layers: int, vocab_size: int, markov_rank: int = 256, confidence: bool = True,
                 confidence_with_markov: bool = True, base_config: Optional[dict] = None):
        super().__init__(cfg)
        self.block_size, self.mask_token_id = int(block_size), int(mask_token_id)
        self._tap_ids = [int(i) for i in target_layer_ids]
        self.num_target_layers, self.vocab_size = int(num_target_layers), int(vocab_size)
        self.markov_rank = int(markov_rank)
        self.confidence_with_markov = bool(confidence_with_markov)
        self._base_config = dict(base_config or {})
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, vocab_size, bias=False)
        self.markov_head = MarkovHead(vocab_size, markov_rank)
        if confidence:
            self.confidence_head = ConfidenceHead(cfg.hidden_size + (markov_rank if confidence_with_markov else 0))

    @property
    def target_layer_ids(self):
        return list(self._tap_ids)

    @property
    def has_confidence(self) -> bool:
        return "confidence_head" in self


def parse_config(config: dict, what: str = "DSpark drafter") -> dict:
    """DSparkModel keyword arguments from a DeepSpec config.json dict.

    Raises:
        MlxInferError: missing keys, an unknown markov_head_type, a block size < 1.
    """
    block = require(config, "block_size", what)
    if block < 1:
        raise MlxInferError(f"{what} config.json: block_size must be >= 1, got {block}")
    kind = config.get("markov_head_type", "vanilla")
    if kind != "vanilla":
        raise MlxInferError(f"{what}: markov_head_type {kind!r} is not supported (only 'vanilla')")
    n_target = require(config, "num_target_layers", what)
    n_layers = require(config, "num_hidden_layers", what)
    ids = config.get("target_layer_ids") or default_layer_ids(n_target, n_layers)
    return dict(cfg=backbone_config(config, len(ids), what), block_size=block,
                mask_token_id=require(config, "mask_token_id", what), target_layer_ids=[int(i) for i in ids],
                num_target_layers=n_target, vocab_size=require(config, "vocab_size", what),
                markov_rank=int(config.get("markov_rank", 256)),
                confidence=bool(config.get("enable_confidence_head", True)),
                confidence_with_markov=bool(config.get("confidence_head_with_markov", True)), base_config=config)


def load_dspark_model(path: Union[str, Path]) -> DSparkModel:
    """A DSparkModel from a DeepSpec checkpoint directory (or HF repo id), in the checkpoint's dtype.

    Raises:
        MlxInferError: not a drafter directory, a bad config, a missing / unexpected / wrongly shaped tensor.
    """
    directory = resolve_dir(path)
    what = f"DSpark drafter {directory}"
    config, weights = read_checkpoint(directory)
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise MlxInferError(f"{what} is a {arch}, not one of {', '.join(ARCHITECTURES)}")
    model = DSparkModel(**parse_config(config, what))
    load_strict(model, weights, what)
    return model


def save_dspark_model(model: DSparkModel, path: Union[str, Path]) -> Path:
    """Write a DSparkModel in the DeepSpec format (the base config's keys, then the drafter's flat keys)."""
    config = dict(model._base_config)
    config.update(backbone_keys(model.cfg))
    config.update({
        "architectures": [config.get("architectures", ["Qwen3DSparkModel"])[0]
                          if config.get("architectures", [""])[0] in ARCHITECTURES else "Qwen3DSparkModel"],
        "model_type": config.get("model_type", "qwen3"), "vocab_size": model.vocab_size,
        "num_target_layers": model.num_target_layers, "block_size": model.block_size,
        "mask_token_id": model.mask_token_id, "target_layer_ids": model.target_layer_ids,
        "enable_confidence_head": model.has_confidence,
        "confidence_head_with_markov": model.confidence_with_markov, "markov_rank": model.markov_rank,
        "markov_head_type": "vanilla", "tie_word_embeddings": False,
    })
    if "layer_types" not in backbone_keys(model.cfg):  # a copied target list would not fit N layers
        config["layer_types"] = ["full_attention"] * model.cfg.num_hidden_layers
        config.pop("sliding_window", None)
    return write_checkpoint(path, config, model)


class DSparkDrafter(BlockDrafter):
    """Drafts up to B tokens per round, left to right through the Markov head, and cuts the block with a
    ConfidenceSchedule (q: the distributions the tokens were drawn from; None when greedy).

    Args:
        model: a DSparkModel.
        target: the target mlx-lm model (checked for fit; the drafter uses its own embedding / lm_head copies).
        schedule: ConfidenceSchedule (default: keep all drafts). Ignored without a confidence head.
        ident: the checkpoint's identity, under which its calibration prior is cached (None: not cached).

    Attributes:
        last_confidence: c_1..c_g of the last proposal (floats).

    Raises:
        MlxInferError: the drafter does not fit the target.
    """

    name = "dspark"
    self_scheduled = True

    def __init__(self, model: DSparkModel, target: nn.Module, schedule: Optional[ConfidenceSchedule] = None,
                 ident: Optional[str] = None):
        check_fits("the DSpark drafter", target, model.cfg.hidden_size, model.vocab_size, model.num_target_layers,
                   model.target_layer_ids, model.mask_token_id)
        super().__init__(model, model.embed_tokens, model.lm_head)
        self.schedule = schedule or ConfidenceSchedule()
        self.ident = ident
        self.last_confidence = []

    @property
    def max_draft(self) -> int:
        return self.block_size

    def propose(self, context: Sequence[int], gamma: int, worth: Worth = None) -> Draft:
        m = self.model
        g = min(gamma, self.block_size)
        h = self.block_hidden(context)  # [B, H]
        if g <= 0:
            mx.eval([c.state for c in self.cache])
            return Draft([])
        base = self.logits(h[:g])  # [g, V]
        prev = mx.array([int(context[-1])], dtype=mx.uint32)
        tokens, qs, confs = [], [], []
        for k in range(g):
            e = m.markov_head.markov_w1(prev)  # [1, r]
            tok, q = self.choose(base[k : k + 1] + m.markov_head.markov_w2(e).astype(mx.float32))
            if m.has_confidence:
                x = mx.concatenate([h[k : k + 1], e.astype(h.dtype)], axis=-1) if m.confidence_with_markov else h[k : k + 1]
                confs.append(mx.sigmoid(m.confidence_head.proj(x).astype(mx.float32))[0])
            tokens.append(tok)
            if q is not None:
                qs.append(q)
            prev = tok
        out = mx.concatenate(tokens)
        q = mx.concatenate(qs, axis=0) if qs else None
        conf = mx.concatenate(confs) if confs else None
        mx.eval(out, *(a for a in (q, conf) if a is not None))
        draft = out.tolist()
        self.last_confidence = conf.tolist() if conf is not None else []
        n = self.schedule(self.last_confidence) if conf is not None else g
        return Draft(draft[:n], None if q is None else q[:n])


def load_dspark(path: Union[str, Path], target: nn.Module, schedule: Optional[ConfidenceSchedule] = None) -> DSparkDrafter:
    """load_dspark_model + DSparkDrafter (errors as both)."""
    return DSparkDrafter(load_dspark_model(path), target, schedule)
