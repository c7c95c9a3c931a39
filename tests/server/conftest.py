"""Fixtures of the server tests: the served engine, a reference engine, a live server."""

import pytest

import mlx_infer
from server_helpers import live_server


@pytest.fixture(scope="module")
def engine(default_gguf):
    """The default model as `mlx-infer serve` loads it (quantized weights on the kernels, a paged KV cache)."""
    return mlx_infer.load(kv_cache="paged")


@pytest.fixture(scope="module")
def reference(default_gguf):
    """Another engine on the same model for the expected answers (the served engine belongs to its runner)."""
    return mlx_infer.load()


@pytest.fixture(scope="module")
def server(engine):
    with live_server(engine) as (url, runner):
        yield url, runner
