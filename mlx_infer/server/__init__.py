"""`mlx-infer serve`: an OpenAI-compatible HTTP server over one engine's continuous batching."""

from .app import ServerConfig, build_app
from .http_protocol import JSONErrorProtocol
from .protocol import APIError, parse

__all__ = ["APIError", "JSONErrorProtocol", "ServerConfig", "build_app", "parse"]
