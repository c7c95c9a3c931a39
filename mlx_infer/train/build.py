"""A fresh DFlash / DSpark drafter shaped for a target: hidden size, heads, MLP width, RoPE base and
vocabulary from the target; taps evenly spaced (capture.default_layer_ids) unless given. Embedding and
lm_head are the target's (DSpark keeps frozen copies of them, as its published format stores)."""

from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxInferError
from ..speculative import target as target_parts
from ..speculative.capture import default_layer_ids
from ..speculative.drafters.backbone import BackboneConfig
from ..speculative.drafters.dflash import DFlashModel
from ..speculative.drafters.dspark import DSparkModel

KINDS = ("dflash", "dspark")
#: Default block sizes (published: DFlash b16; DSpark 7 inputs -> 7 drafts).
DEFAULT_BLOCK = {"dflash": 16, "dspark": 7}


def target_config(target: nn.Module, config: Optional[dict] = None) -> dict:
    """The target's HF-style config: `config` when given, else its mlx-lm ModelArgs as a dict."""
    if config:
        return dict(config.get("text_config") or {}, **{k: v for k, v in config.items() if k != "text_config"})
    args = getattr(target, "args", None)
    return dict(vars(args)) if args is not None else {}


def backbone_for(target: nn.Module, layers: int, num_taps: int, config: Optional[dict] = None) -> BackboneConfig:
    """BackboneConfig matching the target's geometry (Qwen3-style layers of the target's width)."""
    _, H, _ = target_parts.dims(target)
    cfg = target_config(target, config)
    heads = int(cfg.get("num_attention_heads") or max(1, H // 64))
    head_dim = int(cfg.get("head_dim") or H // heads)
    return BackboneConfig(
        hidden_size=H, intermediate_size=int(cfg.get("intermediate_size") or 4 * H), num_hidden_layers=int(layers),
        num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim, num_taps=int(num_taps), rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope_theta=float(cfg.get("rope_theta") or 1_000_000.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 40960),
    )


def default_taps(num_target_layers: int, n: int):
    """n tap ids: the published spacing (capture.default_layer_ids) when it fits the target, else n
    distinct ids spread evenly over 0..L-1 (small targets; n capped at L)."""
    ids = default_layer_ids(num_target_layers, n)
    if all(0 <= i < num_target_layers for i in ids) and len(set(ids)) == len(ids):
        return ids
    n = min(n, num_target_layers)
    if n == 1:
        return [num_target_layers // 2]
    return sorted({int(round(i * (num_target_layers - 1) / (n - 1))) for i in range(n)})


def _dense_tables(target: nn.Module):
    """(embedding [V, H], lm_head weight [V, H]) of the target as dense float32 (dequantized if needed)."""
    _, H, V = target_parts.dims(target)
    emb = target_parts.embedding(target)(mx.arange(V)).astype(mx.float32)
    head = target_parts.output_head(target)(mx.eye(H, dtype=emb.dtype)).astype(mx.float32).T  # [V, H]
    return emb, head


def check_taps(taps: Sequence[int], num_target_layers: int) -> None:
    """Raise MlxInferError when a tap index is outside the target's decoder layers 0..L-1."""
    bad = [int(i) for i in taps if not 0 <= int(i) < num_target_layers]
    if bad:
        raise MlxInferError(f"tap layers {bad} are outside the target's {num_target_layers} layers")


def new_drafter(kind: str, target: nn.Module, *, layers: int = 1, block_size: Optional[int] = None,
                taps: Optional[Sequence[int]] = None, mask_token_id: Optional[int] = None, markov_rank: int = 64,
                config: Optional[dict] = None, seed: int = 0):
    """A randomly initialised drafter for `target` (float32).

    Args:
        kind: "dflash" or "dspark".
        target: the target mlx-lm model.
        layers: drafter decoder layers N (>= 1).
        block_size: B (default 16 for DFlash, 7 for DSpark).
        taps: tapped target layers (default: N evenly spaced, as the published configs).
        mask_token_id: the block filler (default: the last vocabulary id).
        markov_rank: DSpark's Markov head rank r.
        config: the target's HF config (its heads / widths / RoPE base); default: its mlx-lm args.
        seed: initialisation seed.

    Raises:
        MlxInferError: an unknown kind, a bad size, taps outside the target.
    """
    if kind not in KINDS:
        raise MlxInferError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    n_target, H, V = target_parts.dims(target)
    block = int(block_size or DEFAULT_BLOCK[kind])
    if layers < 1:
        raise MlxInferError(f"--layers must be >= 1, got {layers}")
    if block < (2 if kind == "dflash" else 1):
        raise MlxInferError(f"--block-size must be >= {2 if kind == 'dflash' else 1} for {kind}, got {block}")
    ids = [int(i) for i in (taps if taps else default_taps(n_target, layers))]
    check_taps(ids, n_target)
    mask = V - 1 if mask_token_id is None else int(mask_token_id)
    if not 0 <= mask < V:
        raise MlxInferError(f"mask token {mask} is outside the vocabulary ({V})")
    cfg = backbone_for(target, layers, len(ids), config)
    mx.random.seed(seed)
    if kind == "dflash":
        model = DFlashModel(cfg, block, mask, ids, n_target, V)
    else:
        if markov_rank < 1:
            raise MlxInferError(f"--markov-rank must be >= 1, got {markov_rank}")
        base = {k: v for k, v in target_config(target, config).items()
                if isinstance(v, (int, float, str, bool, list, dict, type(None)))}
        model = DSparkModel(cfg, block, mask, ids, n_target, V, markov_rank=markov_rank, base_config=base)
        emb, head = _dense_tables(target)
        model.embed_tokens.weight = emb
        model.lm_head.weight = head
        model.markov_head.markov_w2.weight = mx.zeros_like(model.markov_head.markov_w2.weight)
    model.set_dtype(mx.float32)
    freeze_shared(model)
    mx.eval(model.parameters())
    return model


def freeze_shared(model) -> None:
    """Freeze what the drafter shares with the target (DSpark's embed_tokens / lm_head copies)."""
    model.unfreeze()
    if isinstance(model, DSparkModel):
        model.embed_tokens.freeze()
        model.lm_head.freeze()
