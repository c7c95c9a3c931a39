"""The command line without a model: help, version, usage errors, `python -m mlx_infer`."""

import subprocess
import sys

from conftest import cli_env

import mlx_infer


def test_help_lists_commands(run_cli):
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("generate", "chat", "doctor", "convert"):
        assert command in proc.stdout


def test_generate_help_lists_flags(run_cli):
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0, proc.stderr
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--top-k", "--min-p", "--seed",
                 "--repetition-penalty", "--stop", "--system", "--no-chat-template", "--weights", "--json",
                 "--stats", "--verbose"):
        assert flag in proc.stdout, flag


def test_version(run_cli):
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mlx-infer {mlx_infer.__version__}"


def test_python_dash_m_runs_the_same_app(tmp_path):
    # Run outside the checkout: `python -m` puts the working directory first on sys.path, and the source
    # tree keeps the CLI in cli/, which only the installed package maps to mlx_infer.cli.
    proc = subprocess.run([sys.executable, "-m", "mlx_infer", "--version"], capture_output=True, text=True,
                          env=cli_env(), timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mlx-infer {mlx_infer.__version__}"


def test_usage_errors_exit_2(run_cli):
    bad_choice = run_cli("generate", "hi", "--weights", "bogus")
    assert bad_choice.returncode == 2
    assert "--weights" in bad_choice.stderr and bad_choice.stdout == ""
    assert run_cli("no-such-command").returncode == 2
    assert run_cli("generate").returncode == 2  # missing PROMPT
    not_a_number = run_cli("generate", "hi", "--temperature", "warm")
    assert not_a_number.returncode == 2 and "Traceback" not in not_a_number.stderr
