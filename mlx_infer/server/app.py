"""The OpenAI-compatible HTTP API (Starlette): /v1/chat/completions, /v1/completions (server-sent events
when streaming), /v1/models, /v1/models/{id}, /health, over one engine's BatchRunner (continuous batching on
its own thread).

    app = build_app(engine, runner, ServerConfig(api_key="..."))     # one model
    app = build_pool_app(pool, ServerConfig(api_key="..."))           # several (models.py)
    uvicorn.run(app, host="127.0.0.1", port=8080)

A request's `model` picks what serves it (Server.lease: models.OneModel, or a pool of several); an unknown
name is a 404 model_not_found. The other APIs (their own modules) answer through the same pipeline: lease,
build, submit, steps, done.

Each request is checked (protocol.py), built once per choice by the engine (Engine.batch_request: its prompt
encoded, its parameters, constraint and tools checked; all n before any is submitted, so that a bad value is a
400 before any decoding), and submitted to the runner: the n choices decode together, the prefix cache sharing
the prompt's KV blocks. Their steps come back on the runner's thread and are handed to the event loop
(call_soon_threadsafe) into the answer's asyncio queue as (choice index, step); chunks.Choice turns them into
OpenAI's choices (message, tool calls, logprobs) or stream deltas.
A client that disconnects cancels its request at the runner's next step (its KV blocks go back to the pool).
Errors are OpenAI error objects, never a traceback; an internal error is logged once, with its traceback,
on the "mlx_infer.server" logger (InternalErrors). The library's errors become error objects in one
place, protocol.api_error, from their types' status and param. Requests the HTTP parser rejects get the same JSON error
objects when uvicorn runs on http_protocol.JSONErrorProtocol.
"""

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Dict, List, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..batch import BatchRequest, BatchRunner, RequestHandle
from ..errors import MlxInferError
from ..generation.results import GenerationStep
from .anthropic import routes as anthropic_routes
from .chunks import Choice
from .metrics import CONTENT_TYPE_LATEST, CountRequests, Metrics
from .models import OneModel, Served
from .defaults import DEFAULT_MAX_TOKENS, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, MAX_QUEUE, MAX_TOKENS_LIMIT
from .responses import Responses
from .protocol import APIError, ParsedRequest, ShuttingDown, api_error, parse
from .steps import ClientGone, StepWaiter, step_error

log = logging.getLogger("mlx_infer.server")


@dataclass
class ServerConfig:
    """Limits and identity of a server.

    Attributes:
        model_id: the id /v1/models lists and responses carry.
        api_key: Bearer token every /v1 route requires (None: no authentication).
        max_body_bytes, max_prompt_tokens, max_tokens_limit, default_max_tokens: request limits.
        max_queue: requests allowed to wait beyond the running batch (then 429).
        speculative: the speculative mode of every request, used while it runs alone ("off", "auto", ...).
        evict, repack: token eviction of every request ("POLICY:RATIO" or None; Engine.generate_batch).
    """

    model_id: str = "default"
    api_key: Optional[str] = None
    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_queue: int = MAX_QUEUE
    speculative: str = "off"
    evict: Optional[str] = None
    repack: bool = True


def error_response(e: APIError) -> JSONResponse:
    headers = {**({"WWW-Authenticate": "Bearer"} if e.status == 401 else {}), **(e.headers or {})}
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


class InternalErrors:
    """ASGI middleware around the routes: an exception no handler took is logged once (with its traceback) and
    answered as a 500 error object. Starlette's own catch-all (an `Exception` handler) re-raises after
    answering, so that the ASGI server logs it a second time; this one does not. An exception after the
    response has started (a stream) cannot be answered any more: it goes on, unlogged here, to the ASGI
    server, which logs it once and closes the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:
            if started or scope["type"] != "http":
                raise
            log.exception("internal error on %s", scope.get("path", "?"))
            response = error_response(APIError(500, "internal server error (details are in the server's log)",
                                               kind="server_error"))
            await response(scope, receive, send)


class Server:
    """The routes' state: the models (`pool`: OneModel or a pool of several; a request leases the one it names),
    the limits, and the requests in flight (their count gives the 429).

    Args:
        pool: what `lease`s a request's model (models.OneModel's methods: listing, find, lease).
        config: the limits and identity.
        capacity: requests allowed in flight at once (running and waiting), over all models.
        metrics: the app's Prometheus metrics (GET /metrics); None: new ones.
    """

    def __init__(self, pool, config: ServerConfig, capacity: int, metrics: Optional[Metrics] = None):
        self.pool, self.config, self.capacity = pool, config, capacity
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics.watch(pool, in_flight=lambda: len(self.open))
        self.open: dict = {}  # RequestHandle -> (event loop, its answer's step queue), the requests in flight
        self._token_texts: Dict[tuple, str] = {}

    def lease(self, model: Optional[str], keep_alive: Optional[float] = None):
        """The async context manager of the model a request names (None: the default), held while it runs;
        raises APIError 404 model_not_found."""
        return self.pool.lease(model, keep_alive)

    # ---- plumbing

    def check_auth(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        key = self.config.api_key.encode()
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)
        header = request.headers.get("x-api-key")  # Anthropic's clients send the key this way
        if not (bearer or (header is not None and hmac.compare_digest(header.strip().encode(), key))):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           kind="authentication_error", code="invalid_api_key")

    async def read_json(self, request: Request):
        size = request.headers.get("content-length")
        if size is not None and not (size.isascii() and size.isdigit()):
            raise APIError(400, f"the Content-Length header must be a number of bytes, got {size!r}")
        if size is not None and int(size) > self.config.max_body_bytes:
            raise APIError(413, f"the request body is over {self.config.max_body_bytes} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.config.max_body_bytes:
                raise APIError(413, f"the request body is over {self.config.max_body_bytes} bytes")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply") from None

    def build(self, served: Served, parsed: ParsedRequest, index: int = 0) -> BatchRequest:
        """The runner's request of choice `index` (Engine.batch_request: the prompt encoded once, the parameters,
        response_format and tools checked, the server's speculative mode and eviction; with a seed, seed +
        index); raises APIError 400 naming the field at fault, the prompt's when it is over the server's
        max_prompt_tokens."""
        chat = isinstance(parsed.prompt, list) and isinstance(parsed.prompt[0], dict)
        field = "messages" if chat else "prompt"
        self.metrics.serving(served.id)
        try:
            request = served.engine.batch_request(parsed.prompt, parsed.choice_params(index), chat_template=chat,
                                                speculative=self.config.speculative, evict=self.config.evict,
                                                repack=self.config.repack, **parsed.engine_kwargs())
        except MlxInferError as e:
            raise api_error(e, field) from None
        if len(request.prompt_ids) > self.config.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(request.prompt_ids)} tokens; this server takes at most "
                                f"{self.config.max_prompt_tokens}", field)
        return request

    def submit(self, served: Served, requests: List[BatchRequest], api: str = "chat"):
        """(handles, the asyncio queue of their (index, step)) of requests submitted to the model's runner; raises
        APIError 429 when full, 400 when one cannot fit, 503 when the runner is closed (those already submitted
        are cancelled). `api` labels their metrics (chat, completions, responses, messages)."""
        if len(self.open) + len(requests) > self.capacity:
            raise APIError(429, f"the server is busy ({len(self.open)} requests in flight): retry shortly",
                           kind="rate_limit_error")
        loop, steps = asyncio.get_running_loop(), asyncio.Queue()
        handles: List[RequestHandle] = []
        self.metrics.serving(served.id)
        for index, request in enumerate(requests):
            def on_step(s, index=index, track=self.metrics.track(api, served.id)):
                track.step(s)  # its timings and, at the end, its tokens (on the runner's thread)
                loop.call_soon_threadsafe(steps.put_nowait, (index, s))
            try:
                handle = served.runner.submit(request, on_step=on_step)
            except MlxInferError as e:
                self.done(handles)
                raise api_error(e) from None
            self.open[handle] = (loop, steps)
            handles.append(handle)
        return handles, steps

    def done(self, handles: List[RequestHandle]) -> None:
        for handle in handles:
            handle.cancel()  # a no-op for a finished request; else its blocks go back at the runner's next step
            self.open.pop(handle, None)

    def token_text(self, served: Served, token: int) -> str:
        """A token's text in a model (Engine.decode of the one id), remembered."""
        key = (served.id, token)
        text = self._token_texts.get(key)
        if text is None:
            text = self._token_texts[key] = served.engine.decode([token])
        return text

    def choices(self, served: Served, parsed: ParsedRequest, requests: List[BatchRequest], chat: bool) -> List[Choice]:
        def text(token: int) -> str:
            return self.token_text(served, token)
        return [Choice(i, chat, getattr(r, "tools", None), text, parsed.logprobs is not None)
                for i, r in enumerate(requests)]

    def shutdown(self) -> None:
        """The server is stopping (Ctrl-C): end every open request now, so that its connection closes before
        uvicorn's grace period runs out (any thread)."""
        for loop, steps in list(self.open.values()):
            loop.call_soon_threadsafe(steps.put_nowait, (None, ShuttingDown()))

    # ---- routes

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def scrape(self, request: Request) -> Response:
        """GET /metrics: the Prometheus text format (behind the API key when one is set)."""
        self.check_auth(request)
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: every model this server can serve (`loaded`: in memory now)."""
        self.check_auth(request)
        return JSONResponse({"object": "list", "data": self.pool.listing()})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: a served model's object; any other id is a 404 (code model_not_found)."""
        self.check_auth(request)
        return JSONResponse(self.pool.find(request.path_params["model_id"]))

    async def chat(self, request: Request) -> Response:
        return await self.complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self.complete(request, chat=False)

    async def complete(self, request: Request, chat: bool) -> Response:
        self.check_auth(request)
        parsed = parse(await self.read_json(request), chat, self.config.max_tokens_limit, self.config.default_max_tokens)
        lease = self.lease(parsed.model, parsed.keep_alive)
        served = await lease.__aenter__()
        try:
            requests = [self.build(served, parsed, i) for i in range(parsed.n)]
            handles, steps = self.submit(served, requests, "chat" if chat else "completions")
        except BaseException:
            await lease.__aexit__(None, None, None)
            raise
        choices = self.choices(served, parsed, requests, chat)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if parsed.stream:
            return StreamingResponse(self.events(lease, served, handles, steps, choices, parsed, rid, chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            waiter = StepWaiter(steps, request)
            while not all(c.done for c in choices):
                index, step = await waiter.next()
                choices[index].add(step)
        except ClientGone:
            return Response(status_code=499)
        finally:
            self.done(handles)
            await lease.__aexit__(None, None, None)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": served.id,
                             "choices": [c.whole() for c in choices], "usage": usage([c.final for c in choices])})

    async def events(self, lease, served: Served, handles: List[RequestHandle], steps: asyncio.Queue,
                     choices: List[Choice], parsed: ParsedRequest, rid: str, chat: bool) -> AsyncIterator[str]:
        """The SSE stream of an answer: per choice a first chunk (chat: the role), then its deltas as its steps
        come (the n choices interleaved, each chunk one choice with its index), its finish chunk; with
        include_usage a last chunk of no choices and the usage of all; then [DONE]."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: Optional[dict], **extra) -> str:
            body = {"id": rid, "object": kind, "created": created, "model": served.id,
                    "choices": [choice] if choice is not None else [], **extra}
            if parsed.include_usage:
                body.setdefault("usage", None)
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                for c in choices:
                    yield chunk(c.first())
            while not all(c.done for c in choices):
                index, step = await steps.get()
                err = step_error(step)
                if err is not None:
                    yield f"data: {json.dumps(err.body())}\n\n"
                    break
                for choice in choices[index].deltas(step):
                    yield chunk(choice)
            else:
                if parsed.include_usage:
                    yield chunk(None, usage=usage([c.final for c in choices]))
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away (the response is cancelled): the requests stop
            self.done(handles)
            await lease.__aexit__(None, None, None)


def usage(finals: List[GenerationStep]) -> dict:
    """OpenAI's usage of an answer's choices (their final steps): the prompt counted once (its cached tokens
    those of choice 0), the completion tokens of all."""
    first = finals[0].stats
    completion = sum(f.stats.generated_tokens for f in finals)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens}}


def build_app(engine, runner: BatchRunner, config: ServerConfig) -> Starlette:
    """The Starlette app serving `engine` through `runner` under config.model_id (the caller closes the runner)."""
    return build_pool_app(OneModel(Served(config.model_id, engine, runner)),
                          config, runner.scheduler.max_batch + config.max_queue)


def build_pool_app(pool, config: ServerConfig, capacity: int, metrics: Optional[Metrics] = None) -> Starlette:
    """The Starlette app serving the models of `pool` (models.OneModel's methods), at most `capacity` requests
    in flight (the caller closes the pool); `metrics`: those the pool reports its loads to (None: new ones)."""
    server = Server(pool, config, capacity, metrics)

    async def api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.url.path}: see GET /v1/models, POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message))

    async def disconnected(request: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)

    routes = [
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.scrape, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),  # ids may hold a '/' (org/name)
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        *anthropic_routes(server),  # /v1/messages, /v1/messages/count_tokens
        Route("/v1/responses", Responses(server).create, methods=["POST"]),
    ]
    middleware = [Middleware(CountRequests, metrics=server.metrics), Middleware(InternalErrors)]
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={APIError: api_error, HTTPException: http_error, ClientDisconnect: disconnected})
    app.state.server = server
    return app
