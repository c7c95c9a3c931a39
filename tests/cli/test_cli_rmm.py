"""`--rmm`: bad values are one `error:` line before the model loads (serve and bench --concurrency refuse
qk / pv, which batched decoding does not reduce); a layer range past the model is one line after it loads;
a reduced run reports its retention, canonical, in --json and --stats; bench takes --rmm; `--spec rmm` runs."""

import json

import pytest
from cli_helpers import assert_user_error


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--rmm", "bogus"], "unknown preset 'bogus'"),
    (["generate", "hi", "--rmm", "mlp=1.5"], "(0, 1]"),
    (["chat", "--rmm", "ffn=0.5"], "unknown component 'ffn'"),
    (["chat", "--rmm", "qk@1=0.5"], "one ratio for every layer"),
    (["generate", "hi", "--rmm", "attn=\uff10.5"], "ASCII digits"),
    (["generate", "hi", "--rmm", "mlp@\uff13=0.5"], "ASCII digits"),
    (["generate", "hi", "--rmm", "attn=0.5,"], "empty item"),
    (["chat", "--rmm", "attn=0.5,,mlp=0.9"], "empty item"),
    (["generate", "hi", "--rmm", "mlp@5-2=0.5"], "the layer range is empty (5 > 2)"),
    (["bench", "--rmm", "bogus"], "unknown preset 'bogus'"),
    (["bench", "--rmm", "mlp=2"], "(0, 1]"),
    (["bench", "-c", "2", "--rmm", "pv=0.5"], "bench --concurrency decodes batched; qk/pv reduction runs only for "
                                              "single requests: use bench without --concurrency"),
    (["serve", "--rmm", "qk=0.5"], "serve decodes batched; qk/pv reduction runs only for single requests: "
                                   "use generate/chat"),
    (["serve", "--rmm", "attn=0.5,pv=0.9"], "serve decodes batched"),
    (["serve", "--rmm", "products"], "serve decodes batched"),  # the preset is qk=0.75,pv=0.75
    (["serve", "--rmm", "all=0.5"], "serve decodes batched"),
    (["serve", "--rmm", "attn=0.5,,"], "empty item"),
])
def test_bad_rmm_fails_before_loading(run_cli, args, message):
    assert_user_error(run_cli(*args, "-m", "/definitely/not/here.gguf"), message)


def test_rmm_json_and_stats(run_cli):
    """Both report the canonical form: components in a fixed order, not as typed."""
    proc = run_cli("generate", "Name three colors.", "-n", "8", "--rmm", "mlp=0.75, ATTN=0.9", "--json", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["rmm"] == "attn=0.9,mlp=0.75"
    assert "rmm attn=0.9,mlp=0.75 (lossy)" in proc.stderr


def test_layer_range_past_the_model(run_cli):
    """The default model has 30 layers: the range selects none of them (one line once the model is loaded)."""
    assert_user_error(run_cli("generate", "hi", "-n", "2", "--rmm", "mlp@40-50=0.5"),
                      "--rmm 'mlp@40-50=0.5': this model has 30 layers (0-29)")


def test_bench_rmm(run_cli):
    proc = run_cli("bench", "Name three colors.", "-n", "4", "-t", "1", "--spec", "off", "--rmm", "mlp=0.75,attn=0.5",
                   "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["rmm"] == "attn=0.5,mlp=0.75"
    assert [r["mode"] for r in out["rows"]] == ["off"] and out["rows"][0]["tokens"] >= 1


def test_spec_rmm_runs(run_cli):
    proc = run_cli("generate", "Name three colors.", "-n", "8", "--spec", "rmm", "--max-draft", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["spec_mode"] == "rmm"

