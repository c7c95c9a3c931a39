"""Tiny random float32 mlx-lm llama models for the speculative tests (built in-process, seeded)."""

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import mlx_infer  # noqa: F401  (tests/conftest.py imported it first: the optimized BLAS is loaded)
from mlx_infer.speculative.target import Target


def tiny_llama(seed: int = 0, vocab: int = 64, layers: int = 2, hidden: int = 32, scale: float = 1.0):
    """A random llama: vocab tokens, float32, seeded; `scale` multiplies every weight (larger = peakier)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    model = llama.Model(args)
    if scale != 1.0:
        from mlx.utils import tree_map
        model.update(tree_map(lambda a: a * scale, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def target():
    return tiny_llama(seed=1, vocab=64, scale=3.0)


@pytest.fixture(scope="session")
def weak_drafter_model():
    """An unrelated random model: its drafts are nearly always wrong."""
    return tiny_llama(seed=2, vocab=64, layers=1, scale=3.0)


@pytest.fixture(scope="session")
def make_tiny():
    """The tiny_llama factory, for tests that need their own models."""
    return tiny_llama


class FakeTokenizer:
    """What speculative decoding asks of a tokenizer, for the tiny models: vocab_size, encode, get_vocab."""

    def __init__(self, vocab: int = 64):
        self.vocab_size = vocab

    def encode(self, text):
        return [1 + (ord(c) % (self.vocab_size - 4)) for c in text]

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab_size)}


@pytest.fixture
def make_target(tmp_path):
    """Target(model, a FakeTokenizer, key unique to the test, names) for SpecState and the calibrations."""
    def make(model, names=("tiny",), vocab: int = 64):
        return Target(model, FakeTokenizer(vocab), key=f"test|{tmp_path}|{id(model)}", names=tuple(names),
                      weights="float32")
    return make
