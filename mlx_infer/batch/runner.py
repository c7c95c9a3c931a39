"""BatchRunner: a BatchScheduler on its own thread, fed from any thread (the server's decode loop).

    with engine.batch_runner() as runner:
        handle = runner.submit(engine.batch_request("Hi", max_tokens=32))  # from any thread
        for step in handle:                              # GenerationStep, the last with finish_reason
            ...
        handle.cancel()                                  # e.g. the client went away: its blocks are freed

All MLX work (prefill, decode, sampling) runs on the runner's thread (MLX streams belong to the thread that
made them); callers only put requests in and read steps out of per-request queues. A request comes in built
and checked (Engine.batch_request: its prompt encoded once, its parameters validated): the runner never calls
back into the engine. While it has requests, the runner's thread holds the engine's lock (`hold`), so that the
engine's own calls from other threads wait for it instead of running beside it on the same model and pool.
"""

import atexit
import queue
import threading
import time
import weakref
from threading import Lock
from typing import Iterator, List, Optional

import mlx.core as mx

from ..backend import return_free_memory
from ..errors import GenerationError, MlxInferError, RunnerClosedError
from ..generation.results import GenerationResult, GenerationStep, collect
from .request import BatchRequest, Emit
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

    Iterating raises GenerationError when a forward failed, RunnerClosedError when the runner was closed
    before the request finished (both MlxInferError)."""

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
        idle_release_s: seconds without a request after which the runner gives its KV memory back
            (PagedKV.release_idle: the prefix cache is forgotten, the pool shrinks; then
            backend.return_free_memory), once per idle spell; None: never.
        hold: a lock the runner's thread holds while it has requests or gives memory back (the engine's: its
            calls from other threads then wait for the runner, which waits for them in turn); None: none.
    """

    def __init__(self, scheduler: BatchScheduler, idle_release_s: Optional[float] = None,
                 hold: Optional[Lock] = None):
        self.scheduler = scheduler
        self.idle_release_s = idle_release_s
        self._hold = hold
        self._holding = False  # whether this runner's thread holds `hold` now
        self.releases = 0  # idle spells that gave memory back
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mlx-infer-batch", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    def submit(self, request: BatchRequest, on_step: Optional[Emit] = None) -> RequestHandle:
        """Queue a request built by `Engine.batch_request` (its prompt encoded, its parameters checked, its
        speculative mode and eviction set there); returns its handle at once. on_step: called on the runner's
        thread with each GenerationStep (or the exception that failed the request) instead of queueing them
        in the handle (e.g. to hand them to an event loop); the handle still cancels.

        Raises:
            RunnerClosedError: the runner is closed; KVBudgetError: the request can never fit the KV budget;
            MlxInferError: `request` is not a BatchRequest.
        """
        if not isinstance(request, BatchRequest):
            raise MlxInferError(f"BatchRunner.submit takes a request built by engine.batch_request(prompt, params), "
                                f"got {type(request).__name__}")
        if self._closed.is_set():
            raise RunnerClosedError("the batch runner is closed")
        handle = RequestHandle()
        request.deliver_to(on_step or handle._put)
        handle.request = request
        handle._runner = self
        self.scheduler.check_fits(request)
        self._inbox.put(handle.request)
        return handle

    @property
    def closed(self) -> bool:
        """Whether `close()` was called (a closed runner takes no more requests)."""
        return self._closed.is_set()

    def wake(self) -> None:
        """Wake the runner's thread now (e.g. after a cancel, so that it acts before its next poll)."""
        self._inbox.put(None)

    def _acquire(self) -> bool:
        """Hold `hold` (waiting for the engine's call in progress on another thread); False when the runner
        was closed meanwhile."""
        while not self._holding and self._hold is not None and not self._closed.is_set():
            self._holding = self._hold.acquire(timeout=IDLE_POLL_S)
        return self._holding or self._hold is None

    def _let_go(self) -> None:
        """Release `hold` (the runner has nothing running)."""
        if self._holding and self._hold is not None:
            self._holding = False
            self._hold.release()

    def _take(self, req: Optional[BatchRequest]) -> None:
        if req is None:
            return
        if not self._acquire():
            req.fail(RunnerClosedError("the runner was closed before the request started"))
            return
        try:
            self.scheduler.add(req)
        except MlxInferError as e:
            req.fail(e)
        except Exception as e:  # a bug: the request is told, and the runner stops (_loop)
            req.fail(GenerationError(f"the request could not start: {e}"))
            raise

    def _release_when_idle(self, idle_since: Optional[float]) -> Optional[float]:
        """Give the KV memory back once the runner has been idle idle_release_s seconds; returns the idle
        spell's start, or None once released (until the next request)."""
        if idle_since is None or self.idle_release_s is None or time.monotonic() - idle_since < self.idle_release_s:
            return idle_since
        if self._hold is not None and not self._hold.acquire(blocking=False):
            return idle_since  # the engine runs a request of its own on this pool: later
        try:
            self.scheduler.kv.release_idle()
        finally:
            if self._hold is not None:
                self._hold.release()
        return_free_memory()
        self.releases += 1
        return None

    def _loop(self) -> None:
        """The thread: serve until closed. However it ends (an error outside a forward included), the runner
        is closed, lets the engine go and fails the requests still queued, so no caller waits forever."""
        try:
            self._serve()
        finally:
            self._closed.set()
            self._let_go()
            while True:
                try:
                    req = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if req is not None:
                    req.fail(RunnerClosedError("the runner stopped before the request started"))

    def _serve(self) -> None:
        sched = self.scheduler
        idle_since: Optional[float] = None  # None: nothing to give back since the last release (or the start)
        while not self._closed.is_set():
            if not sched.busy:
                self._let_go()  # nothing running: the engine's own calls may go
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
                    r.fail(GenerationError(f"generation failed: {e}"))
            if not sched.busy:
                mx.clear_cache()  # idle: MLX's cache of freed buffers goes back to the system
                idle_since = time.monotonic()
        for r in sched.fail_all():
            r.fail(RunnerClosedError("the runner was closed before the request finished"))
        self._let_go()
        mx.synchronize()
        mx.clear_streams()  # MLX needs a thread's streams destroyed before it ends (else the exit may abort)

    def close(self) -> None:
        """Stop the thread (unfinished requests get a RunnerClosedError) and wait for it; idempotent (also run
        at interpreter exit for a runner left open)."""
        self._closed.set()
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join()
        _OPEN.discard(self)

    def __enter__(self) -> "BatchRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
