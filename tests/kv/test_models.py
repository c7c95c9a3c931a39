"""With no eviction the paged cache is a drop-in for mlx-lm's KVCache: identical logits over a prefill and
decode steps on the default model and on a tiny model of each architecture we load, and the same greedy
tokens through mlx-lm's generate_step (plain_tokens with prompt_cache=)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from gguf_factory import MODEL_TYPES
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.errors import UnsupportedModelError
from mlx_infer.kv import make_paged_cache, make_pool
from mlx_infer.kv.cache import supports_paged

PROMPT = ("The history of the city begins in the Roman period, when a small fort was built on the river. "
          "Over the following centuries the settlement grew into a market town")


def run(model, ids, cache, steps, chunks=1):
    """[logits [V] of the prefill's last row], the prompt prefilled in `chunks` forwards."""
    out = []
    bounds = np.linspace(0, len(ids), chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:]):
        logits = model(mx.array(ids[a:b])[None], cache=cache)
    out.append(np.array(logits[0, -1].astype(mx.float32)))
    return out


def decode_pair(model, ids, steps, chunks=1, block_size=16):
    dense, paged = make_prompt_cache(model), make_paged_cache(model, make_pool(model, block_size=block_size))
    got, want = run(model, ids, paged, steps, chunks), run(model, ids, dense, steps, chunks)
    for _ in range(steps):
        token = mx.array([[int(np.argmax(want[-1]))]])
        want.append(np.array(model(token, cache=dense)[0, -1].astype(mx.float32)))
        got.append(np.array(model(token, cache=paged)[0, -1].astype(mx.float32)))
    assert paged[0].offset == dense[0].offset == len(ids) + steps
    return np.stack(got), np.stack(want)


def test_default_model_logits_identical(default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    got, want = decode_pair(default_engine.model, ids, 16)
    np.testing.assert_array_equal(got, want)


def test_default_model_greedy_tokens_identical(default_engine):
    ids = default_engine.tokenizer.encode(PROMPT)
    model = default_engine.model
    pool = make_pool(model)
    cache = make_paged_cache(model, pool)
    got = list(plain_tokens(model, ids, SamplingParams(), 24, cache=cache))
    assert got == list(plain_tokens(model, ids, SamplingParams(), 24))
    assert cache[0].offset >= len(ids) + 23
    assert pool.blocks_in_use == -(-cache[0].offset // pool.block_size)  # dense blocks, no hole


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_tiny_architectures_logits_match(tiny_models, arch):
    """Prefill in 3 chunks (the new tokens after cached ones, gemma3's window crossing chunks), then decode;
    block size 4 so the tokens span many blocks."""
    model = tiny_models[arch]
    ids = [5, 17, 260, 99, 3, 101, 42, 7, 255, 12, 64, 200, 31, 8, 150, 11, 90, 2, 33, 70]
    got, want = decode_pair(model, ids, 10, chunks=3, block_size=4)
    # gemma3's sliding layers: mlx-lm keeps 8 entries (RotatingKVCache), the paged cache all of them behind
    # a window mask: the same keys are attended to, summed in another order.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    if arch != "gemma3":
        np.testing.assert_array_equal(got, want)


def test_supports_paged_names_models_with_other_layer_caches(tiny_engine):
    """A model whose layers keep recurrent state (mlx-lm's ArraysCache) cannot be paged: supports_paged says
    so, and make_paged_cache raises the one-line error."""
    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(2, 2)]

        def make_cache(self):
            return [ArraysCache(2)]

    assert supports_paged(tiny_engine.model) and not supports_paged(Recurrent())
    with pytest.raises(UnsupportedModelError, match="^the paged KV cache replaces KVCache layers, this model uses "
                                                    "ArraysCache: use the dense KV cache for it$"):
        make_paged_cache(Recurrent(), make_pool(tiny_engine.model))
