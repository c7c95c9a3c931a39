"""Bounded waits for a distributed step: a dead peer, or a silent one, ends the job with one line.

    out = guarded(lambda: mx.eval(logits), "decode step 12", rank)

Two ways a peer fails. It dies: its sockets close, and MLX's ring backend fails the step at once with a
RuntimeError ("connection to a peer was lost"), which `guarded` turns into DistributedError. It hangs (stopped,
swapping, a network that drops packets without closing): MLX waits forever in the collective, and an eval
cannot be interrupted from Python, so a watchdog thread ends the process when a step has run past its
deadline (defaults.STEP_TIMEOUT_S, MLX_INFER_DIST_TIMEOUT), after writing the error line. `mlx.launch` then
stops the other ranks (it terminates every rank once one exits with an error; `on_terminate` makes that a
line on rank 0 too).
"""

import os
import signal
import sys
import threading
import time
from typing import Callable, Optional, TypeVar

from ..errors import DistributedError, MlxInferError
from .defaults import STEP_TIMEOUT_ENV, STEP_TIMEOUT_S

__all__ = ["EXIT_CODE", "guarded", "on_terminate", "step_timeout"]

T = TypeVar("T")
#: The exit status of a rank the watchdog ends, or that mlx.launch terminated (the CLI's error status).
EXIT_CODE = 2


def step_timeout() -> float:
    """Seconds one step may take: MLX_INFER_DIST_TIMEOUT, else defaults.STEP_TIMEOUT_S.

    Raises:
        MlxInferError: a value that is not a positive number.
    """
    text = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
    if not text:
        return STEP_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise MlxInferError(f"{STEP_TIMEOUT_ENV} must be a positive number of seconds, got {text!r}")
    return value


class _Watchdog:
    """One daemon thread per process that ends it when the step in flight passes its deadline."""

    def __init__(self):
        self.lock = threading.Lock()
        self.deadline: Optional[float] = None
        self.message = ""
        self.thread: Optional[threading.Thread] = None

    def arm(self, seconds: float, message: str) -> None:
        with self.lock:
            self.deadline, self.message = time.monotonic() + seconds, message
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="mlx-infer-dist-watchdog", daemon=True)
                self.thread.start()

    def disarm(self) -> None:
        with self.lock:
            self.deadline = None

    def _run(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                late = self.deadline is not None and time.monotonic() > self.deadline
                message = self.message
            if late:
                sys.stderr.write(f"error: {message}\n")
                sys.stderr.flush()
                os._exit(EXIT_CODE)


_WATCHDOG = _Watchdog()


def guarded(step: Callable[[], T], what: str, rank: int, timeout: Optional[float] = None) -> T:
    """Run `step` (which evaluates a distributed computation) with a deadline.

    Args:
        step: the work; its RuntimeErrors are taken as the backend's (a lost peer).
        what: what the step does ("decode step 12"), for the message.
        rank: this process's rank, for the message.
        timeout: seconds (None: step_timeout()).

    Returns:
        What `step` returns.

    Raises:
        DistributedError: the backend failed the step (a peer lost). A step past its deadline ends the
            process (exit status EXIT_CODE) after writing the error line: it cannot be interrupted.
    """
    seconds = step_timeout() if timeout is None else timeout
    _WATCHDOG.arm(seconds, f"rank {rank}: {what} did not finish within {seconds:g} s: a rank stopped answering; "
                           f"the job ends (raise {STEP_TIMEOUT_ENV} for steps that are this slow)")
    try:
        return step()
    except RuntimeError as e:
        raise DistributedError(f"rank {rank}: {what} failed: a rank of the group was lost "
                               f"({' '.join(str(e).split())}); the job ends") from e
    finally:
        _WATCHDOG.disarm()


def on_terminate(rank: int) -> None:
    """Make SIGTERM (mlx.launch stopping the ranks after one failed) end this process, with one error line on
    rank 0, instead of a traceback or silence (on a line of its own: MLX's threads may be writing to stderr too),
    even while its main thread is blocked in a collective (where a Python
    signal handler never runs): the signal's number reaches a pipe at once (signal.set_wakeup_fd, written by
    the C-level handler), and a thread reading it writes the line and ends the process. Call from the main
    thread."""
    message = (f"\nerror: rank {rank}: stopped by mlx.launch: another rank of the group failed or was killed "
               "(its error, if it wrote one, is above)\n")

    once = threading.Lock()

    def end() -> None:
        # both the Python handler (a main thread not blocked) and the pipe's reader may get here: one line only
        if not once.acquire(blocking=False):
            once.acquire()  # the other one is ending the process
        if rank == 0:  # (the other ranks leave quietly: rank 0 speaks for the job)
            sys.stderr.write(message)
            sys.stderr.flush()
        os._exit(EXIT_CODE)

    def handler(signum, frame):
        end()

    def reader(fd: int) -> None:
        while True:
            data = os.read(fd, 64)
            if not data or signal.SIGTERM in data:
                end()

    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, handler)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=reader, args=(read_fd,), name="mlx-infer-dist-sigterm", daemon=True).start()
