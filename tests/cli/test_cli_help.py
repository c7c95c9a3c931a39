"""The command line without a model: help, version, usage errors, `python -m mlx_infer`."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from cli_helpers import assert_user_error, cli_env

import mlx_infer
from mlx_infer.speculative import MODES

REPO = Path(__file__).resolve().parents[2]


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


def test_help_paragraphs_wrap_at_the_terminal_width(run_cli):
    """A docstring's paragraphs after the first reach the terminal as one line each: at 300 columns a
    sentence that the source breaks across lines stays whole, and at 60 columns no line is wider."""
    wide = run_cli("serve", "--help", env=cli_env(COLUMNS="300"))
    assert wide.returncode == 0, wide.stderr
    assert "--kv-budget bounds its memory: a request waits while the budget is full" in wide.stdout
    narrow = run_cli("serve", "--help", env=cli_env(COLUMNS="60"))
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 60


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


def test_python_dash_m_from_a_checkout_that_is_not_installed():
    """From a source checkout without the package installed, `python -m mlx_infer` finds the CLI in cli/.

    `python -S` skips site-packages' .pth files, so the editable install's import hook (which maps
    mlx_infer.cli to cli/) is gone, while site-packages on PYTHONPATH still gives the dependencies:
    what a clone with only the dependencies installed sees."""
    site = sysconfig.get_paths()
    env = cli_env(PYTHONPATH=os.pathsep.join([str(REPO), site["purelib"], site["platlib"]]))

    def run(*args):
        return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True, env=env,
                              timeout=120, cwd=REPO, stdin=subprocess.DEVNULL)

    not_installed = run("-c", "import mlx_infer.cli")
    assert not_installed.returncode != 0 and "No module named 'mlx_infer.cli'" in not_installed.stderr
    proc = run("-m", "mlx_infer", "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mlx-infer {mlx_infer.__version__}"
    helped = run("-m", "mlx_infer", "bench", "--help")
    assert helped.returncode == 0 and "--spec" in helped.stdout, helped.stderr


def test_bench_help_names_the_spec_modes(run_cli):
    proc = run_cli("bench", "--help")
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.lstrip("│ ").startswith("--spec "))
    assert "list[str]" not in proc.stdout and "MODE" in line
    assert ", ".join(MODES) in " ".join(proc.stdout.replace("│", " ").split())


def test_usage_errors_are_one_line_and_exit_2(run_cli):
    """Usage errors (click's own checks) read like every other bad input: one `error:` line, exit 2."""
    cases = [(("generate", "hi", "--weights", "bogus"), "--weights"), (("no-such-command",), "no-such-command"),
             (("generate",), "PROMPT"), (("generate", "hi", "--temperature", "warm"), "--temperature"),
             (("generate", "hi", "--max-tokens", "abc"), "--max-tokens"), (("generate", "hi", "--bogus"), "--bogus")]
    for args, mentioned in cases:
        proc = run_cli(*args)
        assert_user_error(proc)
        assert mentioned in proc.stderr and "--help" in proc.stderr, proc.stderr
        assert "Value error" not in proc.stderr, proc.stderr  # no validator's wording


def test_no_arguments_prints_the_help(run_cli):
    proc = run_cli()
    assert "generate" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr


def test_bench_names_the_bad_count(run_cli):
    """bench's --trials and --max-tokens below 1: one error line naming the flag and the value given."""
    for flag, value in (("--trials", "0"), ("--max-tokens", "-2")):
        proc = run_cli("bench", flag, value)
        assert_user_error(proc)
        assert f"{flag} must be >= 1, got {value}" in proc.stderr, proc.stderr
