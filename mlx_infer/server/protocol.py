"""The OpenAI request bodies the server takes, checked field by field: what is supported is turned into
SamplingParams, what is not is a 400 that names the field (never ignored in silence).

Supported: `model` (a served model's name or alias; none: the default), `keep_alive` (Ollama's: seconds or a
duration such as "5m"; 0 unloads the model after the request, -1 keeps it), `messages` (chat: system / developer / user / assistant,
assistant messages with `tool_calls` and null content, `tool` results with `tool_call_id`) / `prompt`
(completions: a string, a list of one string, or token ids), `max_tokens` / `max_completion_tokens`,
`temperature`, `top_p`, `seed` (choice i of n draws with seed + i), `n` (1..MAX_N), `stop` (a string or up to
MAX_STOP strings), `stream`, `stream_options.include_usage`, `presence_penalty`, `frequency_penalty`, `user`
(ignored, as OpenAI stores it); chat: `response_format` (text, json_object, json_schema), `tools`, `tool_choice`,
`parallel_tool_calls`, `logprobs` (bool) with `top_logprobs` (0..20); completions: `logprobs` (an int 0..5,
OpenAI's legacy form); as llama-server and mlx_lm.server, `top_k`, `min_p` and `repetition_penalty`. Accepted
only at their default: `echo` (false), `stream_options` without other keys.

The shapes are checked here; what needs the model (a schema llguidance compiles, a tool plan, a tool_choice
naming a tool) is checked by Engine.batch_request, whose errors api_error maps to a 400 with their `param`.
"""

import json
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Union

from ..errors import MlxInferError
from ..generation.sampling import SamplingParams
from ..kv.errors import KVBudgetError
from ..generation.logprobs import MAX_TOP_LOGPROBS
from ..structured.constraint import response_format as response_format_constraint
from .defaults import MAX_COMPLETION_LOGPROBS, MAX_N, MAX_STOP


class APIError(Exception):
    """An error answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}.

    Args:
        status: the HTTP status (400 bad request, 401, 404, 413, 429, 500, ...).
        message: one line saying what was wrong and what to do.
        param: the request field at fault, if one.
        kind: OpenAI's error type ("invalid_request_error", "authentication_error", "rate_limit_error",
            "server_error").
        headers: HTTP headers the answer carries (e.g. {"Retry-After": "5"} on a 503); None: none.
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None, headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    """A checked request: prompt (chat messages [{"role", "content"}, with "tool_calls" / "tool_call_id" where
    given] or a string or token ids), its SamplingParams (max_tokens None: the server's default), and how to
    answer.

    Attributes:
        n: choices to generate (1..MAX_N), each its own request; with a seed, choice i uses seed + i.
        response_format: OpenAI's response_format (None or {"type": "text"}: free text).
        tools, tool_choice, parallel_tool_calls: OpenAI's tool fields as given (None: absent).
        logprobs: None (off) or the alternatives per token to report (chat: top_logprobs; completions: the
            legacy int).
        model: the model the request names (None: the server's default).
        keep_alive: seconds the model stays loaded after this request (Ollama's `keep_alive`: 0 unloads it
            after the request, negative keeps it loaded; None: the server's --keep-alive).
    """

    prompt: Union[str, List[dict], List[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1
    response_format: Optional[dict] = None
    tools: Optional[List[dict]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[int] = None
    model: Optional[str] = None
    keep_alive: Optional[float] = None

    def choice_params(self, index: int) -> SamplingParams:
        """The SamplingParams of choice `index`: seed + index (mod 2**64) when a seed is given."""
        if self.params.seed is None or index == 0:
            return self.params
        return replace(self.params, seed=(self.params.seed + index) % 2 ** 64)

    def engine_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of Engine.batch_request for the fields given (those absent are left out)."""
        kw: Dict[str, Any] = {}
        if self.response_format is not None:
            kw["response_format"] = self.response_format
        if self.tools is not None:
            kw["tools"] = self.tools
        if self.tool_choice is not None:
            kw["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            kw["parallel_tool_calls"] = self.parallel_tool_calls
        if self.logprobs is not None:
            kw["logprobs"] = self.logprobs
        return kw


_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
           "presence_penalty", "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty", "n", "logprobs",
           "keep_alive"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "response_format", "tools", "tool_choice",
                         "parallel_tool_calls", "top_logprobs"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
#: Fields accepted only at these values (what the server does anyway), compared with their JSON types.
_ONLY = {"echo": (False, None)}
#: tool_choice's string values.
TOOL_CHOICES = ("none", "auto", "required")
#: OpenAI's range of temperature.
MAX_TEMPERATURE = 2.0


def api_error(error: MlxInferError, prompt_field: str = "prompt") -> APIError:
    """The OpenAI error object of a library error, from its attributes (never its text): its HTTP `status`
    and `param` (a prompt's error names the body's prompt field: "messages" for a chat); 5xx statuses are
    server errors. A KVBudgetError is the client's to fix through its request: 400 on max_tokens, with that
    advice (the budget is the server's --kv-budget)."""
    if isinstance(error, KVBudgetError):
        return APIError(400, f"{error.problem}: lower max_tokens or shorten the prompt (the server's --kv-budget "
                             "sets the budget)", "max_tokens")
    param = prompt_field if error.param == "prompt" else error.param
    return APIError(error.status, str(error), param, kind="server_error" if error.status >= 500 else "invalid_request_error")


def generation_failed(error: BaseException) -> APIError:
    """The error object of a request the runner failed: the runner's own errors as their types say
    (GenerationError 500 'generation failed: ...', RunnerClosedError 503), anything else a 500 prefixed with
    'generation failed:'."""
    if isinstance(error, MlxInferError):
        return api_error(error)
    return APIError(500, f"generation failed: {error}", kind="server_error")


class ShuttingDown:
    """Put in a request's step queue when the server stops: the request ends at once (SSE: an error event,
    then [DONE]; not streaming: 503)."""


def _same(a, b) -> bool:
    """JSON equality: 0 is not false, 1 is not true."""
    return type(a) is type(b) and a == b
_NUMBERS = {"temperature": float, "top_p": float, "presence_penalty": float, "frequency_penalty": float,
            "min_p": float, "repetition_penalty": float, "top_k": int, "seed": int}


def _number(body: dict, name: str, kind) -> Any:
    v = body[name]
    ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {json.dumps(v)}", name)
    return kind(v)


def _stops(v) -> tuple:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > MAX_STOP:
        raise APIError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", "stop")
    return tuple(v)


def _text(content, i: int, role: str, nullable: bool) -> str:
    """A message's content as one string: a string, or text parts joined; null where `nullable` (then "")."""
    if content is None and nullable:
        return ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported (no images or audio)", "messages")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}].content must be a string or a list of text parts"
                            + (" (or null with tool_calls)" if role == "assistant" else ""), "messages")
    return content


def _tool_calls(calls, i: int) -> List[dict]:
    """An assistant message's tool_calls in OpenAI's shape [{"id", "type": "function", "function": {"name",
    "arguments" (JSON text)}}], checked."""
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list of tool calls", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(fn, dict) or call.get("type", "function") != "function" or not isinstance(call.get("id"), str)
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
            raise APIError(400, f"messages[{i}].tool_calls[{j}] must be {{\"id\": str, \"type\": \"function\", "
                                "\"function\": {\"name\": str, \"arguments\": JSON text}}", "messages")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


#: Fields each role's message may carry besides role and content.
_MESSAGE_FIELDS = {"system": {"name"}, "developer": {"name"}, "user": {"name"},
                   "assistant": {"name", "tool_calls", "refusal"}, "tool": {"tool_call_id", "name"}}


def _messages(v) -> List[dict]:
    """Chat messages for the prompt codec: {"role", "content" (a string)}, plus "tool_calls" (assistant) and
    "tool_call_id" (tool); "developer" becomes "system"."""
    if not isinstance(v, list) or not v:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _MESSAGE_FIELDS:
            raise APIError(400, f"messages[{i}] needs a 'role' of system, developer, user, assistant or tool", "messages")
        extra = set(m) - {"role", "content"} - _MESSAGE_FIELDS[role]
        if extra:
            raise APIError(400, f"messages[{i}]: unsupported field '{sorted(extra)[0]}' for role {role}", "messages")
        calls = _tool_calls(m["tool_calls"], i) if m.get("tool_calls") is not None else None
        message = {"role": "system" if role == "developer" else role,
                   "content": _text(m.get("content"), i, role, nullable=bool(calls))}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise APIError(400, f"messages[{i}]: a tool message needs the 'tool_call_id' of the call it answers",
                               "messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def _prompt(v) -> Union[str, List[int]]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
        v = v[0]
    if isinstance(v, str) and v:
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        return v
    raise APIError(400, "'prompt' must be a non-empty string, a list of one string, or a list of token ids "
                        "(several prompts in one request are not supported: send one request each)", "prompt")


def _check_text(prompt, stops: List[str]) -> None:
    """400 for text that is not valid Unicode (a lone surrogate from a JSON escape)."""
    texts = [m["content"] for m in prompt] if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else (
        [prompt] if isinstance(prompt, str) else [])
    for t in texts + stops:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request holds text that is not valid Unicode (a lone surrogate escape)") from None


def _int_in(body: dict, name: str, low: int, high: int, what: str = "") -> int:
    """body[name], an integer in [low, high], else a 400 naming the field."""
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise APIError(400, f"'{name}' must be an integer from {low} to {high}{what}, got {json.dumps(v)}", name)
    return v


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """The alternatives per token to report (None: logprobs off). Chat: `logprobs` true/false and
    `top_logprobs` 0..MAX_TOP_LOGPROBS (only with logprobs true); completions: `logprobs` null or an int
    0..MAX_COMPLETION_LOGPROBS (false is taken as null)."""
    given = body.get("logprobs")
    if not chat:
        if given is None or given is False:
            return None
        return _int_in(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS, " (OpenAI's legacy completions limit)")
    if given is not None and not isinstance(given, bool):
        raise APIError(400, f"'logprobs' must be true or false, got {json.dumps(given)}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        top = _int_in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not given:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if given else None


def _response_format(v) -> Optional[dict]:
    """OpenAI's response_format, its shape checked (None: free text); the schema itself is compiled by the
    engine. Raises APIError 400 (param response_format)."""
    if v is None:
        return None
    try:
        response_format_constraint(v)
    except MlxInferError as e:
        raise api_error(e) from None
    if v.get("type") == "json_schema":
        spec = v["json_schema"]
        if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise APIError(400, "response_format.json_schema: 'name' must be a string and 'strict' a boolean",
                           "response_format")
    return None if v.get("type") == "text" else v


def _tools(body: dict) -> tuple:
    """(tools, tool_choice, parallel_tool_calls) as given, their JSON types checked (the tool plan, built by
    the engine, checks the functions and that a named tool_choice is one of them)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise APIError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    if choice is not None:
        named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str)
        if not named and choice not in TOOL_CHOICES:
            raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                "\"function\": {\"name\": ...}}", "tool_choice")
        if not tools and choice != "none":
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    return tools or None, choice, parallel


#: Seconds per unit of a keep_alive duration string (Ollama's: "30s", "5m", "1h").
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive(v: Any) -> Optional[float]:
    """A request's `keep_alive` in seconds, as Ollama takes it: a number of seconds or a duration string
    ("30s", "5m", "1h", "-1"); 0 unloads the model after the request, a negative value keeps it loaded; None:
    absent. Raises APIError 400 (param keep_alive) for anything else."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf"):
        return float(v)
    if isinstance(v, str):
        text = v.strip().lower()
        unit = next((u for u in ("ms", "s", "m", "h") if text.endswith(u)), "")
        try:
            number = float(text[:len(text) - len(unit)])
        except ValueError:
            number = None
        if number is not None and number == number and abs(number) != float("inf"):
            return number * _DURATION_UNITS.get(unit, 1.0)
    raise APIError(400, f"'keep_alive' must be seconds (a number) or a duration such as \"5m\", \"30s\" or \"1h\" "
                        f"(0: unload after this request, -1: keep loaded), got {json.dumps(v)}", "keep_alive")


def parse(body: Any, chat: bool, max_tokens_limit: int, default_max_tokens: int) -> ParsedRequest:
    """Check a /v1/chat/completions (chat=True) or /v1/completions body.

    Raises:
        APIError(400): not a JSON object, an unknown or unsupported field, a bad value (the message names
            the field), max_tokens above max_tokens_limit.
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in allowed:
            raise APIError(400, f"unsupported field '{name}'", name)
    for name, values in _ONLY.items():
        if name in body and not any(_same(body[name], v) for v in values):
            raise APIError(400, f"'{name}' is supported only as {json.dumps(values[0])}, got {json.dumps(body[name])}", name)
    key = "messages" if chat else "prompt"
    if key not in body:
        raise APIError(400, f"'{key}' is required", key)
    prompt = _messages(body["messages"]) if chat else _prompt(body["prompt"])
    kw: Dict[str, Any] = {}
    for name, kind in _NUMBERS.items():
        if body.get(name) is not None:
            kw[name] = _number(body, name, kind)
    limit = body.get("max_completion_tokens") if chat and body.get("max_completion_tokens") is not None else body.get("max_tokens")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if limit is not None:
        limit = _number({name: limit}, name, int)
        if not 1 <= limit <= max_tokens_limit:
            raise APIError(400, f"'{name}' must be between 1 and {max_tokens_limit} (the server's limit), got {limit}", name)
    kw["max_tokens"] = limit if limit is not None else default_max_tokens
    if body.get("stop") is not None:
        kw["stop"] = _stops(body["stop"])
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, "'stream_options' supports only {\"include_usage\": true|false}", "stream_options")
    if options and not stream:
        raise APIError(400, "'stream_options' needs 'stream': true", "stream_options")
    if "model" in body and not isinstance(body["model"], str):
        raise APIError(400, "'model' must be a string", "model")
    if kw.get("temperature", 0) > MAX_TEMPERATURE:
        raise APIError(400, f"'temperature' must be between 0 and {MAX_TEMPERATURE}, got {kw['temperature']}", "temperature")
    _check_text(prompt, list(kw.get("stop", ())))
    n = _int_in(body, "n", 1, MAX_N, " (this server's limit)") if body.get("n") is not None else 1
    logprobs = _logprobs(body, chat)
    response_format = _response_format(body.get("response_format")) if chat else None
    tools, tool_choice, parallel = _tools(body) if chat else (None, None, None)
    try:
        params = SamplingParams(**kw)
    except MlxInferError as e:
        raise api_error(e) from None
    return ParsedRequest(prompt, params, stream, bool(options.get("include_usage", False)), n, response_format,
                         tools, tool_choice, parallel, logprobs, body.get("model"), keep_alive(body.get("keep_alive")))
