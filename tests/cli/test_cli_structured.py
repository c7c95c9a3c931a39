"""`mlx-infer generate` / `chat` with --json-schema, --regex, --grammar, --format json, --no-forced-spans on the
default model: outputs checked independently (jsonschema, re), bad constraints one line and exit 2."""

import json
import re

import jsonschema
import pytest
from cli_helpers import assert_user_error

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "color"], "additionalProperties": False}


@pytest.mark.parametrize("forced", [[], ["--no-forced-spans"]])
def test_json_schema_from_a_file(run_cli, tmp_path, forced):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    proc = run_cli("generate", "Describe a person.", "-n", "40", "--json-schema", path, *forced, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_json_schema_text_regex_grammar_and_format(run_cli, tmp_path):
    proc = run_cli("generate", "Describe a person.", "-n", "40", "--json-schema", json.dumps(SCHEMA))
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), SCHEMA)
    proc = run_cli("generate", "When was Rome founded?", "-n", "20", "--regex", "[0-9]{3,4} (BC|AD)")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch("[0-9]{3,4} (BC|AD)", proc.stdout.rstrip("\n")), proc.stdout
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: ("yes" | "no") "."\n')
    proc = run_cli("generate", "Is water wet?", "-n", "10", "--grammar", grammar)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") in ("yes.", "no."), proc.stdout
    proc = run_cli("generate", "A JSON object about a dog.", "-n", "30", "--format", "json", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["text"].startswith("{")
    if out["finish_reason"] == "stop":
        assert isinstance(json.loads(out["text"]), dict)


def test_chat_with_a_regex(run_cli):
    proc = run_cli("chat", "-n", "10", "--regex", "(yes|no)", input="Is the sky blue?\n")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^(yes|no)$", proc.stdout, re.M), proc.stdout


@pytest.mark.parametrize("args, contains", [
    (["--regex", "a", "--format", "json"], "--regex and --format cannot be used together"),
    (["--json-schema", "{}", "--grammar", "x.lark"], "cannot be used together"),
    (["--json-schema", "{not json"], "not valid JSON"),
    (["--json-schema", '{"type": "array", "uniqueItems": true}'], "uniqueItems"),
    (["--format", "yaml"], "--format takes json"),
    (["--grammar", "/no/such/grammar.lark"], "no file"),
    (["--json-schema", "missing.json"], "--json-schema: no file 'missing.json'"),
    (["--grammar-x"], ""),
])
def test_bad_constraints_are_one_line_and_exit_2(run_cli, args, contains):
    proc = run_cli("generate", "hi", "-n", "4", *args)
    if args == ["--grammar-x"]:  # a flag typo: click's usage error (exit 2)
        assert proc.returncode == 2
        return
    assert_user_error(proc, contains)


def test_bad_grammar_text_fails_before_decoding(run_cli, tmp_path):
    grammar = tmp_path / "bad.lark"
    grammar.write_text("start: (\n")
    assert_user_error(run_cli("generate", "hi", "-n", "4", "--grammar", grammar), "grammar")
    assert_user_error(run_cli("chat", "-n", "4", "--grammar", grammar, input="hi\n"), "grammar")


def test_help_lists_the_structured_flags(run_cli):
    for command in ("generate", "chat"):
        out = run_cli(command, "--help").stdout
        for flag in ("--json-schema", "--regex", "--grammar", "--format", "--no-forced-spans"):
            assert flag in out, (command, flag)
