"""BatchRunner: a BatchScheduler on its own thread, fed from any thread (the server's decode loop).

    with engine.batch_runner() as runner:
        handle = runner.submit(prompt_ids, params)       # from any thread
        for step in handle:                              # GenerationStep, the last with finish_reason
            ...
        handle.cancel()                                  # e.g. the client went away: its blocks are freed

All MLX work (prefill, decode, sampling) runs on the runner's thread (MLX streams belong to the thread that
made them); callers only put requests in and read steps out of per-request queues.
"""

import atexit
import queue
import threading
import time
import weakref
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx

from ..backend import return_free_memory
from ..errors import MlxInferError
from ..generation.results import GenerationResult, GenerationStep, collect
from ..generation.sampling import SamplingParams
from .request import BatchRequest
from .scheduler import BatchScheduler

#: Seconds the idle runner thread waits for a request before checking whether it was closed.
IDLE_POLL_S = 0.1

#: Runners not closed yet: closed at interpreter exit (MLX aborts the process when a thread that used it is
#: still running, or ended without clearing its streams, at exit).
_OPEN: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_open_runners() -> None:
    for runner in list(_OPEN):
        runner.close()


class RequestHandle:
    """A submitted request: iterate it for its GenerationSteps; `cancel()` ends it (from any thread).

    Iterating raises MlxInferError when the runner failed the request (an error in a forward, or the runner
    closed before it finished)."""

    def __init__(self) -> None:
        self._steps: "queue.SimpleQueue" = queue.SimpleQueue()
        self.request: Optional[BatchRequest] = None
        self._runner: Optional["BatchRunner"] = None
        self._seen: List[GenerationStep] = []  # the steps iterated so far (result() after iterating)
        self._ended: Optional[BaseException] = None  # the error that ended it, once raised

    def _put(self, item) -> None:
        self._steps.put(item)

    def __iter__(self) -> Iterator[GenerationStep]:
        """The steps not yet iterated; nothing more once the final step came (or the error, raised again)."""
        while not self._seen or self._seen[-1].finish_reason is None:
            if self._ended is not None:
                raise self._ended
            item = self._steps.get()
            if isinstance(item, BaseException):
                self._ended = item
                raise item
            self._seen.append(item)
            yield item

    def get(self, timeout: Optional[float] = None) -> GenerationStep:
        """The next step (blocking; queue.Empty after `timeout` seconds), counted as iterated."""
        item = self._steps.get(timeout=timeout)
        if isinstance(item, BaseException):
            self._ended = item
            raise item
        self._seen.append(item)
        return item

    def cancel(self) -> None:
        """Stop the request at the next step boundary; its KV blocks go back to the pool then."""
        if self.request is not None:
            self.request.cancelled = True
        if self._runner is not None:
            self._runner.wake()

    def result(self) -> GenerationResult:
        """Wait for the whole answer, the steps already iterated included (raises as iterating)."""
        for _ in self:
            pass
        return collect(self._seen)


class BatchRunner:
    """Runs `scheduler` on a daemon thread until `close()`.

    Args:
        scheduler: the BatchScheduler (used by this thread only from now on).
        make_request: (prompt_ids, params, emit, speculative, evict, repack) -> BatchRequest, validating on
            the caller's thread.
        idle_release_s: seconds without a request after which the runner gives its KV memory back
            (PagedKV.release_idle: the prefix cache is forgotten, the pool shrinks; then
            backend.return_free_memory), once per idle spell; None: never.
    """

    def __init__(self, scheduler: BatchScheduler, make_request: Callable[..., BatchRequest],
                 idle_release_s: Optional[float] = None):
        self.scheduler = scheduler
        self._make_request = make_request
        self.idle_release_s = idle_release_s
        self.releases = 0  # idle spells that gave memory back
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlx-infer-batch", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_step: Optional[Callable] = None,
               speculative: str = "off", evict: Optional[str] = None, repack: bool = True) -> RequestHandle:
        """Queue a request (token ids and SamplingParams); returns its handle at once. on_step: called on the
        runner's thread with each GenerationStep (or the exception that failed the request) instead of
        queueing them in the handle (e.g. to hand them to an event loop); the handle still cancels.
        speculative: a mode of Engine.stream_steps, used while the request runs alone (BatchScheduler solo).
        evict, repack: token eviction as Engine.generate_batch ("POLICY:RATIO" or None).

        Raises:
            MlxInferError: the runner is closed, or the request is invalid (as Engine.stream_steps);
                KVBudgetError: it can never fit the KV budget.
        """
        if self._closed.is_set():
            raise MlxInferError("the batch runner is closed")
        handle = RequestHandle()
        handle.request = self._make_request(prompt_ids, params, on_step or handle._put, speculative, evict, repack)
        handle._runner = self
        self.scheduler.check_fits(handle.request)
        self._inbox.put(handle.request)
        return handle

    def wake(self) -> None:
        """Wake the runner's thread now (e.g. after a cancel, so that it acts before its next poll)."""
        self._inbox.put(None)

    def _take(self, req: Optional[BatchRequest]) -> None:
        if req is not None:
            try:
                self.scheduler.add(req)
            except MlxInferError as e:
                req.fail(e)

    def _release_when_idle(self, idle_since: Optional[float]) -> Optional[float]:
        """Give the KV memory back once the runner has been idle idle_release_s seconds; returns the idle
        spell's start, or None once released (until the next request)."""
        if idle_since is None or self.idle_release_s is None or time.monotonic() - idle_since < self.idle_release_s:
            return idle_since
        self.scheduler.kv.release_idle()
        return_free_memory()
        self.releases += 1
        return None

    def _loop(self) -> None:
        sched = self.scheduler
        idle_since: Optional[float] = None  # None: nothing to give back since the last release (or the start)
        while not self._closed.is_set():
            if not sched.busy:
                idle_since = self._release_when_idle(idle_since)
                try:
                    self._take(self._inbox.get(timeout=IDLE_POLL_S))
                except queue.Empty:
                    continue
            while True:
                try:
                    self._take(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if not sched.busy:
                continue
            try:
                sched.step()
            except Exception as e:  # a failed forward: every request in it is told, the runner goes on
                for r in sched.fail_all():
                    r.fail(MlxInferError(f"generation failed: {e}"))
            if not sched.busy:
                mx.clear_cache()  # idle: MLX's cache of freed buffers goes back to the system
                idle_since = time.monotonic()
        for r in sched.fail_all():
            r.fail(MlxInferError("the runner was closed before the request finished"))
        mx.synchronize()
        mx.clear_streams()  # MLX needs a thread's streams destroyed before it ends (else the exit may abort)

    def close(self) -> None:
        """Stop the thread (unfinished requests get an MlxInferError) and wait for it; idempotent (also run at
        interpreter exit for a runner left open)."""
        self._closed.set()
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join()
        _OPEN.discard(self)

    def __enter__(self) -> "BatchRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
