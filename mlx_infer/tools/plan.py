"""A request's tools, checked and planned: how its prompt shows them, the constraint its output is decoded
under (tool_choice "required" / named: calls only; "auto": free text, or calls once one starts) and how its
text is read back into calls.

    plan = plan_tools(tokenizer, tools, "required", parallel_tool_calls=True, grammars=engine.grammars)
    plan.constraint          # Constraint("lark", ...) for the request's GrammarState
    content, calls = plan.parse(text)
"""

import json
import secrets
from typing import Any, List, Optional, Sequence, Tuple

import llguidance

from ..errors import RequestError
from ..generation.results import ToolCall
from ..structured.constraint import Constraint, ConstraintError, _one_line, json_schema, lark
from ..structured.grammar import Grammars
from . import formats, spec
from .grammar import lark_grammar
from .parse import ToolEvent, ToolStream, assemble

__all__ = ["ToolPlan", "plan_tools", "ToolEvent", "ToolStream"]


class ToolPlan:
    """One request's tools.

    Attributes:
        functions: the tools (spec.Function).
        choice: "auto", "required" or the one function's name.
        parallel: whether several calls may be made.
        format: the model's ToolFormat (formats.detect).
    """

    def __init__(self, functions: Sequence[spec.Function], choice: str, parallel: bool, fmt: formats.ToolFormat,
                 marker_ids: Tuple[Optional[int], Optional[int]] = (None, None)):
        self.functions, self.choice, self.parallel, self.format = list(functions), choice, parallel, fmt
        self._marker_ids = marker_ids
        self._ids: List[str] = []

    @property
    def tools(self) -> List[dict]:
        """The tools in OpenAI's shape (what the chat template and mlx-lm's parsers read)."""
        return [f.openai() for f in self.functions]

    def call_id(self, index: int) -> str:
        """The id of the response's call `index` ("call_" + 24 hex digits), the same for parse and stream."""
        while len(self._ids) <= index:
            self._ids.append("call_" + secrets.token_hex(12))
        return self._ids[index]

    def _called(self) -> List[spec.Function]:
        return [f for f in self.functions if self.choice in ("auto", "required") or f.name == self.choice]

    @property
    def constraint(self) -> Optional[Constraint]:
        """The Lark constraint of the output (param "tools"): calls only for "required" and a named function,
        free text or calls for "auto"; None for a family whose call format has no grammar here ("auto" only).

        Raises:
            RequestError (param "tool_choice"): "required" / named for a family without a call grammar.
        """
        if not self.format.json_body:
            if self.choice == "auto":
                return None
            raise RequestError(f"tool_choice {self.choice!r} needs a call grammar, which mlx-infer builds for the "
                               f"<tool_call> JSON format only, not this model's {self.format.family!r} format; use "
                               f'tool_choice "auto"', "tool_choice")
        mode = "auto" if self.choice == "auto" else "calls"
        return lark(lark_grammar(self.format, self._called(), mode, self.parallel, *self._marker_ids), "tools")

    def merge(self, response_format: Optional[Constraint]) -> Optional[Constraint]:
        """The constraint of a request with tools and a response_format: the call grammar for "required" and a
        named function (a call is the answer); for "auto", a JSON answer following response_format or calls.

        Raises:
            RequestError (param "response_format"): auto tools with a regex or grammar response format, or a
                family without a call grammar.
        """
        if response_format is None or self.choice != "auto":
            return self.constraint
        if response_format.kind not in ("json_schema", "json_object") or not self.format.json_body:
            raise RequestError("tools with tool_choice \"auto\" combine only with a JSON response_format (and the "
                               "<tool_call> JSON format); drop one of them", "response_format")
        source = response_format.source
        schema = source if response_format.kind == "json_schema" and isinstance(source, dict) else {"type": "object"}
        calls = lark_grammar(self.format, self._called(), "calls", self.parallel, *self._marker_ids)
        answer = {"x-guidance": {"whitespace_flexible": False}, **schema}
        text = calls.replace("start: call", "start: answer | call", 1) + f"answer: %json {json.dumps(answer)}\n"
        return lark(text, "response_format")

    def stream(self) -> ToolStream:
        """A fresh incremental reader of a response's text (feed / finish -> ToolEvents)."""
        return ToolStream(self.format, self.tools, self.call_id)

    def parse(self, text: str) -> Tuple[str, List[ToolCall]]:
        """(content without the calls, the calls) of a whole response."""
        reader = self.stream()
        return assemble(reader.feed(text) + reader.finish())

    def ended(self, text: str) -> bool:
        """Whether the response ends within `text`: a call in it repeats an earlier one (ToolStream.ended)."""
        reader = self.stream()
        reader.feed(text)
        return reader.ended

    def system(self, system: Optional[str]) -> Optional[str]:
        """The system prompt of a template without tool support: the user's, then the generic form's."""
        if self.format.native:
            return system
        return formats.generic_system([f.openai()["function"] for f in self.functions], system)


def _marker_id(tokenizer, marker: str) -> Optional[int]:
    """The marker's token id when it is one special token (written as a token in grammars), else None."""
    special = set(getattr(getattr(tokenizer, "_tokenizer", tokenizer), "all_special_tokens", []) or [])
    if not marker or marker not in special:
        return None
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def check_parameters(functions: Sequence[spec.Function], grammars: Optional[Grammars]) -> None:
    """Each function's parameters schema compiled (Grammars.compile, or llguidance without a tokenizer).

    Raises:
        ConstraintError (param "tools"): an invalid schema or unsupported keyword, naming the function.
    """
    for f in functions:
        constraint = json_schema(f.parameters, "tools")
        try:
            if grammars is not None:
                grammars.compile(constraint)
            else:
                _validate(constraint)
        except ConstraintError as e:
            raise ConstraintError(f"tool {f.name!r}: {e}", "tools") from e


def _validate(constraint: Constraint) -> None:
    """llguidance's check of a schema without a tokenizer (what Grammars.compile does with one)."""
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(constraint.grammar, None)
    if failed:
        raise ConstraintError(f"invalid parameters schema: {_one_line('; '.join(messages))}", "tools")


def plan_tools(tokenizer, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True,
               grammars: Optional[Grammars] = None) -> Optional[ToolPlan]:
    """A request's ToolPlan, its tools checked before any decoding; None without tools or for tool_choice
    "none" (tool_choice alone, without tools: RequestError).

    Args:
        tokenizer: the model's mlx-lm TokenizerWrapper (its chat template and tool parser give the format).
        tools, tool_choice, parallel_tool_calls: OpenAI's fields.
        grammars: the model's Grammars (the schemas are compiled against its tokenizer; None: checked without).

    Raises:
        RequestError: bad tools (param "tools"), tool_choice ("tool_choice"), parallel_tool_calls.
        ConstraintError (param "tools"): a parameters schema llguidance refuses.
    """
    parallel = spec.parallel(parallel_tool_calls)
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise RequestError("tool_choice needs tools; give the functions in tools", "tool_choice")
        return None
    functions = spec.functions(tools)
    choice = spec.choice(tool_choice, functions)
    check_parameters(functions, grammars)
    if choice == "none":
        return None
    fmt = formats.detect(tokenizer)
    markers = (_marker_id(tokenizer, fmt.start), _marker_id(tokenizer, fmt.end))
    plan = ToolPlan(functions, choice, parallel, fmt, markers)
    constraint = plan.constraint if fmt.json_body else None
    if grammars is not None and constraint is not None:
        grammars.compile(constraint)  # the whole call grammar, checked once here
    return plan
