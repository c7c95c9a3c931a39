"""Fixtures of the CLI tests: the installed `mlx-infer` entry point, run as a subprocess, and
small GGUF files (bad ones) written with the `gguf` package."""

import subprocess
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
from cli_helpers import TIMEOUT_S, cli_env, entry_point

@pytest.fixture(scope="session")
def mlx_infer_bin() -> str:
    """Path of the installed `mlx-infer` command."""
    path = entry_point()
    if path is None:
        pytest.skip("the mlx-infer entry point is not installed (pip install -e .)")
    return path


@pytest.fixture
def run_cli(mlx_infer_bin):
    """run_cli(*args, input=None, env=None) -> CompletedProcess (text, stdout and stderr captured)."""

    def run(*args, input: Optional[str] = None, env: Optional[dict] = None, timeout: float = TIMEOUT_S):
        return subprocess.run(
            [mlx_infer_bin, *map(str, args)], input=input, capture_output=True, text=True,
            env=env or cli_env(), timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL,
        )

    return run


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The embedded default model's GGUF (pulled once if it is not installed)."""
    from mlx_infer.loading import default

    return default.default_model_path()


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A small, well-formed GGUF with one F32 tensor and a little llama-style metadata."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def unsupported_arch_gguf(tmp_path) -> Path:
    """A GGUF whose architecture ('mamba') mlx-infer does not map."""
    return write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")


@pytest.fixture
def truncated_gguf(tmp_path) -> Path:
    """A llama GGUF cut in the middle of its tensor data."""
    path = write_tiny_gguf(tmp_path / "full.gguf")
    data = path.read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    return cut


@pytest.fixture
def not_gguf(tmp_path) -> Path:
    """A file named .gguf that is not one (bad magic)."""
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"this is not a gguf file\n" * 10)
    return path
