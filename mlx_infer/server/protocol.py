"""The OpenAI request bodies the server takes, checked field by field: what is supported is turned into
SamplingParams, what is not is a 400 that names the field (never ignored in silence).

Supported: `model` (any id: one model is served), `messages` (chat) / `prompt` (completions: a string, a
list of one string, or token ids), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`,
`stop` (a string or up to MAX_STOP strings), `stream`, `stream_options.include_usage`, `presence_penalty`,
`frequency_penalty`, `user` (ignored, as OpenAI stores it); as llama-server and mlx_lm.server, `top_k`, `min_p`
and `repetition_penalty`. Accepted only at their default: `n` (1), `logprobs` (false), `echo` (false),
`response_format` ({"type": "text"}), `tool_choice` ("none"), `stream_options` without other keys.
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from ..errors import MlxInferError
from ..generation.sampling import SamplingParams
from ..kv.errors import KVBudgetError
from .defaults import MAX_STOP


class APIError(Exception):
    """An error answered as OpenAI's error object: {"error": {"message", "type", "param", "code"}}.

    Args:
        status: the HTTP status (400 bad request, 401, 404, 413, 429, 500, ...).
        message: one line saying what was wrong and what to do.
        param: the request field at fault, if one.
        kind: OpenAI's error type ("invalid_request_error", "authentication_error", "rate_limit_error",
            "server_error").
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class ParsedRequest:
    """A checked request: prompt (chat messages [{"role", "content"}] or a string or token ids), its
    SamplingParams (max_tokens None: the server's default), and how to answer."""

    prompt: Union[str, List[dict], List[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool


_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
           "presence_penalty", "frequency_penalty", "user", "top_k", "min_p", "repetition_penalty", "n", "logprobs"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "response_format", "tool_choice"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
#: Fields accepted only at these values (what the server does anyway), compared with their JSON types.
_ONLY = {"n": (1,), "logprobs": (False, None), "echo": (False, None), "tool_choice": ("none", None),
         "response_format": ({"type": "text"}, None)}
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


def _messages(v) -> List[dict]:
    if not isinstance(v, list) or not v:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise APIError(400, f"messages[{i}] needs a 'role' of system, developer, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported (no images or audio)", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise APIError(400, f"messages[{i}]: unsupported field '{sorted(extra)[0]}' (tool calls are not supported)", "messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
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
    try:
        params = SamplingParams(**kw)
    except MlxInferError as e:
        raise api_error(e) from None
    return ParsedRequest(prompt, params, stream, bool(options.get("include_usage", False)))
