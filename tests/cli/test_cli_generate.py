"""`mlx-infer generate` on the embedded default model (SmolLM2-135M-Instruct Q4_1), greedy."""

import json
import re
import signal
import subprocess
import threading
import time

import pytest
from cli_helpers import cli_env
from gguf_factory import TinySpec, random_weights, write_gguf

QUESTION = "What is the capital of France?"
STATS_LINE = re.compile(r"prompt (\d+) tok, generated (\d+) tok \| TTFT [\d.]+ s .*decode [\d.]+ tok/s \| peak memory")


def test_generate_names_paris_and_keeps_stats_off_stdout(run_cli):
    proc = run_cli("generate", QUESTION, "-n", "16", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert proc.stdout.endswith("\n")
    assert "tok/s" not in proc.stdout and "peak memory" not in proc.stdout
    match = STATS_LINE.search(proc.stderr)
    assert match, proc.stderr
    assert int(match.group(1)) > 5 and 1 <= int(match.group(2)) <= 16


def test_json_output_is_one_object_with_the_fields(run_cli):
    proc = run_cli("generate", QUESTION, "-n", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # nothing else on stdout
    out = json.loads(lines[0])
    assert "Paris" in out["text"]
    assert out["finish_reason"] in ("stop", "length")
    ids = out["token_ids"]
    assert ids and all(isinstance(t, int) for t in ids)
    stats = out["stats"]
    assert stats["generated_tokens"] == len(ids) <= 16
    assert stats["prompt_tokens"] > 5
    assert stats["ttft_s"] > 0 and stats["decode_tps"] > 0 and stats["peak_memory_bytes"] > 10**6


def test_prompt_from_stdin_and_stop_string(run_cli):
    proc = run_cli("generate", "-", "-n", "16", "--json", "--stop", "Paris", input=QUESTION + "\n")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    # The same greedy answer as above, cut just before the stop string.
    assert out["finish_reason"] == "stop"
    assert "Paris" not in out["text"]
    assert out["text"].startswith("The capital of France is")


def test_no_chat_template_and_system_prompt_change_the_prompt(run_cli):
    raw = run_cli("generate", "The capital of France is", "-n", "3", "--json", "--no-chat-template")
    templated = run_cli("generate", "The capital of France is", "-n", "3", "--json", "--system", "Be brief.")
    assert raw.returncode == 0 and templated.returncode == 0, raw.stderr + templated.stderr
    raw_stats, tmpl_stats = json.loads(raw.stdout)["stats"], json.loads(templated.stdout)["stats"]
    assert raw_stats["prompt_tokens"] in (5, 6)  # the bare text (and a BOS if the model adds one)
    assert tmpl_stats["prompt_tokens"] > raw_stats["prompt_tokens"] + 5


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(run_cli):
    args = ("generate", "Tell me a joke.", "-n", "8", "--json", "--temperature", "1.0", "--top-p", "0.9",
            "--seed", "7")
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0 and second.returncode == 0
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


def test_stopping_at_the_context_window_is_said(run_cli, tmp_path):
    """A tiny model with a 64-token context: a 45-token prompt and -n 100 stop at the window (finish_reason
    'length', as OpenAI's), and stderr says why the answer is shorter than -n."""
    spec = TinySpec("llama", context=64)
    model = write_gguf(tmp_path / "tiny64.gguf", spec, random_weights(spec, seed=0))
    proc = run_cli("generate", "a b c d e f g h i j k l m n o p q r s t u v w x y", "-m", model, "--no-chat-template",
                   "-n", "100", "--spec", "off", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    prompt, generated = out["stats"]["prompt_tokens"], out["stats"]["generated_tokens"]
    assert out["finish_reason"] == "length" and prompt + generated == 64 and generated < 100
    assert (f"warning: stopped at the model's context window (64 tokens: {prompt} prompt + {generated} generated), "
            "before -n 100") in proc.stderr
    short = run_cli("generate", "a b c", "-m", model, "--no-chat-template", "-n", "3", "--spec", "off")
    assert short.returncode == 0 and "context window" not in short.stderr


def test_an_empty_answer_is_said(run_cli, tmp_path):
    """A tiny model whose first token is always EOS (the blocks add nothing, every embedding's first entry is
    1, the final norm keeps only that entry and only EOS's output row reads it): nothing on stdout, and
    stderr says the answer is empty and why, instead of printing a bare newline."""
    spec = TinySpec("llama")
    weights = random_weights(spec, seed=0)
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name][:] = 0.0
    weights["model.embed_tokens.weight"][:, 0] = 1.0
    weights["model.norm.weight"][:] = 0.0
    weights["model.norm.weight"][0] = 1.0
    weights["lm_head.weight"][:] = 0.0
    weights["lm_head.weight"][spec.tokenizer.eos_id, 0] = 10.0
    model = write_gguf(tmp_path / "eos.gguf", spec, weights)
    proc = run_cli("generate", "a b c", "-m", model, "--no-chat-template", "-n", "8", "--spec", "off")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "warning: the answer is empty: the model ended it at its first token; try rephrasing the prompt" in proc.stderr
    assert "--no-chat-template for a base model" not in proc.stderr  # it is already on
    answered = run_cli("generate", "a b c", "-m", write_gguf(tmp_path / "r.gguf", spec, random_weights(spec, seed=0)),
                       "--no-chat-template", "-n", "4", "--spec", "off")
    assert answered.returncode == 0 and "answer is empty" not in answered.stderr


def test_a_stop_string_at_the_start_is_said(run_cli):
    """The greedy answer starts with "The capital of France is" (test_prompt_from_stdin_and_stop_string): a
    stop string "The" cuts all of it; stderr says so, stdout and the JSON text are empty."""
    proc = run_cli("generate", QUESTION, "-n", "8", "--stop", "The")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "warning: the answer is empty: a --stop string matched at its start" in proc.stderr
    as_json = run_cli("generate", QUESTION, "-n", "8", "--stop", "The", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["text"] == ""
    assert "a --stop string matched at its start" in as_json.stderr


def test_ctrl_c_ends_the_answers_line(mlx_infer_bin):
    """Ctrl-C mid-answer: exit code 130, stdout's partial answer ends with a newline (so that "interrupted" on
    stderr starts its own line on a terminal), one line on stderr and no traceback."""
    # SIGINT back to its default in the child (a test run started in the background inherits it ignored)
    proc = subprocess.Popen([mlx_infer_bin, "generate", "Write a very long story about a dragon.", "-n", "400",
                             "--spec", "off"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=cli_env(), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    try:
        end = time.time() + 180
        while len("".join(out).strip()) < 10 and time.time() < end and proc.poll() is None:
            time.sleep(0.05)
        assert len("".join(out).strip()) >= 10, "no answer started"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        reader.join(timeout=5)
        text, stderr = "".join(out), proc.stderr.read()
        assert text.endswith("\n") and len(text.split()) < 400
        assert stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
