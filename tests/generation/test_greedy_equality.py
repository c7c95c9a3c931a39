"""Greedy decoding: mlx-infer's token ids equal mlx_lm.stream_generate's on the default model."""

import pytest
from mlx_lm import stream_generate


def mlx_lm_run(engine, prompt_ids, max_tokens):
    """mlx-lm's greedy (tokens without the EOS it yields last, as mlx-infer reports them; text)."""
    responses = list(stream_generate(engine.model, engine.tokenizer, prompt_ids, max_tokens=max_tokens))
    tokens = [r.token for r in responses]
    if tokens and tokens[-1] in engine.tokenizer.eos_token_ids:
        tokens = tokens[:-1]
    return tokens, "".join(r.text for r in responses)


def check_equal(engine, prompt, chat, max_tokens):
    prompt_ids = engine.encode(prompt, chat_template=chat)
    result = engine.generate(prompt, max_tokens=max_tokens, chat_template=chat)
    tokens, text = mlx_lm_run(engine, prompt_ids, max_tokens)
    assert result.token_ids == tokens
    # mlx-infer's text is decode(token_ids) exactly; mlx-lm's streaming detokenizer drops the first token's
    # leading space, and agrees otherwise
    assert result.text == engine.tokenizer.decode(result.token_ids)
    assert result.text.lstrip(" ") == text
    assert result.stats.prompt_tokens == len(prompt_ids)
    assert result.stats.generated_tokens == len(result.token_ids)
    assert result.finish_reason == ("length" if len(result.token_ids) == max_tokens else "stop")
    return result


def test_greedy_equals_mlx_lm_float32_chat(default_engine):
    """Also: the default model answers the README question with Paris, and ends its turn at EOS."""
    assert default_engine.source.weights == "float32"
    result = check_equal(default_engine, "What is the capital of France?", True, 24)
    assert "Paris" in result.text
    assert result.finish_reason == "stop" and len(result.token_ids) < 24
    assert not set(result.token_ids) & set(default_engine.tokenizer.eos_token_ids)


def test_greedy_equals_mlx_lm_float32_plain(default_engine):
    check_equal(default_engine, "The three primary colors are", False, 16)


def test_greedy_equals_mlx_lm_native(default_engine_native):
    engine = default_engine_native
    assert engine.source.weights == "native"
    assert engine.model.model.layers[0].self_attn.q_proj.bits == 4  # Q4_1 kept quantized
    check_equal(engine, "The three primary colors are", False, 8)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,chat", [("Write a haiku about the sea.", True), ("What is the capital of France?", True)])
def test_greedy_equals_mlx_lm_more(default_engine, default_engine_native, prompt, chat):
    check_equal(default_engine, prompt, chat, 48)
    check_equal(default_engine_native, prompt, chat, 24)


def test_stats(default_engine):
    result = default_engine.generate("Count from one to five.", max_tokens=4, chat_template=False)
    s = result.stats
    assert s.generated_tokens == len(result.token_ids) == 4 and result.finish_reason == "length"
    assert s.ttft_s > 0 and s.decode_tps > 0 and s.prefill_tps > 0 and s.total_s >= s.ttft_s
    assert s.peak_memory_bytes > 0
    d = result.to_dict()
    assert d["stats"]["prompt_tokens"] == s.prompt_tokens and d["token_ids"] == result.token_ids


def test_chat_messages_and_system_prompt(default_engine):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"}]
    ids = default_engine.encode(msgs, system="You are terse.")
    text = default_engine.tokenizer.decode(ids)
    assert text.count("<|im_start|>") == 5  # system, 3 turns, the generation prompt
    assert "You are terse." in text and text.endswith("<|im_start|>assistant\n")
    assert "helpful AI assistant named SmolLM" not in text  # the template's default system prompt is replaced
    steps = list(default_engine.stream_steps(msgs, system="You are terse.", max_tokens=3))
    assert steps[-1].stats.prompt_tokens == len(ids)
    tokens = [s.token for s in steps if s.token is not None]
    assert "".join(s.text for s in steps) == default_engine.tokenizer.decode(tokens)
