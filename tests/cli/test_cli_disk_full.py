"""A disk that fills up while a GGUF is converted (issue 52, defect 5: it was "internal error (RuntimeError):
[write] Unable to write 570734 bytes", exit 1): one line naming the folder, exit 2, nothing of the
conversion left behind. The full disk is a file size limit (RLIMIT_FSIZE) on the command: its writes past
the limit fail with EFBIG as they would with ENOSPC (Python ignores SIGXFSZ), with no mount needed."""

import errno
import resource
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from cli_helpers import TIMEOUT_S, cli_env
from gguf_factory import tiny_gguf

from mlx_infer.errors import DiskWriteError
from mlx_infer.loading import gguf as gguf_mod

#: Bytes a file may grow to: the tiny model's config and tokenizer files fit (< 10 kB), its weights
#: (443 kB) do not.
LIMIT = 100_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_gguf(tmp_path_factory.mktemp("disk-full") / "tiny.gguf", "llama")[0]


def run_limited(mlx_infer_bin: str, *args, env: dict) -> subprocess.CompletedProcess:
    """The command with every file it writes limited to LIMIT bytes."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))

    return subprocess.run([mlx_infer_bin, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, preexec_fn=limit)


def error_line(proc: subprocess.CompletedProcess) -> str:
    """Exit 2 with one `error: ...` line on stderr, last (after the conversion's progress line), no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], proc.stderr
    return lines[-1]


def test_a_full_cache_disk_while_converting(mlx_infer_bin, tiny, tmp_path):
    cache = tmp_path / "cache"
    proc = run_limited(mlx_infer_bin, "generate", "hello", "-m", tiny, "-n", "2", "--no-chat-template",
                       env=cli_env(MLX_INFER_CACHE=str(cache)))
    line = error_line(proc)
    assert line.startswith("error: cannot write the converted model into ")
    assert str(cache / "gguf") in line and "MB free there" in line and "MLX_INFER_CACHE" in line
    assert [p for p in (cache / "gguf").iterdir() if p.is_dir()] == []  # no half-written conversion
    done = subprocess.run(  # and a later run with room converts and runs
        [mlx_infer_bin, "generate", "hello", "-m", str(tiny), "-n", "2", "--no-chat-template"], capture_output=True,
        text=True, env=cli_env(MLX_INFER_CACHE=str(cache)), timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (cache / "gguf").iterdir() if p.is_dir() and p.name.startswith(".")] == []


def test_a_full_disk_under_convert(mlx_infer_bin, tiny, tmp_path):
    out = tmp_path / "out" / "tiny-mlx"
    proc = run_limited(mlx_infer_bin, "convert", tiny, out, env=cli_env())
    line = error_line(proc)
    assert line.startswith("error: cannot write the converted model into ")
    assert str(out.parent) in line and "choose an output directory" in line
    assert list(out.parent.iterdir()) == []


class FailingTokenizer:
    """A tokenizer whose files cannot be written, with the given errno."""

    def __init__(self, code: int):
        self.code = code

    def save_pretrained(self, folder: str):
        raise OSError(self.code, "simulated", folder)


def test_no_room_for_the_tokenizer_files_is_a_disk_write_error(tmp_path):
    weights = {"w": mx.zeros((4, 4))}
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        staging = tmp_path / f"s{code}"
        staging.mkdir()
        with pytest.raises(DiskWriteError, match="cannot write the converted model into") as info:
            gguf_mod.write_model_files(staging, weights, {}, FailingTokenizer(code), gguf_mod.CACHE_FULL_HINT)
        assert str(tmp_path) in str(info.value) and "\n" not in str(info.value)
    staging = tmp_path / "other"
    staging.mkdir()
    with pytest.raises(OSError) as info:  # not a lack of room: as raised
        gguf_mod.write_model_files(staging, weights, {}, FailingTokenizer(errno.EACCES), gguf_mod.CACHE_FULL_HINT)
    assert not isinstance(info.value, DiskWriteError)
