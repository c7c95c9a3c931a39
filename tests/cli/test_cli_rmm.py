"""`--rmm`: bad values are one `error:` line before the model loads; a reduced run reports its retention
in --json and --stats; `--spec rmm` runs."""

import json

import pytest
from cli_helpers import assert_user_error


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--rmm", "bogus"], "unknown preset 'bogus'"),
    (["generate", "hi", "--rmm", "mlp=1.5"], "(0, 1]"),
    (["chat", "--rmm", "ffn=0.5"], "unknown component 'ffn'"),
    (["chat", "--rmm", "qk@1=0.5"], "one ratio for every layer"),
])
def test_bad_rmm_fails_before_loading(run_cli, args, message):
    assert_user_error(run_cli(*args, "-m", "/definitely/not/here.gguf"), message)


def test_rmm_json_and_stats(run_cli):
    proc = run_cli("generate", "Name three colors.", "-n", "8", "--rmm", "mlp=0.75", "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["rmm"] == "mlp=0.75"
    assert "rmm mlp=0.75 (lossy)" in proc.stderr


def test_spec_rmm_runs(run_cli):
    proc = run_cli("generate", "Name three colors.", "-n", "8", "--spec", "rmm", "--max-draft", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["spec_mode"] == "rmm"
