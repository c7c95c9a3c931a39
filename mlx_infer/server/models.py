"""The models a server answers for: a request's `model` picks one (a lease, held while the request runs).

`OneModel` serves one loaded engine under one id; a pool of several models loaded on demand (keep_alive,
least-recently-used eviction) implements the same two methods (`listing`, `lease`)."""

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, List, Optional

from ..batch import BatchRunner
from .protocol import APIError


@dataclass
class Served:
    """A model ready for requests: its id, its engine (tokenizer and chat template, on the event loop's thread)
    and the runner that decodes its requests (continuous batching on its own thread)."""

    id: str
    engine: Any
    runner: BatchRunner


def model_not_found(name: str, known: List[str]) -> APIError:
    """OpenAI's 404 `model_not_found` for a model name the server does not serve."""
    return APIError(404, f"model {name!r} is not served here; this server serves {', '.join(map(repr, known))} "
                         "(see GET /v1/models)", "model", code="model_not_found")


class OneModel:
    """One engine served under one id. A request naming no model, or this one, gets it; any other name is a 404.

    Args:
        served: the model.
    """

    def __init__(self, served: Served):
        self.served = served

    def listing(self) -> List[dict]:
        """OpenAI's model objects of what can be served."""
        return [{"id": self.served.id, "object": "model", "created": 0, "owned_by": "mlx-infer", "loaded": True}]

    def find(self, name: str) -> dict:
        """The model object of `name`; raises APIError 404 model_not_found."""
        if name != self.served.id:
            raise model_not_found(name, [self.served.id])
        return self.listing()[0]

    @asynccontextmanager
    async def lease(self, name: Optional[str], keep_alive: Optional[float] = None) -> AsyncIterator[Served]:
        """The model a request names (None: the default), held until the request ends.

        Raises:
            APIError: 404 model_not_found for a name not served.
        """
        if name is not None and name != self.served.id:
            raise model_not_found(name, [self.served.id])
        yield self.served

    def close(self) -> None:
        self.served.runner.close()
