"""Tool calls read from a model's text, all at once (`parse`) or as it streams (`ToolStream`): content text,
call starts (index, id, name) and argument text in pieces, the way OpenAI streams `delta.tool_calls`.

The text between calls is content: whitespace next to a call (and at the end of a text with calls) is dropped.
A call's body goes to mlx-lm's parser for the family; a JSON-body call that begins `{"name": "...",
"arguments":` streams its arguments as they come (the text after that prefix, without the closing `}` and
whitespace). Text that may be the start of a marker is held back until it is decided. `parse(text)` is the
stream fed the whole text, so streamed events assembled always equal it.

A call that repeats an earlier one of the same response (same name, equal arguments as JSON) ends the response:
small models asked for parallel calls tend to repeat theirs until max_tokens, and no API client wants the
same call twice. It and all text after it are dropped (`ended`), so that only the first call streams as it
comes; a later one is held until its end marker tells whether it repeats.
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..generation.results import ToolCall
from .formats import ToolFormat

#: The head of a JSON call body whose name is known before its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:')


@dataclass(frozen=True)
class ToolEvent:
    """One streamed piece.

    Attributes:
        kind: "content" (text for the message's content), "call" (a call starts: index, id, name) or
            "arguments" (text to append to call `index`'s arguments).
        text: the content or argument text ("" for "call").
        index: the call's position in the message (0, 1, ...; -1 for content).
        id: the call's id ("call_" + 24 hex digits; "call" events only).
        name: the function's name ("call" events only).
    """

    kind: str
    text: str = ""
    index: int = -1
    id: str = ""
    name: str = ""


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (held back: may become it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _arguments_so_far(region: str) -> str:
    """The arguments text of a JSON call body's rest (after `"arguments":`): leading whitespace, and the
    closing `}` of the call with whitespace around it, left out."""
    text = region.strip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text


class ToolStream:
    """The incremental reader of one response's text.

    Args:
        fmt: the model's ToolFormat.
        tools: the request's tools in OpenAI's shape (mlx-lm's parsers read some argument types from them).
        call_id: the id of call i (ToolPlan gives the same ids to parse and stream).
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[dict], call_id: Callable[[int], str]):
        self.fmt, self.tools, self._call_id = fmt, list(tools), call_id
        self._pending = ""          # text not yet decided
        self._in_call = False
        self._name: Optional[str] = None   # a JSON call whose arguments stream
        self._sent = ""             # the arguments text sent for the current streaming call
        self._calls = 0
        self._held_ws = False       # whether content held back ends a segment (dropped before a call)
        self._seen: List[Tuple[str, str]] = []  # (name, canonical arguments) of the calls given
        self.ended = False          # a repeated call was read: the response ends there, the rest is dropped

    def feed(self, text: str) -> List[ToolEvent]:
        """Events for the next piece of text (possibly none: text held back until decided)."""
        if self.ended:
            return []
        self._pending += text
        out: List[ToolEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> List[ToolEvent]:
        """The events of what is still held back, at the end of the text."""
        out: List[ToolEvent] = []
        pending, self._pending = self._pending, ""
        if self.ended:
            return out
        if not self._in_call:
            if pending and not self._calls:
                out.append(ToolEvent("content", pending))
            elif pending.strip():
                out.append(ToolEvent("content", pending.rstrip()))
        elif self._name is not None:
            out += self._arguments(_arguments_so_far(pending))
        else:
            out += self._whole(pending, complete=False)
        self._in_call = False
        return out

    def _step(self, out: List[ToolEvent]) -> bool:
        """Decide what can be decided of the pending text; True when the state changed (step again)."""
        if self.ended:
            return False
        if not self._in_call:
            return self._text_step(out)
        end = self.fmt.end
        if self._name is None and self.fmt.json_body and not self._calls:  # the first call streams
            head = _HEAD.match(self._pending)
            stop = self._pending.find(end) if end else -1
            if head and (stop < 0 or head.end() <= stop):
                self._name = head.group(1)
                out.append(ToolEvent("call", index=self._calls, id=self._call_id(self._calls), name=self._name))
                self._pending = self._pending[head.end():]
                self._sent = ""
                return True
        stop = self._pending.find(end) if end else -1
        if stop < 0:
            if self._name is not None:
                held = _partial_suffix(self._pending, end) if end else 0
                out += self._arguments(_arguments_so_far(self._pending[:len(self._pending) - held]))
            return False
        body, self._pending = self._pending[:stop], self._pending[stop + len(end):]
        if self._name is not None:
            out += self._arguments(_arguments_so_far(body))
            self._seen.append((self._name, _canonical(self._sent)))
            self._calls += 1
        else:
            out += self._whole(body, complete=True)
        self._in_call, self._name = False, None
        self._pending = self._pending.lstrip()
        return True

    def _text_step(self, out: List[ToolEvent]) -> bool:
        if self._calls:
            self._pending = self._pending.lstrip()
        start = self._pending.find(self.fmt.start)
        if start >= 0:
            content = self._pending[:start].rstrip()
            if content:
                out.append(ToolEvent("content", content))
            self._pending = self._pending[start + len(self.fmt.start):]
            self._in_call = True
            return True
        held = _partial_suffix(self._pending, self.fmt.start)
        decided = self._pending[:len(self._pending) - held]
        sure = decided.rstrip()  # whitespace waits: dropped if a call follows
        if sure:
            out.append(ToolEvent("content", sure))
            self._pending = self._pending[len(sure):]
        return False

    def _arguments(self, text: str) -> List[ToolEvent]:
        """The argument text beyond what was sent (text extends it: see _arguments_so_far)."""
        if len(text) <= len(self._sent):
            return []
        piece, self._sent = text[len(self._sent):], text
        return [ToolEvent("arguments", piece, index=self._calls)]

    def _whole(self, body: str, complete: bool) -> List[ToolEvent]:
        """A call read whole by the family's parser (a call that did not stream); its raw text as content
        when the parser cannot read it."""
        if not complete and self._calls:
            return []  # a later call cut off (max_tokens): maybe a repeat, and no content either
        calls = parse_body(self.fmt, body, self.tools)
        if calls is None:
            raw = self.fmt.start + body + (self.fmt.end if complete else "")
            return [ToolEvent("content", raw)]
        out = []
        for name, arguments in calls:
            key = (name, _canonical(arguments))
            if key in self._seen:
                self.ended, self._pending = True, ""
                break
            self._seen.append(key)
            out.append(ToolEvent("call", index=self._calls, id=self._call_id(self._calls), name=name))
            out.append(ToolEvent("arguments", arguments, index=self._calls))
            self._calls += 1
        return out


def _canonical(arguments: str) -> str:
    """Arguments text in one spelling (keys sorted, no spaces) when it is JSON, else stripped: equal
    arguments compare equal however the model spaced or ordered them."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments.strip()


def parse_body(fmt: ToolFormat, body: str, tools: Sequence[dict]) -> Optional[List[Tuple[str, str]]]:
    """[(name, arguments JSON text)] of one call body read by the family's mlx-lm parser, None when it
    cannot read it."""
    try:
        parsed: Any = fmt.parser(body, list(tools))
    except Exception:  # mlx-lm's parsers raise ValueError, JSONDecodeError, KeyError, SyntaxError, ...
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        out.append((call["name"], text))
    return out


def assemble(events: Sequence[ToolEvent]) -> Tuple[str, List[ToolCall]]:
    """(content, calls) of a response's events."""
    content: List[str] = []
    calls: List[ToolCall] = []
    for e in events:
        if e.kind == "content":
            content.append(e.text)
        elif e.kind == "call":
            calls.append(ToolCall(e.id, e.name, ""))
        else:
            calls[e.index].arguments += e.text
    return "".join(content), calls
