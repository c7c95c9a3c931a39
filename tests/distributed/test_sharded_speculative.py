"""`mlx-infer generate --spec lookup` under `mlx.launch -n 2 --backend ring` on 127.0.0.1 (the default model):
rank 0 drafts by prompt lookup and verifies, every rank runs each verify forward. Greedy: the same tokens as
plain lockstep decoding, in both modes (pipeline: each row of a verify forward is what a one-token step
computes; tensor: the same all_sums per row), with draft tokens accepted (a prompt the answer copies from); a
sampled run ends at the requested token count with drafts verified (exact speculative sampling's path);
`chat --spec lookup` answers as the one-process chat."""

import json

import pytest

from launch_helpers import launch, mlx_launch
from test_sharded_chat_serve import Launched, _errors, _one_process

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
