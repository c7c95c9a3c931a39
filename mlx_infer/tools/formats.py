"""How a model writes tool calls (its family's format, from mlx-lm's tool parsers) and how a prompt shows it its
tools: through the chat template's own `tools` rendering when the template has one, else in the generic form
(docs/structured.md, "Tool calls"): a system message listing the functions' JSON schemas and asking for
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes / Qwen convention, read with mlx-lm's
json_tools parser."""

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

from mlx_lm.tool_parsers import json_tools

from ..errors import MlxInferError

#: The families whose call body is the JSON object {"name": ..., "arguments": {...}} between the markers: the
#: call grammar (tools/grammar.py) and the incremental argument stream (tools/parse.py) know this body.
JSON_FAMILIES = ("json_tools", "generic")

#: The generic form's instructions, before the functions' schemas (one JSON object a line).
GENERIC_INTRO = ("You can call functions. The functions, one JSON schema a line:\n{functions}\n"
                 "To call a function, answer with one line per call:\n"
                 '<tool_call>\n{{"name":"<function name>","arguments":{{<its arguments as JSON>}}}}\n</tool_call>\n'
                 "A function's result comes back in <tool_response></tool_response>. Answer in plain text when "
                 "no function is needed.")

_TOOLS_IN_TEMPLATE = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolFormat:
    """A family's tool-call format.

    Attributes:
        family: mlx-lm's tool parser module name ("json_tools", "mistral", "qwen3_coder", ...) or "generic".
        start, end: the call's markers (end "" where the family has none: the call runs to the end of the text).
        parser: mlx-lm's parse_tool_call(body, tools) -> {"name", "arguments"} or a list of them.
        native: whether the chat template renders the tools (`apply_chat_template(..., tools=...)`).
    """

    family: str
    start: str
    end: str
    parser: Callable[[str, Any], Any]
    native: bool

    @property
    def json_body(self) -> bool:
        """Whether the call body is {"name": ..., "arguments": {...}} JSON (grammar and argument streaming)."""
        return self.family in JSON_FAMILIES

    def call_text(self, name: str, arguments: Any) -> str:
        """One call as the generic form writes it (history of templates without tool support).

        arguments: a dict, or JSON text of one."""
        compact = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        args = arguments if isinstance(arguments, str) else compact
        return f'{self.start}\n{{"name":{json.dumps(name)},"arguments":{args}}}\n{self.end}'


#: The generic form: mlx-lm's json_tools parser and markers.
GENERIC = ToolFormat("generic", json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call,
                     False)


def template_has_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` (SmolLM2's and Gemma-3's do not)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_TOOLS_IN_TEMPLATE.search(template))


def detect(tokenizer) -> ToolFormat:
    """The model's format: its family's (mlx-lm's TokenizerWrapper: has_tool_calling, tool_call_start / _end,
    tool_parser) when its chat template renders tools, else GENERIC."""
    if not (template_has_tools(tokenizer) and getattr(tokenizer, "has_tool_calling", False)):
        return GENERIC
    parser = tokenizer.tool_parser
    family = getattr(parser, "__module__", "json_tools").rsplit(".", 1)[-1]
    return ToolFormat(family, tokenizer.tool_call_start, tokenizer.tool_call_end or "", parser, True)


def generic_system(functions: Sequence[dict], system: Optional[str]) -> str:
    """The generic form's system message (functions: OpenAI tools' "function" objects), after the user's own
    system prompt when there is one."""
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    text = GENERIC_INTRO.format(functions=listed)
    return f"{system}\n\n{text}" if system else text


def _arguments_dict(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _calls(message: dict) -> List[dict]:
    """A message's tool calls as [{"name", "arguments"}] (OpenAI's {"function": {...}} shape or flat).

    Raises:
        MlxInferError: tool_calls that are not a list of calls with a function name.
    """
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise MlxInferError("an assistant message's tool_calls must be a list of calls")
    out = []
    for call in calls:
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise MlxInferError('each of an assistant message\'s tool_calls needs "function": {"name", "arguments"}')
        out.append({"name": fn["name"], "arguments": fn.get("arguments") or {}})
    return out


def native_history(messages: Sequence[dict]) -> List[dict]:
    """Messages for a template that renders tools: tool calls' arguments as dicts (HF templates write them with
    `tojson`), content None as ""."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": f["name"], "arguments": _arguments_dict(f["arguments"])}}
                               for c, f in zip(m["tool_calls"], _calls(m))]
        out.append(m)
    return out


def generic_history(messages: Sequence[dict], fmt: ToolFormat = GENERIC) -> List[dict]:
    """Messages for a template without tool support: an assistant message's calls appended to its content in
    the generic form, consecutive tool results as one user message of <tool_response> blocks."""
    out: List[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(fmt.call_text(c["name"], c["arguments"]) for c in _calls(m))
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    return [{k: v for k, v in m.items() if k != "_tool"} for m in out]
