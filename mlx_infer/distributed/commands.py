"""Rank 0 drives the other ranks between requests: a command loop that stays alive while the job is idle.

    # rank 0: the loop on a thread of its own, fed by the front end (chat's stdin, serve's HTTP handlers)
    inbox = queue.Queue()
    lead_in_thread(group, inbox)
    answer = submit(inbox, max_tokens, work).result()   # work() runs on the lead thread, between REQUEST
    finish(inbox)                                         #   and the next command; finish: SHUTDOWN
    # every other rank, on its main thread:
    follow(group, lambda max_tokens: ...)                 # one request's lockstep part per REQUEST

A command is one broadcast of [kind, argument] (two int32, group.broadcast_ints): REQUEST (argument: the
request's max_tokens; its own broadcasts, the prompt's ids and each token, follow in generate.lockstep_tokens),
SPEC_REQUEST (a speculative request, speculative.spec_lockstep_tokens; argument: its max_draft, which sizes
each round's broadcast), IDLE (a heartbeat) or SHUTDOWN. Every broadcast is `guarded` (watchdog.py), so a rank
waiting for the next command waits at most one step timeout: while rank 0 waits for a human or a client, it
sends IDLE every heartbeat_interval() seconds, so that an idle job lives as long as it likes, while a rank that
died or hangs is still found within a heartbeat plus a step timeout (a heartbeat is a collective every rank must
answer).

All of rank 0's MLX work after loading runs on the lead thread, one request at a time in the order submitted
(FIFO: no batching across requests when the model is sharded).
"""

import os
import queue
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

from ..errors import DistributedError
from .defaults import HEARTBEAT_S
from .group import Group, broadcast_ints
from .watchdog import EXIT_CODE, step_timeout

__all__ = ["IDLE", "REQUEST", "SHUTDOWN", "SPEC_REQUEST", "Job", "finish", "follow", "heartbeat_interval", "lead",
           "lead_in_thread", "receive", "send", "submit"]

#: The command kinds (the first int of a command's broadcast; 0 is what the other ranks contribute).
REQUEST, IDLE, SHUTDOWN, SPEC_REQUEST = 1, 2, 3, 4
_NAMES = {REQUEST: "REQUEST", IDLE: "IDLE", SHUTDOWN: "SHUTDOWN", SPEC_REQUEST: "SPEC_REQUEST"}


@dataclass
class Job:
    """A request for the lead thread: `work()` runs there after REQUEST with `max_tokens` was broadcast (it must
    run the request's lockstep part to its end: generate.lockstep_steps); its value or error goes to `future`.
    spec_draft: a speculative request's max_draft (SPEC_REQUEST is broadcast instead), None for a plain one."""

    max_tokens: int
    work: Callable[[], Any]
    future: Future = field(default_factory=Future)
    spec_draft: Optional[int] = None


def heartbeat_interval() -> float:
    """Seconds between rank 0's heartbeats: defaults.HEARTBEAT_S, at most a quarter of the step timeout
    (MLX_INFER_DIST_TIMEOUT), so that a waiting rank always sees one in time.

    Raises:
        MlxInferError: a bad MLX_INFER_DIST_TIMEOUT (watchdog.step_timeout).
    """
    return min(HEARTBEAT_S, step_timeout() / 4)


def send(group: Group, kind: int, argument: int = 0) -> None:
    """Rank 0: broadcast one command (REQUEST with max_tokens, SPEC_REQUEST with max_draft, IDLE, SHUTDOWN).
    Raises DistributedError (a peer lost; a silent one ends the process after the step timeout)."""
    broadcast_ints(group, [kind, argument], 2, f"the command {_NAMES[kind]}")


def receive(group: Group) -> Tuple[int, int]:
    """The other ranks: wait for rank 0's next command; (kind, argument).

    Raises:
        DistributedError: a peer lost, or a kind that is not a command (the ranks are out of step). Rank 0
            silent past the step timeout ends the process (watchdog.guarded).
    """
    kind, argument = broadcast_ints(group, None, 2, "rank 0's next command (a heartbeat or a request)")
    if kind not in _NAMES:
        raise DistributedError(f"rank {group.rank}: got {kind} where rank 0's next command was due: the ranks are "
                               "out of step; the job ends")
    return kind, argument


def submit(inbox: "queue.Queue", max_tokens: int, work: Callable[[], Any], spec_draft: Optional[int] = None) -> Future:
    """Queue a request for the lead thread (any thread); its Future has work()'s value. A Future cancelled
    before the lead thread takes it is skipped (no broadcast). spec_draft: a speculative request's max_draft."""
    job = Job(max_tokens, work, spec_draft=spec_draft)
    inbox.put(job)
    return job.future


def finish(inbox: "queue.Queue") -> None:
    """End the loop: the lead thread broadcasts SHUTDOWN after the requests queued before it, and returns."""
    inbox.put(None)


def lead(group: Group, inbox: "queue.Queue", interval: Optional[float] = None) -> None:
    """Rank 0's loop: take Jobs from `inbox` in order, broadcast REQUEST and run each; a heartbeat (IDLE) after
    every `interval` seconds (None: heartbeat_interval()) without one; SHUTDOWN at None, then return.

    Raises:
        DistributedError: a peer lost. Any exception of a Job's work also ends the loop (after it is set on
            the Job's future): the other ranks may be in the middle of that request, so the job cannot go on.
    """
    interval = heartbeat_interval() if interval is None else interval
    while True:
        try:
            job = inbox.get(timeout=interval)
        except queue.Empty:
            send(group, IDLE)
            continue
        if job is None:
            send(group, SHUTDOWN)
            return
        if not job.future.set_running_or_notify_cancel():
            continue
        if job.spec_draft is None:
            send(group, REQUEST, job.max_tokens)
        else:
            send(group, SPEC_REQUEST, job.spec_draft)
        try:
            value = job.work()
        except BaseException as e:
            job.future.set_exception(e)
            raise
        job.future.set_result(value)


def lead_in_thread(group: Group, inbox: "queue.Queue", interval: Optional[float] = None) -> threading.Thread:
    """Start `lead` on a daemon thread. An error that ends it (a rank lost) ends the process with one line on
    stderr and status watchdog.EXIT_CODE: the front end's thread may be blocked reading stdin or serving
    HTTP, and the other ranks cannot go on without rank 0."""

    def run() -> None:
        try:
            lead(group, inbox, interval)
        except BaseException as e:
            sys.stderr.write(f"\nerror: {e}\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE)

    thread = threading.Thread(target=run, name="mlx-infer-dist-lead", daemon=True)
    thread.start()
    return thread


def follow(group: Group, on_request: Callable[[int], None],
           on_spec_request: Optional[Callable[[int], None]] = None) -> int:
    """The other ranks' loop: wait for each command; REQUEST: on_request(max_tokens) (the request's lockstep
    part: generate.follow_request); SPEC_REQUEST: on_spec_request(max_draft) (speculative.follow_spec_request);
    IDLE: wait again; SHUTDOWN: return the number of requests run.

    Raises:
        DistributedError: as `receive`, from on_request / on_spec_request, or a SPEC_REQUEST without
            on_spec_request.
    """
    served = 0
    while True:
        kind, argument = receive(group)
        if kind == SHUTDOWN:
            return served
        if kind == REQUEST:
            on_request(argument)
            served += 1
        elif kind == SPEC_REQUEST:
            if on_spec_request is None:
                raise DistributedError(f"rank {group.rank}: rank 0 sent a speculative request this rank cannot "
                                       "follow; the job ends")
            on_spec_request(argument)
            served += 1
