"""Fixtures of the trainer tests: a tiny random float32 llama target whose greedy answers depend on the
context in a learnable way (weights at scale 1: neither chaotic nor constant), and its greedy sequences."""

import random
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import llama

import mlx_infer  # noqa: F401  (tests/conftest.py imported it first: the optimized BLAS is loaded)
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.train.data import TrainSequence

SPEC = Path(__file__).resolve().parent.parent / "speculative"
if str(SPEC) not in sys.path:
    sys.path.insert(0, str(SPEC))  # block_drafters (tiny random drafters)

VOCAB = 64


def tiny_target(seed: int = 1, vocab: int = VOCAB, layers: int = 2, hidden: int = 32):
    """A random float32 llama (mlx-lm), seeded."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
        max_position_embeddings=512, tie_word_embeddings=False, rope_theta=10000.0,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def greedy_sequences(target, seeds, answer: int = 40, vocab: int = VOCAB):
    """Random prompts (3-11 tokens) and the target's greedy answers, as TrainSequences."""
    out = []
    for k in seeds:
        r = random.Random(k)
        prompt = [r.randrange(vocab) for _ in range(r.randrange(3, 12))]
        out.append(TrainSequence(prompt + list(plain_tokens(target, prompt, SamplingParams(), answer)), len(prompt)))
    return out


@pytest.fixture(scope="session")
def target():
    return tiny_target()


@pytest.fixture(scope="session")
def train_seqs(target):
    return greedy_sequences(target, range(48))


@pytest.fixture(scope="session")
def held_seqs(target):
    return greedy_sequences(target, range(1000, 1008))
