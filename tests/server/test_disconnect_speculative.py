"""A streaming client that goes away while its request runs alone speculatively (as `mlx-infer serve`'s
default --spec auto) stops the request and frees its KV blocks, with no other request arriving (issue 52,
defect 1: the lone speculative request went on decoding, and its blocks leaked)."""

import threading
import time

import httpx
import pytest

from server_helpers import live_server

#: Seconds the test waits at most for the runner to go idle (generous: the machine may be busy).
WAIT_S = 600.0


@pytest.mark.parametrize("mode", ["lookup", "auto"])
def test_disconnect_of_a_lone_speculative_stream_frees_its_blocks(engine, mode):
    body = {"messages": [{"role": "user", "content": "Count from 1 to 1000, one number per line."}],
            "max_tokens": 300, "stream": True}
    with live_server(engine, speculative=mode) as (url, runner):
        pool, prefix = runner.scheduler.kv.pool, runner.scheduler.kv.prefix
        with httpx.Client(timeout=WAIT_S) as http:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(6):
                    next(lines)
                assert runner.scheduler._solo is not None  # speculating alone
                req = runner.scheduler.running[0]
        deadline = time.monotonic() + WAIT_S
        while runner.scheduler.busy:
            assert time.monotonic() < deadline, "the runner never went idle"
            threading.Event().wait(0.05)
        assert req.cancelled and req.assembler.n < body["max_tokens"]  # stopped, not run to its end
        assert pool.blocks_in_use == len(prefix)  # only the prefix cache's blocks are left
