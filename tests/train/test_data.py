"""Prompt files: text paragraphs / lines, JSONL chat prompts, and the errors of bad input."""

import pytest

from mlx_infer.errors import MlxInferError
from mlx_infer.train.data import TrainSequence, load_sequences, read_prompts, save_sequences


def test_text_paragraphs(tmp_path):
    p = tmp_path / "wiki.txt"
    p.write_text(" = Heading = \n\n The first paragraph ,\n continued ( 3 @.@ 5 in ) .\n\n\n Second one . " + "x" * 50 + "\n")
    assert read_prompts(p) == ["The first paragraph, continued (3.5 in).", "Second one. " + "x" * 50]
    long = tmp_path / "long.txt"
    long.write_text(("A sentence here. " * 100) + "\n\nshort\n")
    first = read_prompts(long, max_chars=100)[0]
    assert len(first) <= 100 and first.endswith(".")


def test_text_lines_without_blank_lines(tmp_path):
    p = tmp_path / "lines.txt"
    p.write_text("one prompt\nanother prompt\n")
    assert read_prompts(p) == ["one prompt", "another prompt"]


def test_jsonl(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text('{"prompt": "Hi"}\n\n{"messages": [{"role": "user", "content": "Q"}, '
                 '{"role": "assistant", "content": "A"}]}\n')
    assert read_prompts(p) == ["Hi", [{"role": "user", "content": "Q"}]]


@pytest.mark.parametrize("name,text,match", [
    ("empty.txt", "\n\n  \n", "no prompt"),
    ("heads.txt", " = Only = \n\n = Headings = \n", "no prompt"),
    ("bad.jsonl", "{not json}\n", r"bad.jsonl:1: not JSON"),
    ("odd.jsonl", '{"text": "x"}\n', "expected"),
    ("msg.jsonl", '{"messages": [{"role": "user"}]}\n', "content"),
])
def test_bad_files(tmp_path, name, text, match):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(MlxInferError, match=match):
        read_prompts(p)


def test_missing_file(tmp_path):
    with pytest.raises(MlxInferError, match="no data file"):
        read_prompts(tmp_path / "absent.txt")


def test_sequences_round_trip(tmp_path):
    seqs = [TrainSequence([1, 2, 3], 1), TrainSequence([4, 5], 2)]
    save_sequences(tmp_path / "s.jsonl", seqs)
    assert load_sequences(tmp_path / "s.jsonl") == seqs
    (tmp_path / "bad.jsonl").write_text('{"tokens": [1]}\n')
    with pytest.raises(MlxInferError, match="not a training sequence"):
        load_sequences(tmp_path / "bad.jsonl")


def test_regenerate_batched_equals_one_by_one(tiny_engine):
    """Batched answers (left-padded batches of 2) are the engine's own greedy answers, prompt by prompt,
    with the stopping EOS kept; a prompt that cannot fit prompt + answer is refused up front."""
    from mlx_infer.errors import MlxInferError
    from mlx_infer.train.data import regenerate

    prompts = ["the quick brown fox", "hello world, hello there, hello again", "one two three"]
    seqs = regenerate(tiny_engine, prompts, 12, batch_size=2)
    assert len(seqs) == 3
    eos = set(tiny_engine.tokenizer.eos_token_ids)
    for prompt, seq in zip(prompts, seqs):
        ids = tiny_engine.encode(prompt)
        alone = tiny_engine.generate(ids, max_tokens=12, temperature=0.0)
        assert seq.tokens[: seq.start] == list(ids)
        answer = seq.tokens[seq.start:]
        if alone.finish_reason == "stop":
            assert answer[-1] in eos and answer[:-1] == list(alone.token_ids)
        else:
            assert answer == list(alone.token_ids)
    with pytest.raises(MlxInferError, match="does not fit the context window"):
        regenerate(tiny_engine, prompts[:1], tiny_engine.context_length)
