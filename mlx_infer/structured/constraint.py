"""What a request's output must match, as the user gave it: a JSON schema, any JSON object, a regular expression
or a Lark grammar (llguidance's syntax), turned into llguidance's grammar text. Checked against the model's
tokenizer in grammar.Grammars.compile, before any decoding."""

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

import llguidance

from ..errors import RequestError

#: The constraint kinds.
KINDS = ("json_schema", "json_object", "regex", "lark")

#: JSON is generated without optional whitespace (llguidance's `whitespace_flexible: false`): what a parser reads
#: is the same, it costs fewer tokens, and more of it is forced (grammar.GrammarState.forced).
_JSON_OPTIONS = {"whitespace_flexible": False}


class ConstraintError(RequestError):
    """A constraint that cannot be used: invalid JSON schema, a keyword llguidance does not implement, a regex or
    grammar with a syntax error. `param` names the request field ("response_format", "tools", ...)."""


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint.

    Attributes:
        kind: one of KINDS.
        source: the JSON schema (a dict), the regex or the Lark text; None for json_object.
        param: the request field it came from, named in errors ("response_format", "json_schema", "tools").
        grammar: llguidance's grammar text for it (built here: `constraint.grammar`).
    """

    kind: str
    source: Union[dict, str, None] = None
    param: str = "response_format"

    @property
    def grammar(self) -> str:
        """llguidance's grammar (its TopLevelGrammar JSON text) for this constraint.

        Raises:
            ConstraintError: a source llguidance cannot read (e.g. a schema that is not JSON).
        """
        try:
            if self.kind == "json_schema":
                schema = dict(self.source) if isinstance(self.source, dict) else self.source
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            if self.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(str(self.source))
            return llguidance.LLMatcher.grammar_from_lark(str(self.source))
        except (ValueError, TypeError) as e:
            raise ConstraintError(f"invalid {self.kind.replace('_', ' ')}: {_one_line(str(e))}", self.param) from e


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def json_schema(schema: Any, param: str = "response_format") -> Constraint:
    """A JSON-schema constraint. schema: a dict, or its JSON text.

    Raises:
        ConstraintError: text that is not JSON, or a schema that is not a JSON object.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"the JSON schema is not valid JSON: {e}", param) from e
    if not isinstance(schema, dict):
        raise ConstraintError(f"a JSON schema must be a JSON object, got {type(schema).__name__}", param)
    return Constraint("json_schema", schema, param)


def json_object(param: str = "response_format") -> Constraint:
    """Any JSON object (OpenAI's `{"type": "json_object"}`, Ollama's `format: json`)."""
    return Constraint("json_object", None, param)


def regex(pattern: str, param: str = "regex") -> Constraint:
    """The whole output matches `pattern` (llguidance's regex syntax, Rust's regex crate)."""
    if not isinstance(pattern, str) or not pattern:
        raise ConstraintError("a regex constraint must be a non-empty string", param)
    return Constraint("regex", pattern, param)


def lark(grammar: str, param: str = "grammar") -> Constraint:
    """The output is a sentence of a Lark grammar (llguidance's Lark syntax; `start` is the start rule)."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise ConstraintError("a grammar constraint must be non-empty Lark text", param)
    return Constraint("lark", grammar, param)


def response_format(value: Any, param: str = "response_format") -> Optional[Constraint]:
    """The Constraint of OpenAI's `response_format` (None for `{"type": "text"}` or None).

    Accepts `{"type": "text"}`, `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}`, or a Constraint as it is.

    Raises:
        ConstraintError: another shape or type (param `response_format`).
    """
    if value is None or isinstance(value, Constraint):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConstraintError('response_format must be an object with a "type": "text", "json_object" or '
                              '"json_schema"', param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object(param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError('response_format of type "json_schema" needs "json_schema": {"name": ..., '
                                  '"schema": {...}}', param)
        return json_schema(spec["schema"], param)
    raise ConstraintError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
                          param)
