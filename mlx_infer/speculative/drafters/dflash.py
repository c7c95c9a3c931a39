"""DFlash block drafter (z-lab, arXiv 2602.06036): one forward of a small non-causal transformer over
[anchor] + [mask] * (B - 1), conditioned on the target's fused hidden states, drafts B - 1 tokens.

The drafter has no embedding or lm_head of its own: the block is embedded with the TARGET's embedding and
slots 1..B-1 go through the TARGET's lm_head (its `as_linear` embedding when tied). Checkpoint format:
config.json (`architectures: ["DFlashDraftModel"]`, `block_size` top level or inside `dflash_config`,
`dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers`, Qwen3 sizes) + safetensors with the
Backbone's parameter names (fc, hidden_norm, norm, layers.{i}.*).
"""

from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from ...errors import MlxInferError
from .. import target as target_parts
from ..capture import default_layer_ids
from .backbone import Backbone, BackboneConfig, backbone_config, backbone_keys
from .base import Draft, Worth
from .block import BlockDrafter, check_fits
from .checkpoint import load_strict, read_checkpoint, require, resolve_dir, write_checkpoint


class DFlashModel(Backbone):
    """The DFlash network (weights only; see DFlashDrafter for drafting).

    Args:
        cfg: BackboneConfig (num_taps == len(target_layer_ids)).
        block_size: B, slots per block (drafts B - 1).
        mask_token_id: the filler token of slots 1..B-1.
        target_layer_ids: tapped target layers.
        num_target_layers: layers of the target it was trained for.
        vocab_size: the target's vocabulary rows.
    """

    def __init__(self, cfg: BackboneConfig, block_size: int, mask_token_id: int, target_layer_ids: Sequence[int],
                 num_target_layers: int, vocab_size: int):
        super().__init__(cfg)
        self.block_size = int(block_size)
        self.mask_token_id = int(mask_token_id)
        self._tap_ids = [int(i) for i in target_layer_ids]  # private: not a parameter
        self.num_target_layers = int(num_target_layers)
        self.vocab_size = int(vocab_size)

    @property
    def target_layer_ids(self):
        return list(self._tap_ids)


def parse_config(config: dict, what: str = "DFlash drafter") -> dict:
    """DFlashModel keyword arguments from a published config.json dict.

    Raises:
        MlxInferError: missing keys, a block size < 2, taps that do not match the layer count.
    """
    dcfg = config.get("dflash_config") or {}
    block = config.get("block_size", dcfg.get("block_size"))
    if block is None:
        raise MlxInferError(f"{what} config.json lacks 'block_size' (top level or in dflash_config)")
    block = int(block)
    if block < 2:
        raise MlxInferError(f"{what} config.json: block_size must be >= 2, got {block}")
    mask = dcfg.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise MlxInferError(f"{what} config.json lacks dflash_config.mask_token_id")
    n_target = require(config, "num_target_layers", what)
    n_layers = require(config, "num_hidden_layers", what)
    ids = dcfg.get("target_layer_ids") or config.get("target_layer_ids") or default_layer_ids(n_target, n_layers)
    return dict(cfg=backbone_config(config, len(ids), what), block_size=block, mask_token_id=int(mask),
                target_layer_ids=[int(i) for i in ids], num_target_layers=n_target,
                vocab_size=require(config, "vocab_size", what))


def load_dflash_model(path: Union[str, Path]) -> DFlashModel:
    """A DFlashModel from a checkpoint directory (or HF repo id), in the checkpoint's dtype.

    Raises:
        MlxInferError: not a drafter directory, a bad config, a missing / unexpected / wrongly shaped tensor.
    """
    directory = resolve_dir(path)
    what = f"DFlash drafter {directory}"
    config, weights = read_checkpoint(directory)
    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if arch != "DFlashDraftModel":
        raise MlxInferError(f"{what} is a {arch}, not a DFlashDraftModel (DFlash 2 drafters are not supported)")
    model = DFlashModel(**parse_config(config, what))
    load_strict(model, weights, what)
    return model


def save_dflash_model(model: DFlashModel, path: Union[str, Path], block_size_in: str = "top") -> Path:
    """Write a DFlashModel in the published format.

    Args:
        block_size_in: "top" (block_size at the top level) or "dflash_config" (newer revisions).
    """
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", **backbone_keys(model.cfg),
              "num_target_layers": model.num_target_layers, "vocab_size": model.vocab_size,
              "dflash_config": {"mask_token_id": model.mask_token_id, "target_layer_ids": model.target_layer_ids}}
    if block_size_in == "top":
        config["block_size"] = model.block_size
    elif block_size_in == "dflash_config":
        config["dflash_config"]["block_size"] = model.block_size
    else:
        raise ValueError(f"block_size_in must be 'top' or 'dflash_config', got {block_size_in!r}")
    return write_checkpoint(path, config, model)


class DFlashDrafter(BlockDrafter):
    """Drafts up to B - 1 tokens per round from one DFlash forward (deterministic argmax when greedy, q None;
    independent samples per slot with q when sampling).

    Args:
        model: a DFlashModel.
        target: the target mlx-lm model (its embedding and lm_head are used).
        ident: the checkpoint's identity, under which its calibration prior is cached (None: not cached).

    Raises:
        MlxInferError: the drafter does not fit the target (hidden size, vocabulary, num_target_layers, taps).
    """

    name = "dflash"

    def __init__(self, model: DFlashModel, target: nn.Module, ident: Optional[str] = None):
        check_fits("the DFlash drafter", target, model.cfg.hidden_size, model.vocab_size, model.num_target_layers,
                   model.target_layer_ids, model.mask_token_id)
        super().__init__(model, target_parts.embedding(target), target_parts.output_head(target))
        self.ident = ident

    @property
    def max_draft(self) -> int:
        return self.block_size - 1

    def propose(self, context: Sequence[int], gamma: int, worth: Worth = None) -> Draft:
        g = min(gamma, self.block_size - 1)
        h = self.block_hidden(context)  # [B, H]; always run: it moves the pending context into the cache
        if g <= 0:
            mx.eval([c.state for c in self.cache])
            return Draft([])
        tokens, q = self.choose(self.logits(h[1 : 1 + g]))
        mx.eval(tokens, *(() if q is None else (q,)))
        return Draft(tokens.tolist(), q)


def load_dflash(path: Union[str, Path], target: nn.Module) -> DFlashDrafter:
    """load_dflash_model + DFlashDrafter (errors as both)."""
    return DFlashDrafter(load_dflash_model(path), target)
