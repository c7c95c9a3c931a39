"""`--help`, `--version` and usage errors answer before the heavy imports (issue 52, defect 8: every command
paid 4-7 s of imports, MLX, mlx-lm and transformers, before even a bad flag's one-line error). Checked by what
the interpreter has imported when the command has answered, not by timing."""

import json
import subprocess
import sys
import tempfile

import pytest
from cli_helpers import TIMEOUT_S, cli_env

#: What no answer below may import: MLX, mlx-lm (which imports transformers), transformers, the engine.
HEAVY = ("mlx", "mlx.core", "mlx_lm", "transformers", "mlx_infer.engine")

#: The real entry point with a command line; prints the heavy modules imported by the time it answered.
RUN = """
import json, sys
from mlx_infer.cli.app import main
sys.argv = ["mlx-infer", *sys.argv[1:]]
try:
    main()
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def answer(*args):
    """(exit code, heavy modules imported, stdout, stderr but the last line) of `mlx-infer *args`, from a
    folder outside the checkout (so that the installed package is imported, as the command does)."""
    proc = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, env=cli_env(),
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    *err, last = proc.stderr.strip().splitlines()
    seen = json.loads(last)
    return seen["code"], seen["heavy"], proc.stdout, "\n".join(err)


def test_version_imports_nothing_heavy():
    code, heavy, out, _ = answer("--version")
    assert (code, heavy) == (0, [])
    assert out.strip() == "mlx-infer 0.1.0"


@pytest.mark.parametrize("args, shown", [
    ((), "generate"),
    (("--help",), "serve"),
    (("generate", "--help"), "--spec"),
    (("chat", "--help"), "--kv-cache"),
    (("serve", "--help"), "--no-access-log"),
    (("bench", "--help"), "--concurrency"),
    (("doctor", "--help"), "--json"),
    (("convert", "--help"), "OUT_DIR"),
    (("train-drafter", "--help"), "--kind"),
])
def test_help_imports_nothing_heavy(args, shown):
    code, heavy, out, _ = answer(*args)
    assert (code, heavy) == (0 if args else 2, [])  # no arguments: the help, as click exits (2)
    assert shown in out


@pytest.mark.parametrize("args, error", [
    (("generate", "hi", "--bogus"), "No such option: --bogus"),
    (("serve", "--port", "x"), "Invalid value for '--port'"),
    (("nonsense",), "No such command 'nonsense'"),
    (("chat", "--max-tokens"), "Option '--max-tokens' requires an argument"),
])
def test_usage_errors_import_nothing_heavy(args, error):
    code, heavy, out, err = answer(*args)
    assert (code, heavy) == (2, [])
    assert out == "" and error in err and err.startswith("error: ")


def test_a_command_still_loads_the_library():
    """The deferred imports happen when a command runs: doctor reports MLX's version (and so imported it)."""
    code, heavy, out, _ = answer("doctor", "--json")
    assert code == 0 and "mlx.core" in heavy
    assert json.loads(out)["mlx_version"]
