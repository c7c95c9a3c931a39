"""`mlx-infer serve`: an OpenAI-compatible HTTP server over one engine's continuous batching."""

from .app import ServerConfig, build_app
from .protocol import APIError, parse

__all__ = ["APIError", "ServerConfig", "build_app", "parse"]
