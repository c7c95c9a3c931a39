"""An internal error (a bug, not bad input): one `error:` line naming the exception and pointing at
--verbose, exit code 1; --verbose prints the traceback first. Warnings are one `warning:` line."""

import subprocess
import tempfile
import sys

import pytest
from cli_helpers import TIMEOUT_S, cli_env

import mlx_infer  # noqa: F401  (first: the optimized BLAS is picked before mlx.core loads)
from mlx_infer.cli import app as cli_app
from mlx_infer.cli import doctor as cli_doctor

#: Runs the real entry point with `doctor`'s data collection replaced by one that fails (a stand-in
#: for any bug inside a command); the arguments after -c are the command line.
BROKEN_DOCTOR = """
import sys
import warnings
import mlx_infer.cli.doctor as doctor
from mlx_infer.cli.app import main

def collect():
    warnings.warn("a first line\\nand a second line of a warning")
    raise RuntimeError("the doctor broke")

doctor.collect = collect
main()
"""


def run_broken(*args):
    """Run the broken doctor in a fresh interpreter, from a folder outside the checkout (so that `-c` finds
    the installed package, not the source tree's mlx_infer/, which has no cli/ inside)."""
    return subprocess.run([sys.executable, "-c", BROKEN_DOCTOR, *args], capture_output=True, text=True,
                          env=cli_env(), timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir())


def test_internal_error_is_one_line_and_exit_1():
    proc = run_broken("doctor")
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == ["warning: a first line and a second line of a warning",
                     "error: internal error (RuntimeError): the doctor broke; --verbose shows the traceback"]


def test_internal_error_with_verbose_shows_the_traceback():
    proc = run_broken("doctor", "--verbose")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    assert "RuntimeError: the doctor broke" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: internal error (RuntimeError): the doctor broke"


def test_an_error_outside_any_command_is_one_line(monkeypatch, capsys):
    """What escapes the commands' own handling (typer, a callback) still ends in one line, exit 1
    (the handler itself failed here before: typer 0.29 has no `_click.exceptions.Abort`)."""
    def broken(**kwargs):
        raise KeyError("no such thing")

    monkeypatch.setattr(cli_app, "app", broken)
    with pytest.raises(SystemExit) as info:
        cli_app.main()
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert err == "error: internal error (KeyError): 'no such thing'; --verbose shows the traceback\n"


def test_abort_exits_1_quietly(monkeypatch, capsys):
    def aborted(**kwargs):
        raise cli_app.typer.Abort()

    monkeypatch.setattr(cli_app, "app", aborted)
    with pytest.raises(SystemExit) as info:
        cli_app.main()
    assert info.value.code == 1
    assert capsys.readouterr().err == ""


def test_user_errors_still_exit_2(monkeypatch, tmp_path, capsys):
    """Bad input inside a command keeps its own line and code (not reported as a bug)."""
    def collect():
        raise mlx_infer.MlxInferError("the cache is a file; remove it")

    monkeypatch.setattr(cli_doctor, "collect", collect)
    monkeypatch.setattr(sys, "argv", ["mlx-infer", "doctor"])
    with pytest.raises(SystemExit) as info:
        cli_app.main()
    assert info.value.code == 2
    assert capsys.readouterr().err == "error: the cache is a file; remove it\n"
