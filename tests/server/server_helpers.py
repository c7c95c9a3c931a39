"""A live `mlx-infer serve` app on 127.0.0.1 in the test process (uvicorn on a thread)."""

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from mlx_infer.server import JSONErrorProtocol, ServerConfig, build_app


@contextmanager
def live_server(engine, **config):
    """(base_url, runner) of a server over `engine` on a free loopback port, stopped on exit."""
    max_batch = config.pop("max_batch", 16)
    runner = engine.batch_runner(max_batch)
    app = build_app(engine, runner, ServerConfig(**{"model_id": "smollm2", **config}))
    try:
        with serving(app) as url:
            yield url, runner
    finally:
        runner.close()


@contextmanager
def serving(app, wait_s: float = 30.0):
    """The base URL of `app` served by uvicorn on a free loopback port on a thread; stopped on exit.
    Raises RuntimeError when it has not started within wait_s seconds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=JSONErrorProtocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + wait_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=wait_s)
