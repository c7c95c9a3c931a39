"""Bad input: one `error: ...` line on stderr, exit code 2, no traceback unless --verbose.

Each case fails before a model is loaded (fast), except the prompt that overflows the context.
"""

import os
import subprocess

import pytest
from cli_helpers import TIMEOUT_S, assert_user_error, cli_env


def test_missing_gguf_file(run_cli, tmp_path):
    assert_user_error(run_cli("generate", "hi", "-m", tmp_path / "nope.gguf"), "no GGUF file")


def test_missing_model_dir(run_cli, tmp_path):
    assert_user_error(run_cli("generate", "hi", "-m", tmp_path / "no" / "such" / "dir"), "no model at")


def test_unknown_repo_offline(run_cli, tmp_path):
    env = cli_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    line = assert_user_error(run_cli("generate", "hi", "-m", "nobody-here/no-such-model", env=env))
    assert "nobody-here/no-such-model" in line and "HF_HUB_OFFLINE" in line


def test_not_a_gguf(run_cli, not_gguf):
    assert_user_error(run_cli("generate", "hi", "-m", not_gguf), "not a GGUF file")


def test_truncated_gguf(run_cli, truncated_gguf):
    assert_user_error(run_cli("generate", "hi", "-m", truncated_gguf), "truncated")


def test_unsupported_architecture(run_cli, unsupported_arch_gguf):
    line = assert_user_error(run_cli("generate", "hi", "-m", unsupported_arch_gguf), "not supported")
    assert "'mamba'" in line


@pytest.mark.parametrize("args, message", [
    (["generate", ""], "prompt is empty"),
    (["generate", "   \n  "], "prompt is empty"),
    # a flag with two names is named by both, so that the one typed is there
    (["generate", "hi", "--temperature", "-0.5"], "error: --temp/--temperature must be >= 0"),
    (["generate", "hi", "--temp", "-1"], "error: --temp/--temperature must be >= 0"),
    (["chat", "--temp", "-1"], "error: --temp/--temperature must be >= 0"),
    (["generate", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
    (["generate", "hi", "--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["generate", "hi", "--min-p", "1"], "--min-p must be in [0, 1)"),
    (["generate", "hi", "--top-k", "-3"], "--top-k must be"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["generate", "hi", "-n", "0"], "error: -n/--max-tokens must be"),
    (["generate", "hi", "--stop", ""], "non-empty"),
    (["generate", "hi", "--system", "Be brief.", "--no-chat-template"], "--system needs the chat template"),
    (["chat", "--top-p", "2"], "--top-p must be in (0, 1]"),
    (["generate", "hi", "--spec", "lookup", "--draft-model", "/missing"], "--spec lookup uses no --draft-model"),
    (["generate", "hi", "--speculative", "lookup", "--draft-model", "/missing"], "--spec lookup uses no --draft-model"),
    (["chat", "--spec", "off", "--draft-model", "/missing"], "--spec off uses no --draft-model"),
    (["bench", "--spec", "off", "--spec", "lookup", "--draft-model", "/missing"], "--draft-model needs a --spec that uses it"),
])
def test_bad_flags_fail_before_loading(run_cli, args, message):
    proc = run_cli(*args, "-m", "/definitely/not/here.gguf")  # the flag check comes first
    assert_user_error(proc, message)


def test_empty_prompt_from_stdin(run_cli):
    assert_user_error(run_cli("generate", "-", input="\n"), "prompt is empty: stdin held no text")


def test_verbose_shows_the_traceback(run_cli, tmp_path):
    proc = run_cli("generate", "hi", "-m", tmp_path / "nope.gguf", "--verbose")
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ModelNotFoundError" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: no GGUF file")


def test_convert_into_non_empty_dir_fails_cleanly(run_cli, truncated_gguf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_user_error(run_cli("convert", truncated_gguf, out), "not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"


def test_convert_bad_file_leaves_nothing(run_cli, not_gguf, unsupported_arch_gguf, tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    assert_user_error(run_cli("convert", not_gguf, parent / "a"), "not a GGUF file")
    assert_user_error(run_cli("convert", unsupported_arch_gguf, parent / "b"), "not supported")
    assert_user_error(run_cli("convert", tmp_path / "missing.gguf", parent / "c"), "no GGUF file")
    assert list(parent.iterdir()) == []  # no half-written or temporary directory


def test_prompt_longer_than_the_context_window(run_cli):
    """The prompt is checked before the speculative measurements (cost curve, drafter prior), so the
    error is the only line even when the measurement cache is empty."""
    assert run_cli("generate", "hi", "-n", "1", "--spec", "off").returncode == 0  # the model converted once
    # SmolLM2's window is 8192 tokens; the prompt comes through stdin.
    proc = run_cli("generate", "-", "-n", "4", input="word " * 9000)
    line = assert_user_error(proc, "context window")
    assert "8192" in line


def test_prompt_that_is_not_utf8_is_a_one_line_error(run_cli, mlx_infer_bin):
    """Bytes that are not UTF-8 (a Latin-1 argument, or stdin) reach Python as lone surrogates, which the
    tokenizer refuses with a TypeError: one line instead. In chat the session goes on to the next line."""
    latin1 = os.fsdecode(b"caf\xe9 au lait")
    assert run_cli("generate", "hi", "-n", "1", "--spec", "off").returncode == 0  # the model converted once
    assert_user_error(run_cli("generate", latin1, "-n", "2", "--spec", "off"), "not valid UTF-8")
    proc = subprocess.run([mlx_infer_bin, "chat", "-n", "3", "--spec", "off"], input=b"caf\xe9\nName a fruit.\n",
                          capture_output=True, env=cli_env(), timeout=TIMEOUT_S)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "not valid UTF-8" in err and "Traceback" not in err
    assert proc.stdout.strip()  # the second line was answered


def test_unknown_spec_mode_is_a_one_line_error(run_cli):
    assert_user_error(run_cli("generate", "hi", "--spec", "nonsense"), "--spec must be one of")


def test_max_draft_above_the_verify_width_is_said():
    """--max-draft above what one verify takes (MAX_VERIFY_WIDTH - 1 = 15 drafts) is capped there by the
    loop; the flag says so instead of taking 99 silently. 15 and auto say nothing."""
    import warnings

    from mlx_infer.cli.options import spec_kwargs

    with pytest.warns(UserWarning, match=r"--max-draft 99: at most 15 draft tokens are verified per round; drafting 15"):
        assert spec_kwargs("lookup", None, "99")["max_draft"] == 99
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spec_kwargs("lookup", None, "15")["max_draft"] == 15
        assert spec_kwargs("lookup", None, "auto")["max_draft"] == "auto"


def test_stop_flag_understands_backslash_escapes():
    from mlx_infer.cli.options import unescape

    assert unescape(r"\n\n") == "\n\n"
    assert unescape(r"a\tb\\n") == "a\tb\\n"
    assert unescape("plain") == "plain"


def test_top_k_above_the_vocabulary_is_a_one_line_error(run_cli):
    """Needs the engine to call SamplingParams.for_vocab: before, this failed inside mlx-lm's sampler
    (and the handler of unexpected errors failed too). SmolLM2's vocabulary is 49152 tokens."""
    proc = run_cli("generate", "hi", "--top-k", "49153", "--temp", "0.7", "-n", "2", "--spec", "off")
    assert_user_error(proc, "vocabulary size (49152)")


def test_top_k_equal_to_the_vocabulary_keeps_all(run_cli):
    proc = run_cli("generate", "hi", "--top-k", "49152", "--temp", "0.7", "-n", "2", "--spec", "off")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
