"""The benchmark scripts refuse bad arguments with one line (argparse's usage error, or a SystemExit message)
before measuring anything."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script, args, message", [
    ("throughput.py", ["--prompt-tokens", "-5"], "argument --prompt-tokens: -5 is below 0"),
    ("throughput.py", ["--rounds", "0"], "argument --rounds: 0 is below 1"),
    ("throughput.py", ["--against", "no-such-ref-here", "--rounds", "1"], "not a commit of this repository"),
    ("throughput.py", ["--against=--lock", "--rounds", "1"], "not a commit of this repository"),
    ("attention.py", ["--contexts", "1,,2"], "argument --contexts: '' is not an integer"),
    ("kv_recall.py", ["--lengths", "x"], "argument --lengths: 'x' is not an integer"),
    ("ppl.py", ["--lengths", "512,0"], "argument --lengths: 0 is below 1"),
    ("kv_core.py", ["--batches", "1,,8"], "argument --batches: '' is not an integer"),
])
def test_bad_arguments_get_one_line(script, args, message):
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr
