"""bench/structured.py end to end on the default model, 2 schemas and few tokens: every cell is there and
consistent (no timing asserted), the validity it reports agrees with the jsonschema package run here on the
texts it reports, lookup's greedy tokens equal plain decoding's, the refused keywords are refused by name, and
bad arguments get one line."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: Only there to fail a hang (the run's length depends on the machine).
HANG_S = 1800


def schemas() -> dict:
    lines = (BENCH / "schemas" / "schemas.jsonl").read_text().splitlines()
    return {row["name"]: row for row in map(json.loads, lines)}


@pytest.fixture(scope="module")
def run(default_gguf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured-bench")
    done = subprocess.run([sys.executable, str(BENCH / "structured.py"), "--models", "default", "--limit", "2",
                           "--validity-limit", "2", "--max-tokens", "48", "--repeats", "1", "--batch", "2",
                           "--skip", "llama.cpp", "--json", "--results", str(folder)],
                          capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), folder


def test_the_schema_set():
    rows = schemas()
    assert len(rows) >= 50
    assert sum(r["heavy"] for r in rows.values()) >= 4
    for row in rows.values():
        jsonschema.validators.validator_for(row["schema"]).check_schema(row["schema"])
        assert row["task"]


def test_every_cell_is_measured(run):
    payload, _ = run
    (m,) = payload["models"]
    assert m["model"] == "default"
    for spec in ("off", "lookup"):
        assert all(v > 0 for v in m["speed"][spec]["tps"].values())
    assert all(v > 0 for v in m["batch"]["tps"].values())
    assert m["lookup_same_tokens"] is True
    forced = m["forced"]
    assert forced["tokens_per_forward"]["off"] == 1.0
    assert forced["tokens_per_forward"]["on"] > 1.0  # the heavy schemas' key names are forced
    assert m["llama_cpp"] == {"found": False, "why": "skipped (--skip llama.cpp)"}


def test_validity_agrees_with_jsonschema(run):
    payload, _ = run
    (m,) = payload["models"]
    rows = schemas()
    ours = m["validity"]
    assert ours["n"] == 2 and len(ours["rows"]) == 2
    for row in ours["rows"]:
        schema = rows[row["name"]]["schema"]
        try:
            ok = jsonschema.validators.validator_for(schema)(
                schema, format_checker=jsonschema.FormatChecker()).is_valid(json.loads(row["text"]))
        except ValueError:
            ok = False
        assert row["valid"] == ok
        if row["finish"] == "stop":
            assert ok, row  # the goal: every constrained output that stops is valid
    assert ours["stopped"] >= 1
    assert ours["valid_of_stopped"] == ours["stopped"]
    assert m["mlx_lm"]["n"] == 2
    assert m["mlx_lm"]["lenient"] >= m["mlx_lm"]["valid"]  # a text that is JSON is its own first JSON value


def test_refused_keywords_are_named(run):
    payload, _ = run
    (m,) = payload["models"]
    assert {r["keyword"] for r in m["refused"]} >= {"uniqueItems", "not", "if", "dependentRequired"}
    assert all(r["refused"] for r in m["refused"]), m["refused"]


def test_result_files(run):
    _, folder = run
    (result,) = folder.glob("structured-*.json")
    assert json.loads(result.read_text())["models"][0]["model"] == "default"
    assert result.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("args, message", [
    (["--models", "llama"], "--models: llama is not one of default, gemma"),
    (["--skip", "speed"], "--skip takes llama.cpp, mlx-lm, batch, lookup, not speed"),
    (["--limit", "0"], "argument --limit: 0 is below 1"),
])
def test_bad_arguments_get_one_line(args, message):
    done = subprocess.run([sys.executable, str(BENCH / "structured.py"), *args], capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
