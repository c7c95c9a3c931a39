"""`mlx-infer generate --spec lookup` under `mlx.launch -n 2 --backend ring` on 127.0.0.1 (the default model):
rank 0 drafts by prompt lookup and verifies, every rank runs each verify forward. Greedy: the same tokens as
plain lockstep decoding, in both modes (pipeline: each row of a verify forward is what a one-token step
computes; tensor: the same all_sums per row), with draft tokens accepted (a prompt the answer copies from); a
sampled run ends at the requested token count with drafts verified (exact speculative sampling's path);
`chat --spec lookup` answers as the one-process chat, `serve --spec lookup` as one process's `generate`."""

import json
import signal
import urllib.request

import openai
import pytest

from gguf_factory import Q, tiny_gguf
from launch_helpers import TIMEOUT_S, launch, mlx_launch
from test_sharded_chat_serve import Launched, _errors, _free_port, _one_process

pytestmark = pytest.mark.skipif(mlx_launch() is None, reason="mlx.launch (the mlx package's launcher) is missing")

#: The answer repeats the prompt's sentence, so prompt lookup's drafts are accepted.
COPY = ("Repeat the following sentence word for word, twice: The quick brown fox jumps over the lazy dog near the "
        "river bank.")


def _generate(args):
    """rank 0's --json answer of `mlx-infer generate ARGS --json` under mlx.launch -n 2 (one line: rank 1 prints
    nothing)."""
    proc = launch(["-m", "mlx_infer", "generate", *args, "--json"], script=None)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0])


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_greedy_lookup_equals_plain(parallel):
    args = [COPY, "--max-tokens", "40", "--parallel", parallel]
    plain = _generate([*args, "--spec", "off"])
    spec = _generate([*args, "--spec", "lookup"])
    assert spec["parallel"] == parallel and spec["ranks"] == 2
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    stats = spec["stats"]
    assert stats["spec_mode"] == "lookup" and stats["accepted"] > 0 and stats["tau"] > 1.0
    assert stats["rounds"] < len(spec["token_ids"]) - 1  # fewer decode forwards than tokens after the first
    assert "tau" not in plain["stats"]


def test_sampled_lookup_reaches_max_tokens():
    out = _generate(["Write a long story about a lighthouse keeper and the lighthouse.", "--max-tokens", "24",
                     "--temp", "0.8", "--seed", "3", "--spec", "lookup", "--parallel", "pipeline"])
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 24
    assert out["stats"]["generated_tokens"] == 24 and out["stats"]["drafted"] > 0


def test_chat_lookup_two_turns_equal_one_process():
    """`chat --spec lookup` under mlx.launch (pipeline): rank 0's answers to two piped turns equal the
    one-process chat's plain greedy answers (dense KV cache, --spec off); the followers run each request's
    rounds from SPEC_REQUEST; --stats reports the drafter and tau."""
    turns = [COPY, "Say it once more."]
    args = ["chat", "--max-tokens", "40"]
    expected = _one_process([*args, "--kv-cache", "dense", "--spec", "off"], "\n".join(turns) + "\n")
    assert len(expected.splitlines()) == 2 and expected.strip()
    job = Launched([*args, "--parallel", "pipeline", "--spec", "lookup", "--stats"])
    job.write("\n".join(turns) + "\n/exit\n")
    out, err = job.wait()
    assert out == expected, err
    assert not _errors(err), err
    assert err.count("spec lookup: tau") == 2, err


def test_serve_lookup_equals_one_process(tmp_path):
    """`serve --spec lookup` under mlx.launch (tensor parallel, the tiny Q8_0 llama): a chat completion and a
    streamed one through the `openai` client equal one process's plain greedy `generate`; /metrics counts the
    speculative requests' tau."""
    path, _, _ = tiny_gguf(tmp_path / "llama-q8.gguf", "llama", Q.Q8_0, seed=3, layers=4)
    model = str(path)
    want = json.loads(_one_process(["generate", "hello there", "--model", model, "--max-tokens", "12", "--json"]))
    port = _free_port()
    job = Launched(["serve", "--model", model, "--port", str(port), "--parallel", "tensor", "--spec", "lookup"])
    url = f"http://127.0.0.1:{port}"
    try:
        job.wait_healthy(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT_S)
        messages = [{"role": "user", "content": "hello there"}]
        got = client.chat.completions.create(model="llama-q8", messages=messages, max_tokens=12, temperature=0)
        assert got.choices[0].message.content == want["text"]
        assert got.choices[0].finish_reason == want["finish_reason"]
        chunks = client.chat.completions.create(model="llama-q8", messages=messages, max_tokens=12, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["text"]
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert 'mlx_infer_speculative_tau_count{model="llama-q8"} 2.0' in metrics, metrics
    finally:
        job.stop(signal.SIGINT)
        try:
            job.proc.wait(60)
        finally:
            job.stop()
