"""The server's Prometheus metrics (`GET /metrics`, the text format of `prometheus-client`), one registry per app.

What is counted where:
- requests by API, model and status: `CountRequests`, an ASGI middleware around the routes, from the status
  the client got (a 400 before any decoding, a 404 unknown model, a 429, a 499 for a client gone before its
  answer ended, a 500 for a stream whose generation failed after its 200);
- tokens, prefix-cache hits, time to first token, inter-token latency and speculative tau: `Track`, one per
  submitted request, fed on the runner's thread by the request's on_step callback (Server.submit);
- queue depth, running requests and KV blocks: `ModelsCollector`, read at scrape time from each loaded
  model's scheduler and block pool (plain reads of counters and list lengths, safe beside the runner's
  thread: a scrape may see a step half done, never a broken value);
- model loads and unloads: `Metrics.model_loaded` / `model_unloaded`, called by the pool of models.

    metrics = Metrics()
    metrics.watch(pool)                     # the loaded models' gauges
    app middleware: Middleware(CountRequests, metrics=metrics)
    track = metrics.track("chat", "smollm2"); track.step(step)   # on the runner's thread
"""

import asyncio
import contextvars
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import mlx.core as mx
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector,
                               generate_latest)
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import ClientDisconnect

from ..generation.results import GenerationStats, GenerationStep
from .defaults import ITL_BUCKETS_S, LOAD_BUCKETS_S, TAU_BUCKETS, TTFT_BUCKETS_S

#: Prefix of every metric's name.
PREFIX = "mlx_infer_"
#: The generating routes and the `api` label of their requests.
API_OF_PATH = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
               "/v1/messages": "messages"}
#: The status label of a request whose client went away before its answer ended (nginx's convention).
CLIENT_CLOSED = 499

__all__ = ["CONTENT_TYPE_LATEST", "CountRequests", "Metrics", "ModelsCollector", "Track"]


@dataclass
class RequestLabels:
    """The labels of one HTTP request, filled as it goes: its API (from the route), the model that served it
    (Server.build / submit; "" when none did, e.g. a 400 before the model was leased), whether its
    generation failed (a stream's 200 then counts as a 500)."""

    api: str
    model: str = ""
    failed: bool = False


_current: contextvars.ContextVar[Optional[RequestLabels]] = contextvars.ContextVar("mlx_infer_request_labels",
                                                                                   default=None)


def current_labels() -> Optional[RequestLabels]:
    """The labels of the HTTP request the calling task serves (None outside a counted route)."""
    return _current.get()


def served_models(pool) -> List:
    """The models a pool has loaded now (models.Served): `pool.loaded()` where the pool has several (ModelPool),
    OneModel's one model (`pool.served`) otherwise; none for a pool with neither."""
    loaded = getattr(pool, "loaded", None)
    if loaded is not None:
        return list(loaded())
    served = getattr(pool, "served", None)
    return [served] if served is not None else []


class Metrics:
    """The metrics of one app, in their own CollectorRegistry (`registry`; never the process's global one, so
    that several apps in one process count apart).

    Metric names (prefix mlx_infer_): requests_total{api,model,status}; prompt_tokens_total,
    cached_prompt_tokens_total, generated_tokens_total, prefix_cache_hits_total{model};
    time_to_first_token_seconds{api,model}, inter_token_latency_seconds{model}, speculative_tau{model}
    (histograms); requests_in_flight; requests_waiting, requests_running, kv_blocks_used, kv_blocks_free,
    kv_blocks_cached, kv_blocks_allocated{model} (at scrape time); models_loaded; model_loads_total,
    model_unloads_total{model}, model_load_seconds{model}; memory_active_bytes, memory_cache_bytes (MLX's
    allocator at scrape time); and prometheus-client's process_* metrics (resident memory, CPU seconds; Linux).
    """

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "HTTP requests to the generating APIs, by the status answered",
                                ["api", "model", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", ["model"],
                                     registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_prompt_tokens",
                                     "Prompt tokens whose KV came from the prefix cache", ["model"], registry=r)
        self.generated_tokens = Counter(PREFIX + "generated_tokens", "Tokens generated", ["model"], registry=r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Requests that started from cached prompt blocks",
                                   ["model"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Seconds from a request's submission to its first token (queueing and prefill)",
                              ["api", "model"], buckets=TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Seconds between two tokens of a request",
                             ["model"], buckets=ITL_BUCKETS_S, registry=r)
        self.tau = Histogram(PREFIX + "speculative_tau", "Tokens committed per target forward of speculative requests",
                             ["model"], buckets=TAU_BUCKETS, registry=r)
        self.loads = Counter(PREFIX + "model_loads", "Models loaded", ["model"], registry=r)
        self.unloads = Counter(PREFIX + "model_unloads", "Models unloaded", ["model"], registry=r)
        self.load_seconds = Histogram(PREFIX + "model_load_seconds", "Seconds a model took to load", ["model"],
                                      buckets=LOAD_BUCKETS_S, registry=r)
        self.in_flight = Gauge(PREFIX + "requests_in_flight", "Requests submitted and not yet done, all models",
                               registry=r)
        self.models_loaded = Gauge(PREFIX + "models_loaded", "Models in memory", registry=r)
        Gauge(PREFIX + "memory_active_bytes", "Bytes of MLX arrays alive: weights, KV blocks, activations",
              registry=r).set_function(mx.get_active_memory)
        Gauge(PREFIX + "memory_cache_bytes", "Bytes of freed buffers MLX keeps for reuse",
              registry=r).set_function(mx.get_cache_memory)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_cpu_seconds_total, ... (Linux)

    def watch(self, pool, in_flight: Optional[Callable[[], int]] = None) -> None:
        """Report the models `pool` has loaded at each scrape (queue, running requests, KV blocks), and
        `in_flight()` as requests_in_flight."""
        self.registry.register(ModelsCollector(pool))
        self.models_loaded.set_function(lambda: len(served_models(pool)))
        if in_flight is not None:
            self.in_flight.set_function(in_flight)

    def serving(self, model: str) -> None:
        """The HTTP request the calling task serves is served by `model` (its requests_total label)."""
        labels = current_labels()
        if labels is not None:
            labels.model = model

    def track(self, api: str, model: str) -> "Track":
        """The tracker of one request submitted now (its on_step callback calls Track.step)."""
        return Track(self, api, model, current_labels())

    def finished(self, model: str, stats: Optional[GenerationStats]) -> None:
        """Count a finished request's tokens, its prefix-cache hit and its speculative tau."""
        if stats is None:
            return
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.cached_tokens.labels(model).inc(stats.cached_prompt_tokens)
        self.generated_tokens.labels(model).inc(stats.generated_tokens)
        if stats.cached_prompt_tokens > 0:
            self.prefix_hits.labels(model).inc()
        if stats.spec_mode not in (None, "off") and stats.rounds > 0:
            self.tau.labels(model).observe(stats.tau)

    def model_loaded(self, name: str, seconds: float) -> None:
        """A model was loaded in `seconds` (the pool calls this)."""
        self.loads.labels(name).inc()
        self.load_seconds.labels(name).observe(seconds)

    def model_unloaded(self, name: str) -> None:
        """A model was unloaded (the pool calls this)."""
        self.unloads.labels(name).inc()

    def count(self, labels: RequestLabels, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(labels.api, labels.model, str(status)).inc()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (media type CONTENT_TYPE_LATEST)."""
        return generate_latest(self.registry)


class Track:
    """The timings of one submitted request, fed its steps on the runner's thread: the first token's delay
    since submission (TTFT), each next token's since the one before (inter-token latency); the final step's
    stats counted (Metrics.finished); an exception marks its HTTP request failed."""

    def __init__(self, metrics: Metrics, api: str, model: str, labels: Optional[RequestLabels]):
        self.metrics, self.model, self.labels = metrics, model, labels
        self._ttft = metrics.ttft.labels(api, model)
        self._itl = metrics.itl.labels(model)
        self.start = time.perf_counter()
        self.last: Optional[float] = None  # when the last token came

    def step(self, step) -> None:
        """One of the request's steps (a GenerationStep or the exception that failed it)."""
        now = time.perf_counter()
        if isinstance(step, BaseException):
            if self.labels is not None:
                self.labels.failed = True
            return
        if not isinstance(step, GenerationStep):
            return
        if step.token is not None:
            if self.last is None:
                self._ttft.observe(now - self.start)
            else:
                self._itl.observe(now - self.last)
            self.last = now
        if step.finish_reason is not None:
            self.metrics.finished(self.model, step.stats)


class ModelsCollector:
    """Gauges of each loaded model read at scrape time: requests waiting for a batch slot and running, KV
    blocks used, free under the budget (absent without a budget), held by the prefix cache, allocated."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = ("requests_waiting", "requests_running", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached",
                 "kv_blocks_allocated")
        helps = ("Requests queued for a batch slot", "Requests decoding", "KV blocks held by requests or the cache",
                 "KV blocks still allocatable under the KV budget", "KV blocks held by the prefix cache",
                 "KV blocks the pool's arrays hold")
        families = {n: GaugeMetricFamily(PREFIX + n, h, labels=["model"]) for n, h in zip(names, helps)}
        for served in served_models(self.pool):
            sched = served.runner.scheduler
            if sched is None:  # a model split over mlx.launch ranks (distributed/front.py): no batch, no KV pool
                continue
            pool, model = sched.kv.pool, [served.id]
            families["requests_waiting"].add_metric(model, len(sched.waiting))
            families["requests_running"].add_metric(model, len(sched.running))
            families["kv_blocks_used"].add_metric(model, pool.blocks_in_use)
            free = pool.free_blocks
            if free is not None:
                families["kv_blocks_free"].add_metric(model, free)
            families["kv_blocks_cached"].add_metric(model, len(sched.kv.prefix))
            families["kv_blocks_allocated"].add_metric(model, pool.capacity)
        yield from families.values()


class CountRequests:
    """ASGI middleware counting each request to a generating route (API_OF_PATH) once it ends, with the status
    its client got: the response's status; 499 when the client went away before the answer's end (a stream
    cut short, a disconnect or cancellation escaping the app); a 200 stream whose generation failed counts as
    500, and so does any other exception escaping the app.
    The route's handler fills the model label (RequestLabels through a context variable: Server.build)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        api = API_OF_PATH.get(scope.get("path", "")) if scope["type"] == "http" else None
        if api is None:
            await self.app(scope, receive, send)
            return
        labels = RequestLabels(api)
        token = _current.set(labels)
        status, ended = None, False

        async def send_tracked(message) -> None:
            nonlocal status, ended
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except BaseException as e:
            gone = isinstance(e, (ClientDisconnect, OSError, asyncio.CancelledError))
            self.metrics.count(labels, CLIENT_CLOSED if gone else 500)
            raise
        finally:
            _current.reset(token)
        if status is None or not ended:
            status = CLIENT_CLOSED
        elif status == 200 and labels.failed:
            status = 500
        self.metrics.count(labels, status)
