"""The Anthropic Messages API on the server's one request pipeline: POST /v1/messages (a whole message, or
Anthropic's server-sent events) and POST /v1/messages/count_tokens.

A body is translated at the edge into a protocol.ParsedRequest of OpenAI chat messages: `system` (a string or
text blocks) the system message, text blocks joined, an assistant's `tool_use` blocks its `tool_calls`
(input as JSON text), a user's `tool_result` blocks `tool` messages (`is_error` results prefixed "Error: "),
`tools` with `input_schema` function tools, `tool_choice` auto / any / tool / none as auto / required / the
named function / none (`disable_parallel_tool_use`: parallel_tool_calls false). It then runs as the OpenAI
routes do (Server.lease, build, submit, its steps, done), and its steps are read back as Anthropic content
blocks (text, tool_use) with stop_reason end_turn / max_tokens / stop_sequence (and the stop sequence that
matched) / tool_use, and usage {input_tokens, output_tokens}.

Every error of these routes, the pipeline's APIError included, is answered in Anthropic's shape
{"type": "error", "error": {"type", "message"}} (`error_body`); once a stream has begun, as an `error` event.
"""

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..generation.results import GenerationStep, ToolCall
from ..generation.sampling import SamplingParams
from ..errors import MlxInferError
from ..tools.parse import ToolEvent
from .defaults import MAX_STOP
from .protocol import APIError, ParsedRequest, api_error
from .steps import ClientGone, StepWaiter, step_error

#: Anthropic's error type of each HTTP status (others: invalid_request_error below 500, api_error above).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
#: The fields of a /v1/messages body; count_tokens takes COUNT_FIELDS.
MESSAGE_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p",
                  "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier", "cache_control"}
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control"}
#: Anthropic's range of temperature (0 here is greedy, the default as on the OpenAI routes).
MAX_TEMPERATURE = 1.0
#: The keys a content block of each type may carry (cache_control is accepted and has no effect).
BLOCK_KEYS = {"text": {"type", "text", "cache_control", "citations"},
              "tool_use": {"type", "id", "name", "input", "cache_control"},
              "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}
#: tool_choice types -> OpenAI's tool_choice ("tool": the named function).
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def error_body(e: APIError) -> dict:
    """Anthropic's error object of an APIError: {"type": "error", "error": {"type", "message"}}, the type
    from the status (ERROR_TYPES)."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: APIError) -> JSONResponse:
    """The answer of an APIError in Anthropic's shape, with its headers (a 503's Retry-After)."""
    return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)


# ---- the request body


def _bad(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param)


def _keys(block: dict, allowed: set, where: str, param: str) -> None:
    """400 (param `param`) for a key of `block` not in `allowed` with a value; `where` names the object in the
    message. A null one is no request (the SDK's model_dump() of a response block has `caller`: None ...)."""
    extra = sorted(k for k in set(block) - allowed if block[k] is not None)
    if extra:
        raise _bad(f"{where}: unsupported field '{extra[0]}'", param)


def _text_block(block: Any, where: str, param: str = "messages") -> str:
    """A text block's text; raises a 400 naming `where` for another block or a bad one."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
        raise _bad(f"{where}: only text blocks are supported here, got {json.dumps(kind)}", param)
    _keys(block, BLOCK_KEYS["text"], where, param)
    if not isinstance(block.get("text"), str) or block.get("citations") is not None:
        raise _bad(f"{where}: a text block needs 'text' (a string) and no citations", param)
    return block["text"]


def _system(v: Any) -> Optional[str]:
    """`system`: a string or a list of text blocks (joined with a blank line); None when absent or empty."""
    if v is None:
        return None
    if isinstance(v, str):
        return v or None
    if not isinstance(v, list):
        raise _bad("'system' must be a string or a list of text blocks", "system")
    return "\n\n".join(_text_block(b, f"system[{i}]", "system") for i, b in enumerate(v)) or None


def _blocks(content: Any, where: str) -> List[dict]:
    """A message's content as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise _bad(f"{where} must be a string or a list of content blocks", "messages")
    for j, b in enumerate(content):
        kind = b.get("type")
        if kind not in BLOCK_KEYS:
            what = "images and documents are" if kind in ("image", "document") else f"'{kind}' blocks are"
            raise _bad(f"{where}[{j}]: {what} not supported (text, tool_use and tool_result are)", "messages")
        _keys(b, BLOCK_KEYS[kind], f"{where}[{j}]", "messages")
    return content


def _tool_result_text(block: dict, where: str) -> str:
    """A tool_result's content as text (a string or text blocks; "Error: " first when is_error)."""
    content = block.get("content", "")
    if isinstance(content, list):
        content = "".join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    if not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of text blocks", "messages")
    if not isinstance(block.get("is_error", False), bool):
        raise _bad(f"{where}.is_error must be true or false", "messages")
    return "Error: " + content if block.get("is_error") else content


def _user(blocks: List[dict], i: int) -> List[dict]:
    """A user message's chat messages: its text blocks (joined, in order) and a tool message per
    tool_result."""
    out: List[dict] = []
    texts: List[str] = []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if b["type"] == "text":
            texts.append(_text_block(b, where))
        elif b["type"] == "tool_result":
            if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
                raise _bad(f"{where}: a tool_result needs the 'tool_use_id' of the tool_use it answers", "messages")
            if texts:
                out.append({"role": "user", "content": "".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b, where)})
        else:
            raise _bad(f"{where}: tool_use blocks belong in assistant messages", "messages")
    if texts or not out:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant(blocks: List[dict], i: int) -> dict:
    """An assistant message: its text blocks joined, its tool_use blocks OpenAI `tool_calls`."""
    texts, calls = [], []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if b["type"] == "text":
            texts.append(_text_block(b, where))
        elif b["type"] == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
                raise _bad(f"{where}: a tool_use needs 'id' and 'name' (strings) and 'input' (an object)", "messages")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"])}})
        else:
            raise _bad(f"{where}: tool_result blocks belong in user messages", "messages")
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(v: Any, system: Optional[str]) -> List[dict]:
    """OpenAI chat messages of `system` and Anthropic `messages` (the last one a user's: a final assistant
    message to continue is not supported)."""
    if not isinstance(v, list) or not v:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"messages[{i}] needs a 'role' of user or assistant (the system prompt goes in 'system')",
                       "messages")
        _keys(m, {"role", "content"}, f"messages[{i}]", "messages")
        if "content" not in m:
            raise _bad(f"messages[{i}] needs 'content'", "messages")
        blocks = _blocks(m["content"], f"messages[{i}].content")
        out += [_assistant(blocks, i)] if m["role"] == "assistant" else _user(blocks, i)
    if v[-1]["role"] == "assistant":
        raise _bad("the last message is the assistant's: continuing a prefilled answer is not supported; end with a "
                   "user message", "messages")
    return out


def _tools(v: Any) -> Optional[List[dict]]:
    """Anthropic tools ({name, description, input_schema}) as OpenAI function tools (the engine's tool plan
    checks names and schemas)."""
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise _bad("'tools' must be a list of {name, description, input_schema} objects", "tools")
    out = []
    for i, t in enumerate(v):
        if t.get("type", "custom") not in ("custom", None):
            raise _bad(f"tools[{i}]: server tools ({t['type']}) are not supported; give client tools "
                       "{name, description, input_schema}", "tools")
        _keys(t, {"type", "name", "description", "input_schema", "cache_control"}, f"tools[{i}]", "tools")
        if not isinstance(t.get("input_schema"), dict):
            raise _bad(f"tools[{i}] needs 'input_schema', a JSON schema object", "tools")
        function = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            function["description"] = t["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(v: Any, tools: Optional[List[dict]]) -> Tuple[Any, Optional[bool]]:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if v is None:
        return None, None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    _keys(v, {"type", "name", "disable_parallel_tool_use"}, "tool_choice", "tool_choice")
    if kind == "tool" and not isinstance(v.get("name"), str):
        raise _bad("tool_choice {\"type\": \"tool\"} needs the 'name' of the tool to call", "tool_choice")
    if not tools and kind != "none":
        raise _bad("'tool_choice' needs 'tools'", "tool_choice")
    disable = v.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise _bad("tool_choice.disable_parallel_tool_use must be true or false", "tool_choice")
    choice = {"type": "function", "function": {"name": v["name"]}} if kind == "tool" else TOOL_CHOICES[kind]
    return choice, (not disable if disable is not None else None)


def _number(body: dict, name: str, integer: bool, low: float, high: float) -> Any:
    v = body[name]
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not low <= v <= high:
        raise _bad(f"'{name}' must be {'an integer' if integer else 'a number'} from {low} to {high}, "
                   f"got {json.dumps(v)}", name)
    return v


def _stops(v: Any) -> Tuple[str, ...]:
    if not isinstance(v, list) or len(v) > MAX_STOP or not all(isinstance(s, str) and s for s in v):
        raise _bad(f"'stop_sequences' must be a list of at most {MAX_STOP} non-empty strings", "stop_sequences")
    for s in v:
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad("'stop_sequences' holds text that is not valid Unicode (a lone surrogate escape)",
                       "stop_sequences") from None
    return tuple(v)


def _check_options(body: dict) -> None:
    """The fields accepted and unused: metadata (an object), service_tier, thinking only disabled."""
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "metadata")
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise _bad("'thinking' is not supported (only {\"type\": \"disabled\"})", "thinking")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise _bad("'service_tier' must be \"auto\" or \"standard_only\"", "service_tier")


def parse_messages(body: Any, max_tokens_limit: int, count: bool = False) -> ParsedRequest:
    """Check a /v1/messages body (count: a /v1/messages/count_tokens body, no max_tokens or sampling) and
    translate it into the pipeline's ParsedRequest.

    Raises:
        APIError(400): not a JSON object, an unknown or unsupported field, a missing or bad value (the message
            names the field), max_tokens outside 1 .. max_tokens_limit.
    """
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    allowed = COUNT_FIELDS if count else MESSAGE_FIELDS
    for name in body:
        if name not in allowed:
            raise _bad(f"unsupported field '{name}'", name)
    for name in ("messages",) if count else ("messages", "max_tokens"):
        if body.get(name) is None:
            raise _bad(f"'{name}' is required", name)
    if "model" in body and not isinstance(body["model"], str):
        raise _bad("'model' must be a string", "model")
    _check_options(body)
    messages = _messages(body["messages"], _system(body.get("system")))
    tools = _tools(body.get("tools"))
    tool_choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    kw: Dict[str, Any] = {"max_tokens": 1 if count else _number(body, "max_tokens", True, 1, max_tokens_limit)}
    for name, integer, high in (("temperature", False, MAX_TEMPERATURE), ("top_p", False, 1.0), ("top_k", True, 2 ** 31)):
        if body.get(name) is not None:
            kw[name] = _number(body, name, integer, 0, high)
    if body.get("stop_sequences"):
        kw["stop"] = _stops(body["stop_sequences"])
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    try:
        params = SamplingParams(**kw)
    except MlxInferError as e:
        raise api_error(e) from None
    return ParsedRequest(messages, params, stream, False, tools=tools, tool_choice=tool_choice,
                         parallel_tool_calls=parallel, model=body.get("model"))


# ---- the answer


def _tool_use(call: ToolCall) -> Optional[dict]:
    """The tool_use block of a call (None when its arguments are not a JSON object: cut off by max_tokens)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return None
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": arguments} if isinstance(arguments, dict) else None


class Message:
    """The assistant message of one request, fed its steps in order: the whole message's content blocks, or
    the stream's content block events.

    Args:
        plan: the request's ToolPlan (None without tools).
        stops: the request's stop sequences.
        decode: token ids -> text (Engine.decode), to find the stop sequence that ended the text.
    """

    def __init__(self, plan, stops: Sequence[str], decode: Callable[[List[int]], str]):
        self.plan, self.stops, self.decode = plan, tuple(stops), decode
        self.texts: List[str] = []
        self.tokens: List[int] = []
        self.final: Optional[GenerationStep] = None
        self.reader = plan.stream() if plan is not None else None
        self.blocks = 0  # content blocks started (streaming)
        self.open: Optional[str] = None  # the type of the block open now (streaming)

    @property
    def done(self) -> bool:
        return self.final is not None

    def add(self, step: GenerationStep) -> None:
        self.texts.append(step.text)
        if step.token is not None:
            self.tokens.append(step.token)
        if step.finish_reason is not None:
            self.final = step

    def stop_sequence(self) -> Optional[str]:
        """The stop sequence that ended the text, None when another reason did: the one found first in the text
        of every token delivered and the last one (whose text holds the stop sequence, cut from `texts`)."""
        if not self.stops or self.final is None or self.final.token is None:
            return None
        text = self.decode(self.tokens)
        hits = [(at, -len(s), s) for s, at in ((s, text.find(s)) for s in self.stops) if at >= 0]
        return min(hits)[2] if hits else None

    def stop_reason(self) -> Tuple[str, Optional[str]]:
        """(stop_reason, stop_sequence): end_turn (EOS), stop_sequence, max_tokens (max_tokens or the context
        window), tool_use."""
        reason = self.final.finish_reason if self.final is not None else "stop"
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            return "max_tokens", None
        sequence = self.stop_sequence() if reason == "stop" else None
        return ("stop_sequence", sequence) if sequence is not None else ("end_turn", None)

    def usage(self) -> dict:
        stats = self.final.stats if self.final is not None and self.final.stats is not None else None
        return {"input_tokens": stats.prompt_tokens if stats else 0,
                "output_tokens": stats.generated_tokens if stats else 0}

    def content(self) -> List[dict]:
        """The whole message's content blocks: its text, then a tool_use block per call."""
        text = "".join(self.texts)
        if self.plan is None:
            return [{"type": "text", "text": text}] if text else []
        text, calls = self.plan.parse(text)
        if self.final is not None and self.final.tool_calls:
            calls = list(self.final.tool_calls)
        blocks = [{"type": "text", "text": text}] if text else []
        return blocks + [b for b in map(_tool_use, calls) if b is not None]

    def whole(self, mid: str, model: str) -> dict:
        reason, sequence = self.stop_reason()
        return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": self.content(),
                "stop_reason": reason, "stop_sequence": sequence, "usage": self.usage()}

    # ---- streaming

    def events(self, step: GenerationStep) -> List[Tuple[str, dict]]:
        """The (event, data) of the content block events a step sends: a block's start when text follows a
        call or a call starts, its text_delta / input_json_delta pieces, and its stop (all open blocks stop at
        the final step)."""
        self.add(step)
        last = step.finish_reason is not None
        if self.reader is None:
            pieces = [ToolEvent("content", step.text)] if step.text else []
        else:
            pieces = (self.reader.feed(step.text) if step.text else []) + (self.reader.finish() if last else [])
        out: List[Tuple[str, dict]] = []
        for e in pieces:
            if e.kind == "content" and e.text:
                if self.open != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": e.text}))
            elif e.kind == "call":
                out += self._start({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            elif e.kind == "arguments" and e.text and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.text}))
        if last:
            out += self._stop()
        return out

    def _start(self, block: dict) -> List[Tuple[str, dict]]:
        out = self._stop()
        self.open = block["type"]
        self.blocks += 1
        return out + [("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                               "content_block": block})]

    def _delta(self, delta: dict) -> Tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

    def _stop(self) -> List[Tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]


def sse(event: str, data: dict) -> str:
    """One server-sent event with its name (Anthropic's streams name every event)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


# ---- the routes


class MessagesAPI:
    """The routes' handlers over a Server (app.Server: check_auth, read_json, lease, build, submit, done)."""

    def __init__(self, server):
        self.server = server

    async def create(self, request: Request) -> Response:
        """POST /v1/messages."""
        try:
            return await self._create(request)
        except APIError as e:
            return error_response(e)

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens: {"input_tokens": N}, the prompt's tokens as the model would be
        given them (the chat template, the tools and their instructions included)."""
        try:
            server = self.server
            server.check_auth(request)
            parsed = parse_messages(await server.read_json(request), server.config.max_tokens_limit, count=True)
            async with server.lease(parsed.model) as served:
                built = server.build(served, parsed)
            return JSONResponse({"input_tokens": len(built.prompt_ids)})
        except APIError as e:
            return error_response(e)

    async def _create(self, request: Request) -> Response:
        server = self.server
        server.check_auth(request)
        parsed = parse_messages(await server.read_json(request), server.config.max_tokens_limit)
        lease = server.lease(parsed.model)
        served = await lease.__aenter__()
        try:
            built = server.build(served, parsed)
            handles, steps = server.submit(served, [built], "messages")
        except BaseException:
            await lease.__aexit__(None, None, None)
            raise
        message = Message(built.tools, parsed.params.stop, served.engine.decode)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            head = {"id": mid, "type": "message", "role": "assistant", "model": served.id, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": len(built.prompt_ids), "output_tokens": 0}}
            return StreamingResponse(self.events(lease, handles, steps, message, head),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            if not await self._collect(request, steps, message):
                return Response(status_code=499)
        finally:
            server.done(handles)
            await lease.__aexit__(None, None, None)
        return JSONResponse(message.whole(mid, served.id))

    async def _collect(self, request: Request, steps: asyncio.Queue, message: Message) -> bool:
        """Feed `message` its steps until the final one; False when the client went away. Raises APIError for a
        failed request or a server shutting down."""
        waiter = StepWaiter(steps, request)
        try:
            while not message.done:
                message.add((await waiter.next())[1])
        except ClientGone:
            return False
        return True

    async def events(self, lease, handles, steps: asyncio.Queue, message: Message, head: dict) -> AsyncIterator[str]:
        """Anthropic's event sequence: message_start, ping, the content block events as the steps come,
        message_delta (stop_reason, stop_sequence, usage), message_stop; an error event when the request fails."""
        try:
            yield sse("message_start", {"type": "message_start", "message": head})
            yield sse("ping", {"type": "ping"})
            while not message.done:
                _, step = await steps.get()
                err = step_error(step)
                if err is not None:
                    yield sse("error", error_body(err))
                    return
                for name, data in message.events(step):
                    yield sse(name, data)
            reason, sequence = message.stop_reason()
            yield sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                        "usage": {"output_tokens": message.usage()["output_tokens"]}})
            yield sse("message_stop", {"type": "message_stop"})
        finally:  # also when the client went away (the response is cancelled): the request stops
            self.server.done(handles)
            await lease.__aexit__(None, None, None)


def routes(server) -> List[Route]:
    """POST /v1/messages and /v1/messages/count_tokens over `server` (app.Server)."""
    api = MessagesAPI(server)
    return [Route("/v1/messages", api.create, methods=["POST"]),
            Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"])]
