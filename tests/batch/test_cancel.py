"""Cancelling batched requests (issue 52, defect 1): a cancelled request stops at the scheduler's next step in
every mode (plain, a lone request's speculative modes, batched rows) and its KV blocks go back to the pool;
through the runner, many cancelled requests leave the pool as a fresh runner's, and the idle release runs."""

import queue
import threading
import time

import pytest

from mlx_infer import SamplingParams

PROMPT = "Count from 1 to 1000, one number per line."
OTHER = "Write a haiku about the sea."

#: Speculative modes of a lone request ("off": plain batched decoding of one row).
MODES = ["off", "lookup", "auto", "dflash"]

#: Seconds a test waits at most for the runner to go idle or release (generous: the machine may be busy).
WAIT_S = 600.0


def wait_for(condition, what: str) -> None:
    """Poll `condition()` until it holds (AssertionError naming `what` after WAIT_S seconds)."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        threading.Event().wait(0.05)


def tokens(steps) -> int:
    return len([s for s in steps if s.token is not None])


@pytest.mark.parametrize("mode", MODES)
def test_a_cancelled_lone_request_stops_at_the_next_step(default_engine, mode):
    """Five steps in, a cancel: the next step emits the final "cancelled" step and nothing after it, the
    scheduler is idle, and every block the request held is back in the pool (no prefix cache: none kept)."""
    sched = default_engine.scheduler(prefix_cache=False)
    pool = sched.kv.pool
    before = pool.blocks_in_use
    out = []
    req = default_engine.batch_request(PROMPT, SamplingParams(max_tokens=300), speculative=mode,
                                       emit=out.append)
    sched.add(req)
    while tokens(out) < 5:
        sched.step()
    assert (sched._solo is not None) == (mode != "off")  # the speculative modes run alone on their iterator
    assert pool.blocks_in_use > before
    req.cancelled = True
    emitted = len(out)
    sched.step()
    assert len(out) == emitted + 1 and out[-1].finish_reason == "cancelled"
    assert not sched.busy and sched._solo is None
    assert pool.blocks_in_use == before


def test_a_cancelled_batched_request_leaves_the_batch_at_the_next_step(default_engine):
    """Two speculative requests decode as batched rows; one cancelled stops at the next step and its blocks
    go back while the other goes on (its answer is the one it gets alone), then the pool is as before."""
    sched = default_engine.scheduler(prefix_cache=False)
    pool = sched.kv.pool
    before = pool.blocks_in_use
    first, second = [], []
    a = default_engine.batch_request(PROMPT, SamplingParams(max_tokens=300), speculative="auto",
                                     emit=first.append)
    b = default_engine.batch_request(OTHER, SamplingParams(max_tokens=24), speculative="auto",
                                     emit=second.append)
    sched.add(a)
    sched.add(b)
    while tokens(first) < 5:
        sched.step()
    assert len(sched.running) == 2 and sched._solo is None
    a.cancelled = True
    emitted = len(first)
    sched.step()
    assert len(first) == emitted + 1 and first[-1].finish_reason == "cancelled" and a not in sched.running
    assert pool.blocks_in_use - before == len(b.sequence.table.blocks)
    while sched.busy:
        sched.step()
    assert len(first) == emitted + 1
    alone = default_engine.generate(OTHER, max_tokens=24)
    assert [s.token for s in second if s.token is not None] == alone.token_ids
    assert pool.blocks_in_use == before


def test_cancelled_requests_through_the_runner_leave_the_pool_as_fresh(default_engine):
    """The issue's reproduction, repeated in every mode: submit, take five steps, cancel. Each request ends
    with "cancelled" and emits nothing after it, the runner goes idle, only the prompts' cached blocks stay
    (no leak), and the idle release then runs and leaves no block in use, as a fresh runner."""
    ids = default_engine.encode(PROMPT)
    default_engine.reset()  # the prefix cache of earlier tests forgotten: the pool as a fresh runner's
    with default_engine.batch_runner(4, idle_release_s=1.0) as runner:
        kv = runner.scheduler.kv
        fresh = kv.pool.blocks_in_use
        for i in range(2 * len(MODES)):
            steps: "queue.SimpleQueue" = queue.SimpleQueue()
            request = default_engine.batch_request(ids, SamplingParams(max_tokens=100),
                                                   speculative=MODES[i % len(MODES)])
            handle = runner.submit(request, on_step=steps.put)
            for _ in range(5):
                assert steps.get().finish_reason is None
            handle.cancel()
            while (step := steps.get()).finish_reason is None:
                pass
            assert step.finish_reason == "cancelled"
            wait_for(lambda: not runner.scheduler.busy, "the runner to go idle")
            assert steps.empty(), f"request {i} ({MODES[i % len(MODES)]}) emitted steps after it was cancelled"
            assert kv.pool.blocks_in_use - fresh == kv.prefix.idle_blocks == len(kv.prefix)  # cached prompt blocks
        released = runner.releases
        wait_for(lambda: runner.releases > released, "the idle release")
        assert kv.pool.blocks_in_use == fresh and len(kv.prefix) == 0
