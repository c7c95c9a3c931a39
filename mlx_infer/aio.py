"""The asyncio face of an Engine: `await engine.agenerate(...)` and `async for chunk in engine.astream(...)`.

    result = await engine.agenerate("Hi", max_tokens=32)
    async for chunk in engine.astream([{"role": "user", "content": "Hi"}]):
        print(chunk, end="")

The requests of every coroutine (of any event loop) go to one BatchRunner per engine, started on the first
async request, so that they decode together (continuous batching). The runner's thread hands each step to
the event loop of the request's consumer (loop.call_soon_threadsafe) into the request's asyncio.Queue; no
MLX work runs on an event loop. Leaving a stream early (break, aclose, a cancelled task, the iterator
dropped) cancels its request at once: the runner frees its KV blocks at its next step.
"""

import asyncio
import threading
from typing import Callable, List, Optional, Union

from .batch import BatchRequest, BatchRunner, RequestHandle
from .generation.results import GenerationResult, GenerationStep, collect


class AsyncSteps:
    """The GenerationSteps of one request as an async iterator (the last carries finish_reason and stats).

    The request is submitted on the first iteration (from the event loop that iterates it); `aclose()`, a
    cancelled `await`, or dropping the iterator before its end cancels it. Iterating raises the error that
    failed the request (GenerationError, RunnerClosedError).
    """

    def __init__(self, runner: "AsyncRunner", request: BatchRequest):
        self._runner, self._request = runner, request
        self._queue: Optional[asyncio.Queue] = None
        self._handle: Optional[RequestHandle] = None
        self._done = False

    def _submit(self) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        put = queue.put_nowait  # the runner's emit holds the queue, never this iterator (dropping it cancels)

        def emit(item: Union[GenerationStep, BaseException]) -> None:  # on the runner's thread
            loop.call_soon_threadsafe(put, item)

        self._handle = self._runner.runner.submit(self._request, on_step=emit)
        self._queue = queue
        return queue

    def __aiter__(self) -> "AsyncSteps":
        return self

    async def __anext__(self) -> GenerationStep:
        if self._done:
            raise StopAsyncIteration
        queue = self._queue if self._queue is not None else self._submit()
        try:
            item = await queue.get()
        except BaseException:  # the task was cancelled (CancelledError): so is the request
            self.cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finish_reason is not None
        return item

    def cancel(self) -> None:
        """Stop the request now (any thread): the runner frees its KV blocks at its next step; a finished or
        never submitted request is left as it is."""
        if not self._done:
            self._done = True
            if self._handle is not None:
                self._handle.cancel()

    async def aclose(self) -> None:
        """Leave the stream: cancel the request (as `cancel`)."""
        self.cancel()

    def __del__(self) -> None:
        self.cancel()


class AsyncText:
    """The text chunks of an AsyncSteps (empty steps skipped), as `Engine.stream` yields them; leaving it
    early cancels the request as AsyncSteps does."""

    def __init__(self, steps: AsyncSteps):
        self._steps = steps

    def __aiter__(self) -> "AsyncText":
        return self

    async def __anext__(self) -> str:
        while True:
            step = await self._steps.__anext__()
            if step.text:
                return step.text

    async def aclose(self) -> None:
        """Leave the stream: cancel the request."""
        await self._steps.aclose()


class AsyncRunner:
    """An engine's BatchRunner for asyncio, started by `start` on first use (and again if it was closed).

    Args:
        start: makes the runner (the engine's `batch_runner`).
    """

    def __init__(self, start: Callable[[], BatchRunner]):
        self._start = start
        self._runner: Optional[BatchRunner] = None
        self._lock = threading.Lock()  # two event loops on two threads start one runner

    @property
    def runner(self) -> BatchRunner:
        """The running BatchRunner (started now if there is none)."""
        with self._lock:
            if self._runner is None or self._runner.closed:
                self._runner = self._start()
            return self._runner

    def steps(self, request: BatchRequest) -> AsyncSteps:
        """The request's steps (submitted on the first iteration)."""
        return AsyncSteps(self, request)

    def stream(self, request: BatchRequest) -> AsyncText:
        """The request's text chunks (submitted on the first iteration)."""
        return AsyncText(self.steps(request))

    async def generate(self, request: BatchRequest) -> GenerationResult:
        """The request's whole answer; a cancelled task cancels the request."""
        steps = self.steps(request)
        seen: List[GenerationStep] = []
        try:
            async for step in steps:
                seen.append(step)
        finally:
            steps.cancel()  # a no-op once the final step came
        return collect(seen)
