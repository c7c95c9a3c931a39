"""Prefill progress under speculative decoding: the same `progress(done, total)` calls as plain decoding
(issue 52, defect 3: the speculative prefill reported only its last chunk, so the CLI drew no prefill bar
under the default --spec auto)."""

import pytest
from gguf_factory import tiny_gguf

import mlx_infer
from mlx_infer.defaults import PREFILL_STEP_SIZE


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """A tiny llama whose context holds a prompt of more than one prefill chunk."""
    path = tiny_gguf(tmp_path_factory.mktemp("progress") / "tiny-long.gguf", "llama", context=4096)[0]
    return mlx_infer.load(str(path), weights="float32")


#: About 2,960 tokens of the tiny byte-level vocabulary: two prefill chunks, and repeats lookup can copy.
LONG_PROMPT = " ".join(f"word{i % 97} next" for i in range(300))


def progress_calls(engine, prompt: str, speculative: str):
    """(progress calls, spec_mode) of one greedy request of 4 tokens."""
    calls = []
    result = engine.generate(prompt, max_tokens=4, chat_template=False, speculative=speculative, max_draft=4,
                             progress=lambda done, total: calls.append((done, total)))
    return calls, result.stats.spec_mode


@pytest.mark.parametrize("mode", ["lookup", "auto"])
def test_speculative_prefill_reports_every_chunk_as_plain_decoding(long_engine, mode):
    total = len(long_engine.encode(LONG_PROMPT, chat_template=False))
    assert total > PREFILL_STEP_SIZE + 1  # the prompt takes two chunks
    long_engine.reset()
    plain, plain_mode = progress_calls(long_engine, LONG_PROMPT, "off")
    assert plain_mode is None
    assert plain == [(0, total), (PREFILL_STEP_SIZE, total), (total - 1, total), (total, total)]
    long_engine.reset()
    spec, spec_mode = progress_calls(long_engine, LONG_PROMPT, mode)
    assert spec_mode == "lookup"  # decoded speculatively, not the plain fallback
    assert spec == plain


def test_speculative_prefill_progress_counts_a_kept_prefix_as_done(long_engine):
    """A follow-up prompt that extends the kept one: the first call reports the kept tokens as done."""
    follow = LONG_PROMPT + " and then some more words"
    total = len(long_engine.encode(follow, chat_template=False))
    long_engine.reset()
    progress_calls(long_engine, LONG_PROMPT, "off")
    plain, _ = progress_calls(long_engine, follow, "off")
    long_engine.reset()
    progress_calls(long_engine, LONG_PROMPT, "lookup")
    spec, spec_mode = progress_calls(long_engine, follow, "lookup")
    assert spec_mode == "lookup"
    assert plain[0][0] > 0 and plain[-1] == (total, total)
    assert spec == plain
