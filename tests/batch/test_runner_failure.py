"""A BatchRunner whose thread fails outside a forward lets the engine go and takes no more requests (found in
the final read of the house change: the thread died holding the engine's lock, so every later call waited
forever); a batch runner is not made on a thread whose stream of the engine is still open."""

import threading

import pytest

from mlx_infer import BatchRunner, EngineBusyError, GenerationError, RunnerClosedError, SamplingParams

#: Seconds a test waits at most for the runner's thread (generous: the machine may be busy).
WAIT_S = 600.0


class FailingScheduler:
    """A scheduler whose `add` fails with an error that is not the user's (a bug), as a stand-in for any
    failure of the runner's thread outside a forward."""

    busy = False
    kv = None

    def check_fits(self, req) -> None:
        pass

    def add(self, req) -> None:
        raise RuntimeError("a bug in the scheduler")

    def fail_all(self) -> list:
        return []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_runner_thread_that_fails_lets_the_engine_go(default_engine):
    hold = threading.Lock()
    runner = BatchRunner(FailingScheduler(), None, hold=hold)
    handle = runner.submit(default_engine.batch_request("Hi", SamplingParams(max_tokens=4)))
    with pytest.raises(GenerationError, match="could not start: a bug in the scheduler"):
        handle.result()
    runner._thread.join(WAIT_S)
    assert not runner._thread.is_alive() and runner.closed
    assert hold.acquire(timeout=WAIT_S), "the dead runner's thread kept the engine's lock"
    hold.release()
    with pytest.raises(RunnerClosedError):
        runner.submit(default_engine.batch_request("Hi", SamplingParams(max_tokens=4)))


def test_no_batch_runner_while_this_thread_streams(default_engine):
    stream = default_engine.stream("Count to ten.", max_tokens=8)
    next(stream)
    with pytest.raises(EngineBusyError):
        default_engine.batch_runner()
    stream.close()
    with default_engine.batch_runner() as runner:
        result = runner.submit(default_engine.batch_request("Hi", SamplingParams(max_tokens=4))).result()
    assert result.finish_reason in ("stop", "length")
