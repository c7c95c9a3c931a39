"""A request's steps as the server's handlers wait for them: the (index, step) items a runner thread puts on the
handler's asyncio.Queue, the client's connection checked while waiting, and an error or a shutdown put in the
place of a step turned into the APIError every API answers with (in its own shape)."""

import asyncio
import time
from typing import Any, Optional, Tuple

from starlette.requests import Request

from ..generation.results import GenerationStep
from .defaults import DISCONNECT_POLL_S
from .protocol import APIError, ShuttingDown, generation_failed


class ClientGone(Exception):
    """The client closed its connection while its request ran (the handler answers 499 or stops)."""


def step_error(item: Any) -> Optional[APIError]:
    """The APIError of what a runner put in the place of a step (503 for a server shutting down, the request's
    failure: protocol.generation_failed), None for a step."""
    if isinstance(item, ShuttingDown):
        return APIError(503, "the server is shutting down; retry on another server", kind="server_error")
    if isinstance(item, BaseException):
        return generation_failed(item)
    return None


class StepWaiter:
    """Takes a request's (index, step) items off its queue for a handler that does not stream, checking every
    DISCONNECT_POLL_S seconds (also while steps keep coming) whether the client is still there.

    Args:
        steps: the queue the runner's threads put (choice index, GenerationStep | error | ShuttingDown) on.
        request: the HTTP request (its connection is what is checked).
    """

    def __init__(self, steps: asyncio.Queue, request: Request):
        self.steps, self.request = steps, request
        self._checked = time.monotonic()

    async def next(self) -> Tuple[int, GenerationStep]:
        """The next (index, step).

        Raises:
            ClientGone: the client closed its connection. APIError: the request failed or the server is
                shutting down (step_error).
        """
        while True:
            try:
                index, item = await asyncio.wait_for(self.steps.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                index, item = None, None
            if time.monotonic() - self._checked >= DISCONNECT_POLL_S:
                self._checked = time.monotonic()
                if await self.request.is_disconnected():
                    raise ClientGone()
            if item is None:
                continue
            error = step_error(item)
            if error is not None:
                raise error
            return index, item
