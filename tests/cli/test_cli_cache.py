"""A cache that cannot be written costs warnings, never a failure; `convert` checks its output first.

"Cannot be written" is a path under a regular file: it fails for root too (root ignores permission bits).
"""

from pathlib import Path

import pytest
from cli_helpers import assert_user_error, cli_env

from gguf_factory import tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("cli-cache") / "tiny.gguf", "llama")[0]


@pytest.fixture
def blocked(tmp_path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def test_generate_with_an_unwritable_cache(run_cli, tiny, blocked):
    """The default --spec auto measures the verify cost (a cache write) after converting (another)."""
    env = cli_env(MLX_INFER_CACHE=str(blocked / "cache"))
    proc = run_cli("generate", "hello there", "-m", tiny, "-n", "3", "--no-chat-template", env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "Traceback" not in proc.stderr and "error:" not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: ")]
    assert warnings and all("cannot write the cache folder" in w for w in warnings), proc.stderr
    assert any("/gguf " in w and "temporary directory" in w for w in warnings), proc.stderr
    assert len(warnings) == len(set(warnings))  # each folder once
    # the conversion's log line does not claim a cached result
    assert "(the cache cannot be written: not cached)" in proc.stderr and "result is cached" not in proc.stderr


def test_convert_into_an_unwritable_path_fails_first(run_cli, tiny, blocked):
    line = assert_user_error(run_cli("convert", tiny, blocked / "out"), "cannot write")
    assert str(blocked / "out") in line
