"""A request's tools checked: OpenAI function tools, tool_choice and parallel_tool_calls, each bad value a
RequestError (ConstraintError for a parameters schema llguidance refuses) naming its field."""

import re
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from ..errors import RequestError

#: A function's name, as OpenAI accepts it.
NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

#: The tool_choice strings.
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    """One function tool.

    Attributes:
        name: its name (NAME).
        description: what it does ("" when not given).
        parameters: the JSON schema of its arguments (a JSON object; {"type": "object"} when not given).
        strict: OpenAI's `strict` flag (arguments always follow the schema here when a grammar is used).
    """

    name: str
    description: str
    parameters: dict
    strict: bool = False

    def openai(self) -> dict:
        """The tool as OpenAI's `{"type": "function", "function": {...}}` (what chat templates render)."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if not self.description:
            del function["description"]
        return {"type": "function", "function": function}


def functions(tools: Any) -> List[Function]:
    """The request's function tools.

    Raises:
        RequestError (param "tools"): not a non-empty list, a tool that is not {"type": "function", "function":
            {...}}, a missing or bad name, a repeated name, parameters that are not a JSON object.
    """
    if not isinstance(tools, (list, tuple)) or not tools:
        raise RequestError('tools must be a non-empty list of {"type": "function", "function": {"name": ...}}',
                           "tools")
    out: List[Function] = []
    for i, tool in enumerate(tools):
        out.append(_function(tool, i))
    names = [f.name for f in out]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise RequestError(f"tools name the function {twice!r} twice; give each function a distinct name", "tools")
    return out


def _function(tool: Any, i: int) -> Function:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise RequestError(f'tools[{i}] needs "function": {{"name": ..., "parameters": {{...}}}}', "tools")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        what = "has no name" if name is None else f"has the name {name!r}"
        raise RequestError(f"tools[{i}] {what}; a function name is 1-64 letters, digits, '_' or '-'", "tools")
    description = spec.get("description", "")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise RequestError(f"tools[{i}] ({name}): description must be a string", "tools")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise RequestError(f"tools[{i}] ({name}): parameters must be a JSON schema object", "tools")
    return Function(name, description, parameters, bool(spec.get("strict", False)))


def choice(value: Any, funcs: Sequence[Function]) -> str:
    """tool_choice as "none", "auto", "required" or the name of the one function to call (None: "auto").

    Raises:
        RequestError (param "tool_choice"): another value, or a function that is not among the tools.
    """
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise RequestError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                               f'"function": {{"name": ...}}}}, got {value!r}', "tool_choice")
        return value
    name = _named(value)
    if name not in {f.name for f in funcs}:
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                           f"({', '.join(f.name for f in funcs)})", "tool_choice")
    return name


def _named(value: Any) -> Optional[str]:
    spec = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": ...}}', "tool_choice")
    return name


def parallel(value: Any) -> bool:
    """parallel_tool_calls as a bool (None: True). Raises RequestError (param "parallel_tool_calls")."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise RequestError(f"parallel_tool_calls must be true or false, got {value!r}", "parallel_tool_calls")
    return value
