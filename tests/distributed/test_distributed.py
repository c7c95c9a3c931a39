"""One model over 2 ranks of `mlx.launch -n 2 --backend ring` on 127.0.0.1, against one process.

Pipeline parallel: each layer computes what it computes in one process on the same inputs (send / recv copy
the bytes), so the greedy tokens and the logits are bit-identical. Tensor parallel: each rank's products
sum over its slice of the input features and the all_sum adds the slices (rank 0's partial sum holding the
residual), a float order other than one product's, so the logits differ in the last bits: they are held to
LOGIT_ATOL (measured: 3e-5 on the default model, logits up to ~35), the greedy tokens to equality on the test
prompts. On every rank the tokens and logits are the same (rank 0 decides each token; the all_sum gives
every rank the same sum).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gguf_factory import Q, tiny_gguf
from launch_helpers import TIMEOUT_S, launch, mlx_launch, one_process, result

pytestmark = pytest.mark.skipif(mlx_launch() is None, reason="mlx.launch (the mlx package's launcher) is missing")

#: Tensor parallel's logits against one process: absolute, on logits of magnitude ~10-35 (see the docstring).
LOGIT_ATOL = 1e-3
TOKENS = 10


def _run_pair(tmp_path, model, parallel, prompt=None, layers="kernels"):
    """(one process's result, [rank 0's, rank 1's]) of rank_script on `model`."""
    args = [str(TOKENS), json.dumps(prompt), layers]
    one = one_process([str(tmp_path / "one"), model, "auto", *args])
    assert one.returncode == 0, one.stderr
    proc = launch([str(tmp_path / "two"), model, parallel, *args])
    assert proc.returncode == 0 and (tmp_path / "two" / "rank1.json").exists(), proc.stderr
    return result(tmp_path / "one", 0), [result(tmp_path / "two", r) for r in (0, 1)]


def _same_on_every_rank(ranks):
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert np.array_equal(ranks[0]["logits"], ranks[1]["logits"])


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory):
    """A tiny llama GGUF (4 query / 2 KV heads, 4 layers) with Q8_0 weights: the CPU kernel layers run it."""
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama-q8.gguf", "llama", Q.Q8_0, seed=3, layers=4)
    return str(path)


def test_pipeline_default_model_is_bit_identical(tmp_path):
    one, ranks = _run_pair(tmp_path, "default", "pipeline")
    assert [r["detail"] for r in ranks] == ["layers 0-14 of 30", "layers 15-29 of 30"]
    assert ranks[0]["tokens"] == one["tokens"] and len(one["tokens"]) == TOKENS
    assert np.array_equal(ranks[0]["logits"], one["logits"])
    _same_on_every_rank(ranks)


def test_tensor_default_model_uneven_heads(tmp_path):
    """9 query / 3 KV heads over 2 ranks: 1 + 2 KV heads (3 + 6 query heads), the MLP's rows halved."""
    one, ranks = _run_pair(tmp_path, "default", "tensor")
    assert ranks[0]["detail"].startswith("query heads 0-2 of 9") and ranks[1]["detail"].startswith("query heads 3-8")
    assert ranks[0]["tokens"] == one["tokens"]
    np.testing.assert_allclose(ranks[0]["logits"], one["logits"], rtol=0, atol=LOGIT_ATOL)
    assert (ranks[0]["logits"].argmax(-1) == one["logits"].argmax(-1)).all()
    _same_on_every_rank(ranks)


@pytest.mark.parametrize("parallel,layers", [("tensor", "kernels"), ("tensor", "mlx"), ("pipeline", "kernels")])
def test_tiny_quantized_llama(tmp_path, tiny_q8, parallel, layers):
    prompt = [5, 17, 33, 8, 60, 2, 41]
    one, ranks = _run_pair(tmp_path, tiny_q8, parallel, prompt, layers)
    assert ranks[0]["parallel"] == parallel
    assert ranks[0]["tokens"] == one["tokens"]
    if parallel == "pipeline":
        assert np.array_equal(ranks[0]["logits"], one["logits"])
    else:
        np.testing.assert_allclose(ranks[0]["logits"], one["logits"], rtol=0, atol=LOGIT_ATOL)
    _same_on_every_rank(ranks)


def test_auto_picks_tensor_for_even_heads_pipeline_otherwise(tmp_path, tiny_q8):
    proc = launch([str(tmp_path / "tiny"), tiny_q8, "auto", "2", json.dumps([5, 6])])
    assert proc.returncode == 0, proc.stderr
    assert result(tmp_path / "tiny", 0)["parallel"] == "tensor"  # 4 / 2 heads over 2 ranks


def test_tiny_qwen3_tensor(tmp_path):
    """qwen3: q / k norms per head, tied embeddings, float weights (MLX's products)."""
    path, _, _ = tiny_gguf(tmp_path / "qwen3.gguf", "qwen3", Q.F32, seed=5)
    one, ranks = _run_pair(tmp_path, str(path), "tensor", [3, 9, 27, 4])
    assert ranks[0]["tokens"] == one["tokens"]
    np.testing.assert_allclose(ranks[0]["logits"], one["logits"], rtol=0, atol=LOGIT_ATOL)


def _one_error_line(proc) -> str:
    """The error line of the job: exactly one, from rank 0 (the others stay quiet), no traceback. (mlx.launch
    itself exits 0 whatever its ranks did, and MLX's ring backend writes its own notes to stderr.)"""
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_mismatched_files_one_line_every_rank_exits(tmp_path):
    tiny_gguf(tmp_path / "m0.gguf", "llama", Q.F32, seed=1)
    tiny_gguf(tmp_path / "m1.gguf", "llama", Q.F32, seed=2)  # same shapes, other weights
    proc = launch([str(tmp_path / "out"), str(tmp_path / "m%r.gguf"), "auto"])
    line = _one_error_line(proc)
    assert "model files differ between ranks (rank 1 against rank 0)" in line, line
    assert not (tmp_path / "out").exists()  # no rank went on


def test_heads_that_do_not_split(tmp_path):
    path, _, _ = tiny_gguf(tmp_path / "mqa.gguf", "llama", Q.F32, seed=1, kv_heads=1)
    proc = launch([str(tmp_path / "out"), str(path), "tensor"])
    line = _one_error_line(proc)
    assert "needs at least 2 KV heads" in line and "--parallel pipeline" in line, line
    assert not (tmp_path / "out").exists()


def test_rank_killed_mid_request_ends_the_job_with_one_error(tmp_path, tiny_q8):
    """Rank 1 exits abruptly after 3 tokens; rank 0 is waiting in the next step's collective: its backend
    fails the step (the peer's socket closed) or mlx.launch terminates it; either way one error line from
    rank 0, and the job ends (the subprocess limit is only there to fail a hang)."""
    proc = launch([str(tmp_path / "out"), tiny_q8, "tensor", "64", json.dumps([5, 6, 7])],
                  env={"KILL_RANK": "1", "KILL_AFTER": "3"})
    line = _one_error_line(proc)
    assert line.startswith("error: rank 0: "), line
    assert "lost" in line or "stopped by mlx.launch" in line, line
    assert not (tmp_path / "out" / "rank0.json").exists()


def _cli(args, env=None):
    """`mlx-infer ARGS` under mlx.launch -n 2 (the installed command's module, through --python)."""
    return launch(["-m", "mlx_infer", *args], env=env, script=None)


def test_cli_generate_under_launch_matches_one_process(tmp_path, tiny_q8):
    """`mlx-infer generate --json` under mlx.launch prints one answer (rank 0's), the same greedy tokens as
    one process, for both modes."""
    args = ["generate", "hello world", "--model", tiny_q8, "--max-tokens", "8", "--no-chat-template", "--json"]
    plain = subprocess.run([sys.executable, "-m", "mlx_infer", *args], capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert plain.returncode == 0, plain.stderr
    expected = json.loads(plain.stdout)["token_ids"]
    for parallel in ("tensor", "pipeline"):
        proc = _cli([*args, "--parallel", parallel])
        lines = proc.stdout.strip().splitlines()
        assert len(lines) == 1, proc.stdout + proc.stderr  # rank 1 printed nothing
        out = json.loads(lines[0])
        assert out["parallel"] == parallel and out["ranks"] == 2 and out["backend"] == "ring"
        assert out["token_ids"] == expected


def test_cli_bad_parallel_one_line(tmp_path, tiny_q8):
    proc = _cli(["generate", "hi", "--model", tiny_q8, "--parallel", "diagonal"])
    assert "unknown --parallel 'diagonal'" in _one_error_line(proc)


def test_doctor_reports_the_group(tmp_path):
    proc = _cli(["doctor", "--json"])
    reports = [json.loads(chunk) for chunk in _json_objects(proc.stdout)]
    groups = sorted((r["distributed"]["rank"], r["distributed"]["size"], r["distributed"]["backend"]) for r in reports)
    assert groups == [(0, 2, "ring"), (1, 2, "ring")], proc.stdout + proc.stderr
    assert all(len(r["distributed"]["hosts"]) == 2 for r in reports)


def _json_objects(text: str):
    """The top-level JSON objects of `text` (each rank's doctor --json, one after the other)."""
    decoder, i, out = json.JSONDecoder(), 0, []
    while True:
        i = text.find("{", i)
        if i < 0:
            return out
        obj, end = decoder.raw_decode(text, i)
        out.append(json.dumps(obj))
        i = end


def test_rank_that_stops_answering_ends_the_job_after_the_step_timeout(tmp_path, tiny_q8):
    """Rank 1 stops answering after 3 tokens with its sockets open (no error reaches rank 0's backend): rank
    0's watchdog ends it after MLX_INFER_DIST_TIMEOUT seconds of one step (far above a step of this tiny
    model), with one line; mlx.launch then stops rank 1, quietly."""
    proc = launch([str(tmp_path / "out"), tiny_q8, "pipeline", "64", json.dumps([5, 6, 7])],
                  env={"HANG_RANK": "1", "KILL_AFTER": "3", "MLX_INFER_DIST_TIMEOUT": "30"})
    line = _one_error_line(proc)
    assert line.startswith("error: rank 0: decode step 3 did not finish within 30 s: a rank stopped answering"), line
    assert not (tmp_path / "out" / "rank0.json").exists()


def test_cli_prompt_from_stdin_is_refused_not_a_hang(tiny_q8):
    """mlx.launch passes stdin on but never its end: `generate -` would wait forever; it is one error line."""
    proc = _cli(["generate", "-", "--model", tiny_q8, "--max-tokens", "4"])
    assert "the prompt cannot come from stdin" in _one_error_line(proc)
