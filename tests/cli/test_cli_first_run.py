"""The first `mlx-infer generate` on a machine answers before it measures: with --spec auto (the default) and
no cached measurements the answer is decoded plainly (stats.spec_mode "off"), then the verify cost curve is
measured and cached, said on stderr; the next run reads the cache, measures nothing and speculates."""

import json

import pytest
from cli_helpers import cli_env

from gguf_factory import tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("cli-first") / "tiny.gguf", "llama")[0]


def generate_json(run_cli, model, cache, *flags) -> tuple:
    """(the --json object, stderr) of one generate run over the cache folder `cache`."""
    proc = run_cli("generate", "one two three one two three one two", "-m", model, "-n", "6",
                   "--no-chat-template", "--json", *flags, env=cli_env(MLX_INFER_CACHE=str(cache)))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_first_generate_answers_plainly_then_measures_and_the_next_run_speculates(run_cli, tiny, tmp_path):
    cache = tmp_path / "cache"
    first, said = generate_json(run_cli, tiny, cache)
    assert first["stats"]["spec_mode"] == "off" and first["stats"]["rounds"] == 0
    assert "answered without speculative decoding (--spec auto)" in said
    assert "measuring this model's verify cost by width" in said
    curves = list((cache / "cost").glob("*.json"))
    assert len(curves) == 1  # measured after the answer, cached

    # a flat curve in its place: verifying several tokens costs what one does, so lookup pays here whatever
    # this machine measured; the next run must take it from the cache
    width = max(int(w) for w in json.loads(curves[0].read_text())["seconds"])
    curves[0].write_text(json.dumps({"seconds": {str(w): 0.01 for w in range(1, width + 1)}, "plain_step": 0.01}))
    second, said = generate_json(run_cli, tiny, cache)
    assert "measuring" not in said
    assert second["stats"]["spec_mode"] == "lookup" and second["stats"]["rounds"] > 0
    assert second["token_ids"] == first["token_ids"]  # greedy: speculative output is the plain one


def test_a_named_mode_measures_before_its_answer(run_cli, tiny, tmp_path):
    """--spec lookup asks for speculation: it measures first, as before (no deferral line)."""
    out, said = generate_json(run_cli, tiny, tmp_path / "cache", "--spec", "lookup")
    assert "measuring this model's verify cost by width" in said and "answered without" not in said
    assert len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 1
