"""The call grammar of a request's tools: llguidance Lark text for the {"name": ..., "arguments": {...}} calls
of the json_tools / generic formats between their markers, each function an alternative whose name is fixed
and whose arguments follow its parameters schema (`%json`), so that a constrained call always parses and
validates.

    required / named:  start: call ("\\n" call)*        (one call without parallel_tool_calls)
    auto:              start: TEXT | head rest          (free text without the start marker, or text up to
                                                         the first marker, then the calls)
"""

import json
from typing import Optional, Sequence

from .formats import ToolFormat
from .spec import Function

#: JSON inside calls without optional whitespace: fewer tokens, and more of it forced (the name, the keys).
_JSON_OPTIONS = {"whitespace_flexible": False}

_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/\"")


def call_schema(function: Function) -> dict:
    """The JSON schema of one call's body: {"name": <its name>, "arguments": <its parameters>}."""
    return {"x-guidance": _JSON_OPTIONS, "type": "object",
            "properties": {"name": {"const": function.name}, "arguments": function.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _literal(text: str, special_id: Optional[int]) -> str:
    """A marker in Lark: its special token (`<[id]>`) or a string literal."""
    return f"<[{special_id}]>" if special_id is not None else json.dumps(text)


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def lark_grammar(fmt: ToolFormat, functions: Sequence[Function], mode: str, parallel: bool,
                 start_id: Optional[int] = None, end_id: Optional[int] = None) -> str:
    """The Lark text of calls to `functions` in `fmt` (a JSON_FAMILIES format).

    Args:
        mode: "calls" (only calls: tool_choice required / named) or "auto" (free text, or calls once the start
            marker is written).
        parallel: several calls (one a line) or exactly one.
        start_id, end_id: the markers' token ids when they are single special tokens (written as tokens), else
            None (written as text).
    """
    start, end = _literal(fmt.start, start_id), _literal(fmt.end, end_id)
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    lines = [f'body: "\\n" ({alternatives}) "\\n" {end}']
    lines += [f"fn{i}: %json {json.dumps(call_schema(f))}" for i, f in enumerate(functions)]
    more = ' ("\\n" call)*' if parallel else ""
    lines.append(f"call: {start} body")
    if mode == "calls":
        lines.insert(0, f"start: call{more}")
    elif start_id is not None:  # a special-token marker cannot occur in text: plain text, then calls
        lines.insert(0, f"start: TEXT | TEXT? call{more}")
        lines.append("TEXT: /(?s:.+)/")
    else:
        marker = _regex_escape(fmt.start)
        lines.insert(0, f"start: TEXT | head body{more}")
        lines.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/")
        lines.append(f"head[lazy]: /(?s:.*){marker}/")
    return "\n".join(lines) + "\n"
