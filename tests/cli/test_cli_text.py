"""What `mlx-infer generate` prints is the decoded text of its tokens: a raw completion keeps the
space that separates it from its prompt ('The capital of France is' + ' Paris.')."""

import json

from mlx_infer.loading.gguf import open_gguf, read_fields
from mlx_infer.loading.gguf_tokenizer import build_tokenizer

PROMPT = "The capital of France is"


def test_raw_completion_is_the_decoded_tokens(run_cli, default_gguf):
    """Needs the engine to stream through mlx_infer.generation.detokenize.make_detokenizer."""
    args = ("generate", PROMPT, "--no-chat-template", "-n", "6", "--spec", "off")
    as_json = run_cli(*args, "--json")
    streamed = run_cli(*args)
    assert as_json.returncode == 0 and streamed.returncode == 0, as_json.stderr + streamed.stderr
    out = json.loads(as_json.stdout)
    tokenizer = build_tokenizer(read_fields(open_gguf(default_gguf)))
    assert out["text"] == tokenizer.decode(out["token_ids"])
    assert out["text"].startswith(" ")  # the first token's own leading space
    assert streamed.stdout == out["text"] + ("" if out["text"].endswith("\n") else "\n")
