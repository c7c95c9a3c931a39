"""The block-drafter backbone shared by DFlash (arXiv 2602.06036) and DSpark: Qwen3-style decoder layers
(pre-norm, q/k RMSNorm on head_dim, RoPE, SwiGLU) whose keys and values come from
[context rows ; block rows], where the context rows are the target's fused hidden states.

Shapes: H = hidden size, n = number of target taps, B = block size, C = new context rows this call,
T = context rows cached before this call (== the absolute position of the first new context row).
Context rows are the committed tokens at positions 0..T+C-1; the block sits at positions T+C..T+C+B-1
(its first slot is the anchor, the last committed token). Context K/V are cached across calls (mlx-lm
KVCache per layer); block K/V are never kept. Attention is non-causal: every block row sees every
context row and every block row (within the sliding window on sliding layers).

Parameter names are those of the published checkpoints: fc, hidden_norm, norm, layers.{i}.input_layernorm,
layers.{i}.post_attention_layernorm, layers.{i}.self_attn.{q,k,v,o}_proj / {q,k}_norm,
layers.{i}.mlp.{gate,up,down}_proj.
"""

from dataclasses import dataclass, field
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from ...errors import MlxInferError
from ...kernels.swiglu import swiglu
from .checkpoint import require


@dataclass
class BackboneConfig:
    """Sizes of the backbone (all ints unless said).

    Attributes:
        hidden_size: H (must equal the target's).
        intermediate_size: SwiGLU width.
        num_hidden_layers: drafter layers N.
        num_attention_heads, num_key_value_heads, head_dim: attention geometry.
        num_taps: n, target layers fused by `fc` (n*H -> H).
        rms_norm_eps: float.
        rope_theta: float RoPE base; rope_scaling: optional mlx-lm rope scaling dict.
        max_position_embeddings: for rope scaling.
        attention_bias: q/k/v/o projections with bias (Qwen3: False).
        windows: per layer, the sliding window in tokens or None (full attention).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_taps: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    windows: List[Optional[int]] = field(default_factory=list)

    def window(self, i: int) -> Optional[int]:
        return self.windows[i] if i < len(self.windows) else None


class ContextAttention(nn.Module):
    """Attention of block queries over [cached context ; new context ; block] keys (non-causal)."""

    def __init__(self, cfg: BackboneConfig, window: Optional[int]):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.window = window
        H, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(self.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        return x.reshape(x.shape[0], x.shape[1], n, self.head_dim)

    def __call__(self, x: mx.array, ctx: mx.array, cache: KVCache) -> mx.array:
        """x: [1, B, H] normed block rows; ctx: [1, C, H] new context rows (C may be 0); cache: this layer's
        context K/V (T rows before, T + C after). Returns [1, B, H]."""
        B, C = x.shape[1], ctx.shape[1]
        T = cache.offset
        start = T + C  # absolute position of the anchor slot
        q = self.q_norm(self._heads(self.q_proj(x), self.n_heads)).transpose(0, 2, 1, 3)
        rows = mx.concatenate([ctx, x], axis=1) if C else x  # [1, C+B, H]
        k = self.k_norm(self._heads(self.k_proj(rows), self.n_kv)).transpose(0, 2, 1, 3)
        v = self._heads(self.v_proj(rows), self.n_kv).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=start)
        k = self.rope(k, offset=T)
        if C:
            k_ctx, v_ctx = cache.update_and_fetch(k[:, :, :C], v[:, :, :C])
            keys = mx.concatenate([k_ctx, k[:, :, C:]], axis=2)
            values = mx.concatenate([v_ctx, v[:, :, C:]], axis=2)
        elif T:
            keys = mx.concatenate([cache.keys[:, :, :T], k], axis=2)
            values = mx.concatenate([cache.values[:, :, :T], v], axis=2)
        else:
            keys, values = k, v
        mask = None
        if self.window is not None and start + B > self.window:
            q_pos = mx.arange(start, start + B)[:, None]
            k_pos = mx.arange(0, start + B)[None, :]
            mask = (q_pos - k_pos) < self.window  # [B, start+B] bool; later block rows always visible
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, B, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm layer; the context rows enter K/V unnormed (they are already hidden_norm'ed)."""

    def __init__(self, cfg: BackboneConfig, i: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = ContextAttention(cfg, cfg.window(i))
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: mx.array, ctx: mx.array, cache: KVCache) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """fc + hidden_norm on the fused taps, N decoder layers, final norm.

    Args:
        cfg: BackboneConfig.
    """

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def make_cache(self) -> List[KVCache]:
        """Fresh per-layer context K/V caches."""
        return [KVCache() for _ in self.layers]

    def hidden(self, block: mx.array, features: Optional[mx.array], cache: List[KVCache]) -> mx.array:
        """Normed hidden states of the block.

        Args:
            block: [1, B, H] embeddings of the block tokens (anchor first).
            features: [1, C, n*H] target taps of the context rows not yet cached (None or C == 0: none).
            cache: from `make_cache`; grows by C rows.

        Returns:
            [1, B, H] in the drafter's dtype (the final `norm` applied).
        """
        dtype = self.fc.weight.dtype
        if features is not None and features.shape[1]:
            ctx = self.hidden_norm(self.fc(features.astype(dtype)))
        else:
            ctx = mx.zeros((1, 0, self.cfg.hidden_size), dtype)
        h = block.astype(dtype)
        for layer, c in zip(self.layers, cache):
            h = layer(h, ctx, c)
        return self.norm(h)


def backbone_config(config: dict, num_taps: int, what: str) -> BackboneConfig:
    """BackboneConfig from a Hugging Face-style config dict (Qwen3 keys; `rope_theta` or `rope_parameters`;
    optional `layer_types` + `sliding_window`).

    Raises:
        MlxInferError: a missing or malformed key.
    """
    H = require(config, "hidden_size", what)
    heads = require(config, "num_attention_heads", what)
    layers = require(config, "num_hidden_layers", what)
    rope_params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta") or rope_params.get("rope_theta") or 1_000_000.0
    scaling = config.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    windows: List[Optional[int]] = []
    types = config.get("layer_types")
    if types:
        if len(types) < layers:
            raise MlxInferError(f"{what} config.json: layer_types has {len(types)} entries for {layers} layers")
        if "sliding_attention" in types[:layers]:
            window = require(config, "sliding_window", what)
            windows = [window if t == "sliding_attention" else None for t in types[:layers]]
    return BackboneConfig(
        hidden_size=H,
        intermediate_size=require(config, "intermediate_size", what),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or H // heads),
        num_taps=num_taps,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 40960),
        attention_bias=bool(config.get("attention_bias", False)),
        windows=windows,
    )


def backbone_keys(cfg: BackboneConfig) -> dict:
    """The Hugging Face config keys that `backbone_config` reads back to `cfg` (num_taps excluded)."""
    out = {
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = cfg.rope_scaling
    if any(w is not None for w in cfg.windows):
        out["layer_types"] = ["sliding_attention" if w is not None else "full_attention" for w in cfg.windows]
        out["sliding_window"] = next(w for w in cfg.windows if w is not None)
    return out
