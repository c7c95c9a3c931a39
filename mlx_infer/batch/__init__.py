"""Batched decoding: several requests decoding together over one block pool (continuous batching).

    results = engine.generate_batch(["Hi", "What is 2+2?"], max_tokens=32)
    with engine.batch_runner() as runner:           # a decode loop on its own thread (the server's)
        handle = runner.submit(engine.batch_request("Hi", max_tokens=32))  # built and checked here
        print(handle.result().text)
"""

from .request import BatchRequest
from .runner import BatchRunner, RequestHandle
from .scheduler import BatchScheduler

__all__ = ["BatchRequest", "BatchRunner", "BatchScheduler", "RequestHandle"]
