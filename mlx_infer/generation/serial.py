"""One request at a time per engine: the lock an Engine's requests (and its BatchRunners, while they have
requests) hold, with a clear error where waiting for it would never end."""

import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from ..errors import EngineBusyError


class Serializer:
    """An engine's hold on itself.

    Attributes:
        lock: the threading.Lock held by the request running (a stream: until it ends or is closed), and by
            a BatchRunner's thread while it has requests.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._owner: Optional[int] = None  # the thread that holds lock (threading.get_ident), None when free

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the engine for one request: another thread's request waits until it is released; one on the
        thread that holds it raises EngineBusyError (a stream of that thread is still open: waiting would
        never end). Released on exit, also when a stream's generator is closed or garbage-collected (from
        any thread)."""
        me = threading.get_ident()
        if self._owner == me:  # (only this thread sets or clears _owner while it holds the lock)
            raise EngineBusyError("this thread is still streaming an earlier request of this engine: iterate that "
                                  "stream to its end or close() it first, or use engine.batch_runner() for "
                                  "concurrent requests")
        with self.lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None
