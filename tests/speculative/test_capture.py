"""Target hidden-state capture: the taps equal a manual layer-by-layer forward, during a cached (verify-like)
forward too, and the model is restored afterwards."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.errors import MlxInferError
from mlx_infer.speculative.capture import TargetTaps, default_layer_ids
from mlx_infer.speculative.target import dims, embedding, output_head


def tiny_qwen3(tied=True):
    mx.random.seed(3)
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=32, num_hidden_layers=4, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=50,
                           max_position_embeddings=256, rope_theta=10000.0, head_dim=8, tie_word_embeddings=tied)
    m = qwen3.Model(args)
    mx.eval(m.parameters())
    return m


def manual(model, tokens, ids):
    """Layer outputs by hand: embed, then each decoder layer with a causal mask."""
    h = model.model.embed_tokens(tokens)
    mask = create_attention_mask(h, None)
    outs = []
    for layer in model.model.layers:
        h = layer(h, mask, None)
        outs.append(h)
    return mx.concatenate([outs[i] for i in ids], axis=-1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_taps_equal_manual_forward(make_tiny, kind):
    model = make_tiny(seed=4, layers=4) if kind == "llama" else tiny_qwen3()
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    ids = [2, 0, 3]
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    layers = list(model.layers)
    with TargetTaps(model, ids) as taps:
        logits = model(tokens)
        feats = taps.features()
    assert feats.shape == (1, 8, 3 * 32)
    assert mx.allclose(feats, manual(model, tokens, ids), atol=1e-5).item()
    # restored: same layer objects, same parameter names, same logits
    assert all(a is b for a, b in zip(model.layers, layers))
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names
    assert mx.array_equal(model(tokens), logits).item()


def test_taps_during_cached_forward(make_tiny):
    """A verify-like forward over a prefilled cache taps only the new rows, equal to the full forward's."""
    model = make_tiny(seed=4, layers=3)
    tokens = mx.array([[7, 3, 3, 8, 1, 2, 9]])
    full = manual(model, tokens, [0, 2])
    cache = make_prompt_cache(model)
    with TargetTaps(model, [0, 2]) as taps:
        model(tokens[:, :4], cache=cache)
        head = taps.features()
        model(tokens[:, 4:], cache=cache)
        tail = taps.features()
        with pytest.raises(RuntimeError):
            taps.features()  # nothing new since the last read
    assert mx.allclose(mx.concatenate([head, tail], axis=1), full, atol=1e-5).item()


def test_bad_layer_ids(make_tiny):
    with pytest.raises(MlxInferError, match="layers"):
        TargetTaps(make_tiny(layers=2), [0, 2])


def test_target_parts_tied_and_untied(make_tiny):
    for model in (tiny_qwen3(tied=True), tiny_qwen3(tied=False), make_tiny(layers=2)):
        tokens = mx.array([[1, 2, 3]])
        h = model.model(tokens)
        assert mx.allclose(output_head(model)(h), model(tokens), atol=1e-5).item()
        assert embedding(model) is model.model.embed_tokens
    assert dims(tiny_qwen3()) == (4, 32, 50)


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(10, 1) == [5]
