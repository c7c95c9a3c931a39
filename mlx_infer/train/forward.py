"""The block drafters' forward for training: many blocks against one full context in a single pass.

At inference (backbone.py) one block attends over the cached context K/V. For training, each sequence's
context rows (the fused target taps of ALL its positions) are projected once per layer, and every block
anchored at position a attends to the context keys < a plus its own block (bidirectional), never to
another block; RoPE puts context row j at position j and block slot k at a + k, as at inference. The
layers' own submodules (q/k/v/o_proj, q/k_norm, rope, mlp, norms) are used, so a trained checkpoint
behaves identically in `Backbone.hidden` (tests/train check the two agree).

Shapes: S sequences, Lp context rows each, A blocks per sequence, B slots, H hidden, n taps.
"""

import mlx.core as mx

from ..speculative.drafters.backbone import Backbone, ContextAttention, DecoderLayer


def block_masks(anchors: mx.array, context_len: int, block: int, window=None) -> mx.array:
    """Boolean attention mask [S*A, 1, B, Lp + B]: True where a block query may look.

    Context key j is visible to the block anchored at a iff j < a (and, on sliding layers, when
    q_pos - j < window); the block's own keys are always visible (as in backbone.ContextAttention,
    the window never hides a row of the block itself at B <= window).
    """
    a = anchors.reshape(-1)[:, None, None]  # [N, 1, 1]
    q_pos = a + mx.arange(block)[None, :, None]  # [N, B, 1]
    k_ctx = mx.arange(context_len)[None, None, :]  # [1, 1, Lp]
    ctx = k_ctx < a
    k_blk = a + mx.arange(block)[None, None, :]  # [N, 1, B]
    blk = mx.ones(k_blk.shape, dtype=mx.bool_)
    if window is not None:
        ctx = ctx & ((q_pos - k_ctx) < window)
        blk = (q_pos - k_blk) < window
    ctx = mx.broadcast_to(ctx, (a.shape[0], block, context_len))
    blk = mx.broadcast_to(blk, (a.shape[0], block, block))
    return mx.concatenate([ctx, blk], axis=-1)[:, None]


def _attention(attn: ContextAttention, x: mx.array, ctx: mx.array, pos: mx.array, masks: dict) -> mx.array:
    """x [N, B, H] normed block rows (N = S*A), ctx [S, Lp, H] context rows, pos [N] anchors -> [N, B, H]."""
    N, B, _ = x.shape
    S, Lp, _ = ctx.shape
    A = N // S
    q = attn.rope(attn.q_norm(attn._heads(attn.q_proj(x), attn.n_heads)).transpose(0, 2, 1, 3), offset=pos)
    kb = attn.rope(attn.k_norm(attn._heads(attn.k_proj(x), attn.n_kv)).transpose(0, 2, 1, 3), offset=pos)
    vb = attn._heads(attn.v_proj(x), attn.n_kv).transpose(0, 2, 1, 3)
    kc = attn.rope(attn.k_norm(attn._heads(attn.k_proj(ctx), attn.n_kv)).transpose(0, 2, 1, 3))  # [S, kv, Lp, D]
    vc = attn._heads(attn.v_proj(ctx), attn.n_kv).transpose(0, 2, 1, 3)

    def per_block(t):  # [S, kv, Lp, D] -> [N, kv, Lp, D] (each block gets its sequence's context)
        return mx.broadcast_to(t[:, None], (S, A) + tuple(t.shape[1:])).reshape(N, *t.shape[1:])

    keys = mx.concatenate([per_block(kc), kb], axis=2)
    values = mx.concatenate([per_block(vc), vb], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=masks[attn.window])
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(N, B, -1))


def _layer(layer: DecoderLayer, h: mx.array, ctx: mx.array, pos: mx.array, masks: dict) -> mx.array:
    h = h + _attention(layer.self_attn, layer.input_layernorm(h), ctx, pos, masks)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def blocks_hidden(model: Backbone, feats: mx.array, block_emb: mx.array, anchors: mx.array) -> mx.array:
    """Normed hidden states of many blocks, each against its own sequence's context (differentiable).

    Args:
        model: a DFlashModel / DSparkModel (any Backbone).
        feats: [S, Lp, n*H] target taps of every position (any float dtype; cast to the drafter's).
        block_emb: [S, A, B, H] embeddings of the blocks ([x_a] + [mask] * (B - 1)), target embedding.
        anchors: [S, A] int32 anchor positions (each < Lp).

    Returns:
        [S, A, B, H] in the drafter's dtype, final `norm` applied: what `Backbone.hidden` gives for each
        block with the context rows < anchor.
    """
    dtype = model.fc.weight.dtype
    S, A, B, H = block_emb.shape
    ctx = model.hidden_norm(model.fc(feats.astype(dtype)))
    pos = anchors.reshape(-1).astype(mx.int32)
    windows = {layer.self_attn.window for layer in model.layers}
    masks = {w: block_masks(anchors, ctx.shape[1], B, w) for w in windows}
    h = block_emb.astype(dtype).reshape(S * A, B, H)
    for layer in model.layers:
        h = _layer(layer, h, ctx, pos, masks)
    return model.norm(h).reshape(S, A, B, H)
