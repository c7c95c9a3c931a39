"""The streaming detokenizer never emits broken UTF-8: emoji and CJK split over byte tokens arrive whole."""

import pytest

from gguf_factory import TinySpec, random_weights, spm_tokenizer, write_gguf

TEXT = "Hello 👋 world! 日本語のテキスト, 中文, 한국어 and emoji 🙂🎉👨‍👩‍👧 ✓ — done."


def check_stream(engine, fake_tokens, text, add_special_tokens=False):
    ids = [i for i in engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)
           if i not in (engine.tokenizer.bos_token_id,)]
    # the test is only meaningful if some tokens are partial characters on their own
    partial = [i for i in ids if "\ufffd" in engine.tokenizer.decode([i])]
    assert partial, "no token splits a character; the test would prove nothing"
    fake_tokens(ids)
    steps = list(engine.stream_steps("x", chat_template=False, max_tokens=len(ids) + 1))
    for step in steps:
        assert isinstance(step.text, str)
        assert "\ufffd" not in step.text
        step.text.encode("utf-8")  # no lone surrogates
    assert "".join(s.text for s in steps) == text
    assert [s.token for s in steps if s.token is not None] == ids
    chunks = list(engine.stream("x", chat_template=False, max_tokens=len(ids) + 1))
    assert all(chunks) and "".join(chunks) == text


def test_byte_level_bpe_default_model(default_engine, fake_tokens):
    check_stream(default_engine, fake_tokens, TEXT)


def test_byte_level_bpe_tiny_vocab(tiny_engine, fake_tokens):
    check_stream(tiny_engine, fake_tokens, "the 🙂 capital 東京 of ✓")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_byte_fallback(arch, tmp_path, fake_tokens):
    import mlx_infer

    spec = TinySpec(arch, tokenizer=spm_tokenizer(), **({"layers": 6} if arch == "gemma3" else {}))
    path = write_gguf(tmp_path / "spm.gguf", spec, random_weights(spec))
    engine = mlx_infer.load(str(path), weights="native")
    check_stream(engine, fake_tokens, "the 🙂 capital 東京 of france ✓")


def test_gemma_tokenizer_stream(gemma_engine, fake_tokens):
    check_stream(gemma_engine, fake_tokens, "The 🦙 says 你好, 🙂" + "\u2603")


def test_real_model_streams_valid_text(default_engine):
    """The real model copying CJK / emoji: every chunk is valid text, and together they equal the
    result's text."""
    prompt = "Repeat exactly: 東京 🙂 日本語"
    steps = list(default_engine.stream_steps(prompt, max_tokens=8))
    assert all("\ufffd" not in s.text for s in steps)
    tokens = [s.token for s in steps if s.token is not None]
    assert "".join(s.text for s in steps) == default_engine.tokenizer.decode(tokens)
