"""POST /v1/responses: OpenAI's Responses API on the server's one pipeline (lease, build, submit, steps, done).

The body is translated at the edge into the chat request every API runs (protocol.ParsedRequest):

- `input`: a string (one user message) or items: messages (role user / system / developer / assistant; content
  a string or `input_text` / `output_text` parts), `function_call` items (-> an assistant message's
  `tool_calls`; consecutive calls join one message) and `function_call_output` items (-> a `tool` message);
- `instructions` -> a system message first (not carried to a later response, as OpenAI does);
- `tools` (function tools, flat: {"type": "function", "name", "description", "parameters", "strict"}) -> chat
  tools; `tool_choice` ("none" | "auto" | "required" | {"type": "function", "name"}); `parallel_tool_calls`;
- `text.format` (text, json_object, json_schema {name, schema, strict}) -> response_format;
- `max_output_tokens`, `temperature`, `top_p`, `stream`, `metadata` (echoed), `user` (unused);
- `previous_response_id`: the conversation of a response this server stored (its input and output, in this
  server's lifetime: ResponseStore, least recently used dropped first) goes before `input`; an unknown id is a
  404 (code previous_response_not_found). `store: false` keeps the response out of the store.

Anything else is a 400 naming the field. The answer is a response object (output items: a `message` with one
`output_text` part, `function_call` items with `call_id`, `name`, `arguments`; usage input / output / total
tokens; status "completed", or "incomplete" with reason max_output_tokens), or, streaming, the Responses events
(`response.created`, `response.in_progress`, per item `response.output_item.added`, for a message
`response.content_part.added`, `response.output_text.delta`... `.done`, `response.content_part.done`, for a call
`response.function_call_arguments.delta`... `.done`, then `response.output_item.done`; last
`response.completed` or `response.incomplete`), each with its `sequence_number`. Errors are OpenAI's error
objects (protocol.APIError); a failure after the stream started is a `response.failed` event.
"""

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import MlxInferError
from ..generation.results import GenerationStep, ToolCall
from ..generation.sampling import SamplingParams
from .defaults import RESPONSES_STORE_CHARS, RESPONSES_STORE_SIZE
from .protocol import APIError, ParsedRequest, api_error
from .steps import ClientGone, StepWaiter, step_error

#: The body's fields; those in _ONLY only at the values listed (what the server does anyway).
FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
          "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id", "store", "metadata",
          "user", "truncation", "include", "background"}
_ONLY = {"truncation": ("disabled",), "include": ([],), "background": (False,)}
#: The chat pipeline's param names -> the Responses body's.
_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
           "max_tokens": "max_output_tokens"}
_ROLES = ("user", "system", "developer", "assistant")
MAX_TEMPERATURE = 2.0


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ---- the body -> a chat request


def _text_of(content: Any, where: str, role: str) -> str:
    """A message item's content as one string: a string, or text parts (`input_text`, `output_text`; `text`)
    joined. Raises APIError 400 (param input) for other parts (images, files, audio)."""
    if isinstance(content, str):
        return content
    kinds = ("output_text", "text", "refusal") if role == "assistant" else ("input_text", "text")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        parts = [p.get("text", p.get("refusal")) for p in content]
        if all(isinstance(t, str) for t in parts):
            return "".join(parts)
    raise APIError(400, f"{where}.content must be a string or a list of "
                        f"{' / '.join(repr(k) for k in kinds[:1])} parts with 'text' (no images, files or audio)", "input")


def _call_of(item: dict, where: str) -> dict:
    """A `function_call` item as a chat tool call {"id", "type", "function": {"name", "arguments"}}."""
    if not all(isinstance(item.get(k), str) and item.get(k) for k in ("call_id", "name")) \
            or not isinstance(item.get("arguments"), str):
        raise APIError(400, f"{where}: a function_call item needs 'call_id', 'name' and 'arguments' (JSON text)", "input")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def _output_of(item: dict, where: str) -> dict:
    """A `function_call_output` item as a chat `tool` message."""
    output = item.get("output")
    if isinstance(output, list):
        output = _text_of(output, where, "user")
    if not isinstance(item.get("call_id"), str) or not item["call_id"] or not isinstance(output, str):
        raise APIError(400, f"{where}: a function_call_output item needs the 'call_id' it answers and its 'output' "
                            "(a string)", "input")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def input_messages(value: Any) -> List[dict]:
    """`input` as chat messages: a string is one user message; items become messages (developer -> system),
    function_call items the tool_calls of an assistant message (joined to the assistant message just before
    them), function_call_output items tool messages.

    Raises:
        APIError: 400 (param input) for an empty input, an item of another type, a malformed item.
    """
    if isinstance(value, str):
        if not value:
            raise APIError(400, "'input' must be a non-empty string or a non-empty list of items", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, "'input' must be a non-empty string or a non-empty list of items", "input")
    out: List[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{where} needs a 'role' of user, system, developer or assistant", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_of(item.get("content"), where, role)})
        elif kind == "function_call":
            call = _call_of(item, where)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_output_of(item, where))
        else:
            raise APIError(400, f"{where}: items of type {json.dumps(kind)} are not supported (message, "
                                "function_call and function_call_output are)", "input")
    return out


def chat_tools(tools: Any) -> Optional[List[dict]]:
    """Function tools in the chat shape {"type": "function", "function": {name, description, parameters,
    strict}}. Raises APIError 400 (param tools) for another tool type (web_search, file_search, ...)."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise APIError(400, "'tools' must be a list of {\"type\": \"function\", \"name\", \"parameters\"} objects", "tools")
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, got type {json.dumps(t.get('type'))}",
                           "tools")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
    return out or None


def chat_tool_choice(choice: Any, tools: Optional[List[dict]]) -> Any:
    """tool_choice in the chat shape: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}.
    Raises APIError 400 (param tool_choice)."""
    if choice is None:
        return None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"name\": ...}", "tool_choice")
    if not tools and choice != "none":
        raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
    return choice


def response_format(text: Any) -> Optional[dict]:
    """`text.format` as chat's response_format (None: free text); the schema is compiled by the engine.
    Raises APIError 400 (param text.format)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise APIError(400, "'text' supports only {\"format\": {...}}", "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict) and isinstance(fmt.get("name", ""), str) \
            and isinstance(fmt.get("strict", False), (bool, type(None))) and not set(fmt) - {
                "type", "name", "schema", "strict", "description"}:
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError(400, "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                        "\"json_schema\", \"name\", \"schema\": {...}, \"strict\"}", "text.format")


def _number(body: dict, name: str, low: float, high: float) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high:
        raise APIError(400, f"'{name}' must be a number from {low:g} to {high:g}, got {json.dumps(v)}", name)
    return float(v)


def _check_fields(body: Any) -> None:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name in body:
        if name not in FIELDS:
            raise APIError(400, f"unsupported field '{name}'", name)
    for name, values in _ONLY.items():
        if body.get(name) is not None and body[name] not in values:
            raise APIError(400, f"'{name}' is supported only as {json.dumps(values[0])}, got {json.dumps(body[name])}",
                           name)
    for name, kind in (("model", str), ("instructions", str), ("previous_response_id", str), ("user", str)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise APIError(400, f"'{name}' must be a string", name)
    for name in ("stream", "store", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise APIError(400, f"'{name}' must be true or false", name)
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())):
        raise APIError(400, "'metadata' must be an object of string values", "metadata")
    if "input" not in body:
        raise APIError(400, "'input' is required", "input")


def _check_unicode(messages: List[dict]) -> None:
    """400 for text that is not valid Unicode (a lone surrogate from a JSON escape)."""
    for m in messages:
        texts = [m["content"]] + [c["function"]["arguments"] for c in m.get("tool_calls", [])]
        try:
            for t in texts:
                t.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request holds text that is not valid Unicode (a lone surrogate escape)",
                           "input") from None


def _max_output_tokens(body: dict, limit: int, default: int) -> int:
    v = body.get("max_output_tokens")
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limit:
        raise APIError(400, f"'max_output_tokens' must be an integer from 1 to {limit} (the server's limit), "
                            f"got {json.dumps(v)}", "max_output_tokens")
    return v


@dataclass
class ResponsesRequest:
    """A checked /v1/responses body.

    Attributes:
        parsed: the chat request the pipeline runs (prompt: instructions + history).
        history: the conversation before this response's output, without instructions (what a later
            previous_response_id continues).
        echo: the request's fields the response object repeats (instructions, tools, tool_choice, text, ...).
        store: whether the response is kept for previous_response_id.
    """

    parsed: ParsedRequest
    history: List[dict]
    echo: Dict[str, Any]
    store: bool = True


def parse_body(body: Any, store: "ResponseStore", max_tokens_limit: int, default_max_tokens: int) -> ResponsesRequest:
    """Check a /v1/responses body and translate it to a chat request.

    Raises:
        APIError: 400 naming the field for an unsupported field or a bad value; 404 previous_response_not_found.
    """
    _check_fields(body)
    previous = body.get("previous_response_id")
    history = (store.get(previous) if previous is not None else []) + input_messages(body["input"])
    _check_unicode(history)
    instructions = body.get("instructions")
    prompt = ([{"role": "system", "content": instructions}] if instructions else []) + history
    tools = chat_tools(body.get("tools"))
    choice = chat_tool_choice(body.get("tool_choice"), tools)
    temperature, top_p = _number(body, "temperature", 0, MAX_TEMPERATURE), _number(body, "top_p", 0, 1)
    kw: Dict[str, Any] = {k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None}
    try:
        params = SamplingParams(max_tokens=_max_output_tokens(body, max_tokens_limit, default_max_tokens), **kw)
    except MlxInferError as e:
        raise api_error(e) from None
    parsed = ParsedRequest(prompt, params, bool(body.get("stream", False)), False, 1, response_format(body.get("text")),
                           tools, choice, body.get("parallel_tool_calls"), None, body.get("model"))
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "store": body.get("store", True), "truncation": "disabled", "user": body.get("user")}
    return ResponsesRequest(parsed, history, echo, body.get("store", True))


# ---- the store of responses (previous_response_id)


class ResponseStore:
    """The conversations of recent responses by id (chat messages: input and output), least recently used
    dropped first beyond `max_items` or `max_chars` (the characters of all stored messages' text), so that a
    server running for weeks holds a bounded amount.

    Args:
        max_items: responses kept at most.
        max_chars: text characters kept at most (one conversation over it is not kept).
    """

    def __init__(self, max_items: int = RESPONSES_STORE_SIZE, max_chars: int = RESPONSES_STORE_CHARS):
        self.max_items, self.max_chars = max_items, max_chars
        self._items: "OrderedDict[str, Tuple[List[dict], int]]" = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> List[dict]:
        """A copy of the stored conversation of `response_id`; raises APIError 404 (previous_response_not_found)."""
        entry = self._items.get(response_id)
        if entry is None:
            raise APIError(404, f"previous response {response_id!r} is not stored on this server (responses are kept "
                                "in memory while it runs, the least recently used dropped first; send the whole "
                                "conversation as 'input' instead)", "previous_response_id",
                           code="previous_response_not_found")
        self._items.move_to_end(response_id)
        return [dict(m) for m in entry[0]]

    def put(self, response_id: str, messages: List[dict]) -> None:
        """Keep a conversation (dropping the least recently used over the bounds)."""
        size = sum(len(m.get("content") or "") + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
                   for m in messages)
        if size > self.max_chars:
            return
        self._items[response_id] = (messages, size)
        self.chars += size
        while len(self._items) > self.max_items or self.chars > self.max_chars:
            _, (_, dropped) = self._items.popitem(last=False)
            self.chars -= dropped


# ---- output items


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """A message output item; "in_progress" (just opened) has no content part yet, "completed" and "incomplete"
    (cut by max_output_tokens) carry the text."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [] if status == "in_progress" else
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(content: str, calls: List[ToolCall], status: str = "completed") -> List[dict]:
    """The output of a whole answer: a message (when it has text, or nothing else), then one item per call;
    the last item has `status` (the response's: "incomplete" when max_output_tokens cut it), the others
    "completed"."""
    items = [message_item(_new_id("msg"), content)] if content or not calls else []
    items += [call_item(_new_id("fc"), c.id, c.name, c.arguments) for c in calls]
    items[-1]["status"] = status
    return items


def assistant_message(output: List[dict]) -> dict:
    """The chat message of a response's output items (what previous_response_id continues)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in output if i["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def response_usage(final: Optional[GenerationStep]) -> Optional[dict]:
    if final is None:
        return None
    s = final.stats
    return {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_prompt_tokens},
            "output_tokens": s.generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": s.prompt_tokens + s.generated_tokens}


@dataclass
class ResponseObject:
    """The response object's fields, filled as the answer is made."""

    id: str
    model: str
    echo: Dict[str, Any]
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: List[dict], final: Optional[GenerationStep] = None,
             error: Optional[dict] = None) -> dict:
        """The object with `status` ("in_progress", "completed", "incomplete", "failed"), its output and usage."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
                "usage": response_usage(final), **self.echo}


def status_of(final: GenerationStep) -> str:
    return "incomplete" if final.finish_reason == "length" else "completed"


# ---- streaming


class EventStream:
    """The Responses events of one streamed answer (SSE with `event:` lines), numbered in order; the items
    opened and closed as the text and calls come (`text`, `call`, `arguments`, `close`)."""

    def __init__(self, obj: ResponseObject):
        self.obj = obj
        self.seq = 0
        self.output: List[dict] = []       # items done
        self.open: Optional[dict] = None  # the item being streamed
        self.buffer = ""                  # its text or arguments so far

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def start(self) -> List[str]:
        snapshot = self.obj.body("in_progress", [])
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def _index(self) -> int:
        return len(self.output)

    def text(self, piece: str) -> List[str]:
        """A piece of the message's text (opens the message item first)."""
        out: List[str] = []
        if self.open is not None and self.open["type"] != "message":
            out += self.close()
        if self.open is None:
            self.open, self.buffer = message_item(_new_id("msg"), "", "in_progress"), ""
            out.append(self.event("response.output_item.added", output_index=self._index(), item=self.open))
            out.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=self._index(),
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        if piece:
            self.buffer += piece
            out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=self._index(),
                                  content_index=0, delta=piece, logprobs=[]))
        return out

    def call(self, call_id: str, name: str) -> List[str]:
        """A function call starts (closes the item before it)."""
        out = self.close()
        self.open, self.buffer = call_item(_new_id("fc"), call_id, name, "", "in_progress"), ""
        out.append(self.event("response.output_item.added", output_index=self._index(), item=self.open))
        return out

    def arguments(self, piece: str) -> List[str]:
        self.buffer += piece
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=self._index(), delta=piece)]

    def close(self, status: str = "completed") -> List[str]:
        """The events closing the open item with `status` (none when none is open)."""
        item, index = self.open, self._index()
        if item is None:
            return []
        out: List[str] = []
        if item["type"] == "message":
            done = message_item(item["id"], self.buffer, status)
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                  text=self.buffer, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=done["content"][0]))
        else:
            done = call_item(item["id"], item["call_id"], item["name"], self.buffer, status)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=self.buffer))
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.open = None
        return out

    def finish(self, final: GenerationStep) -> List[str]:
        """The last events: the open item closed (an empty message when nothing was said), then
        response.completed (or response.incomplete when cut by max_output_tokens)."""
        out = self.text("") if not self.output and self.open is None else []
        status = status_of(final)
        out += self.close(status)
        return out + [self.event(f"response.{status}", response=self.obj.body(status, self.output, final))]

    def failed(self, error: APIError) -> List[str]:
        return [self.event("response.failed", response=self.obj.body(
            "failed", self.output, error={"code": error.code or error.kind, "message": error.message}))]


def _events_of(stream: EventStream, tools, text: str, last: bool) -> List[str]:
    """The events of a step's text: through the request's ToolStream when it has tools."""
    if tools is None:
        return stream.text(text) if text else []
    events = (tools.feed(text) if text else []) + (tools.finish() if last else [])
    out: List[str] = []
    for e in events:
        if e.kind == "content":
            out += stream.text(e.text) if e.text else []
        elif e.kind == "call":
            out += stream.call(e.id, e.name)
        elif e.text:
            out += stream.arguments(e.text)
    return out


# ---- the route


def _renamed(error: APIError) -> APIError:
    """An error of the chat pipeline with its param named as the Responses body names it."""
    error.param = _PARAMS.get(error.param, error.param)
    return error


class Responses:
    """The /v1/responses route of a server (app.Server: check_auth, read_json, lease, build, submit, done,
    config) and its store of responses.

    Args:
        server: the app's Server.
        store: where responses are kept for previous_response_id (a fresh ResponseStore by default).
    """

    def __init__(self, server, store: Optional[ResponseStore] = None):
        self.server = server
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        """POST /v1/responses."""
        server = self.server
        server.check_auth(request)
        body = await server.read_json(request)
        req = parse_body(body, self.store, server.config.max_tokens_limit, server.config.default_max_tokens)
        lease = server.lease(req.parsed.model)
        served = await lease.__aenter__()
        try:
            try:
                batch_request = server.build(served, req.parsed, 0)
            except APIError as e:
                raise _renamed(e) from None
            handles, steps = server.submit(served, [batch_request], "responses")
        except BaseException:
            await lease.__aexit__(None, None, None)
            raise
        obj = ResponseObject(_new_id("resp"), served.id, req.echo)
        plan = getattr(batch_request, "tools", None)
        if req.parsed.stream:
            return StreamingResponse(self.events(lease, handles, steps, obj, plan, req),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            texts, final = await self.collect(request, steps)
        finally:
            server.done(handles)
            await lease.__aexit__(None, None, None)
        if final is None:
            return Response(status_code=499)
        text = "".join(texts)
        content, calls = (plan.parse(text)[0], list(final.tool_calls or [])) if plan is not None else (text, [])
        status = status_of(final)
        output = output_items(content, calls, status)
        self.keep(obj, req, output)
        return JSONResponse(obj.body(status, output, final))

    async def collect(self, request: Request, steps: asyncio.Queue) -> Tuple[List[str], Optional[GenerationStep]]:
        """(the steps' texts, the final step) of a request not streamed; (texts, None) when the client went away.
        Raises APIError: 503 when the server shuts down, the runner's failure."""
        texts: List[str] = []
        waiter = StepWaiter(steps, request)
        while True:
            try:
                _, step = await waiter.next()
            except ClientGone:
                return texts, None
            texts.append(step.text)
            if step.finish_reason is not None:
                return texts, step

    def keep(self, obj: ResponseObject, req: ResponsesRequest, output: List[dict]) -> None:
        """Store the conversation (history + the output) under the response's id, unless store is false."""
        if req.store:
            self.store.put(obj.id, req.history + [assistant_message(output)])

    async def events(self, lease, handles, steps: asyncio.Queue, obj: ResponseObject, plan,
                     req: ResponsesRequest) -> AsyncIterator[str]:
        """The SSE stream of a response (EventStream); the request ends with it, also when the client goes."""
        stream = EventStream(obj)
        tools = plan.stream() if plan is not None else None
        try:
            for e in stream.start():
                yield e
            while True:
                _, step = await steps.get()
                err = step_error(step)
                if err is not None:
                    for e in stream.failed(err):
                        yield e
                    break
                last = step.finish_reason is not None
                for e in _events_of(stream, tools, step.text, last):
                    yield e
                if last:
                    for e in stream.finish(step):
                        yield e
                    self.keep(obj, req, stream.output)
                    break
        finally:
            self.server.done(handles)
            await lease.__aexit__(None, None, None)
