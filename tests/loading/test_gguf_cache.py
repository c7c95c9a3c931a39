"""The GGUF conversion cache: one conversion for copies of a file wherever they lie, an edited file
converted again; when the cache cannot be written, and `convert` into a path it cannot write.

As in tests/test_paths.py: "cannot be written" is a path under a regular file (fails for root
too); a populated read-only cache is played by making every new directory fail with EACCES.
"""

import errno
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import mlx_infer
from gguf_factory import tiny_gguf
from mlx_infer import paths
from mlx_infer.errors import MlxInferError
from mlx_infer.loading import gguf as gguf_mod


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_gguf(tmp_path_factory.mktemp("cache-gguf") / "tiny.gguf", "llama")[0]


@pytest.fixture
def blocked(tmp_path, monkeypatch):
    """A regular file: any path under it cannot be created."""
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    monkeypatch.setattr(paths, "_warned", set())
    return path


def test_copies_share_one_conversion_and_an_edit_converts_again(tiny, tmp_path, monkeypatch):
    """The same bytes in two directories with other modification times (as pip installs a package's GGUF
    in each virtual environment, stamped with the install's time) are converted once; a file with other
    bytes is converted again; a file seen before is not read through again."""
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path / "cache"))
    copies = []
    for i, d in enumerate(("venv-a", "venv-b")):
        (tmp_path / d).mkdir()
        copies.append(Path(shutil.copy(tiny, tmp_path / d / tiny.name)))
        st = os.stat(copies[-1])
        os.utime(copies[-1], ns=(st.st_atime_ns, st.st_mtime_ns + i * 10 ** 9))
    first = gguf_mod.cached_conversion(copies[0])
    with monkeypatch.context() as m:
        m.setattr(gguf_mod, "convert_weights", lambda *a, **k: pytest.fail("converted again"))
        assert gguf_mod.cached_conversion(copies[1]) == first
        m.setattr(gguf_mod, "open", lambda *a, **k: pytest.fail("the file was read through again"), raising=False)
        assert gguf_mod.cached_conversion(copies[1]) == first  # its digest remembered
    edited = copies[1].read_bytes()
    copies[1].write_bytes(edited[:-1] + bytes([edited[-1] ^ 1]))  # one bit of the last tensor's data
    again = gguf_mod.cached_conversion(copies[1])
    assert again != first and (again / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir() if p.is_dir()) == sorted([first.name, again.name])


def test_converted_model_in_a_read_only_cache_loads(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path / "cache"))
    first = mlx_infer.load(str(tiny), weights="float32")

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(gguf_mod.tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(gguf_mod, "convert_weights", lambda *a, **k: pytest.fail("converted again"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a warning
        again = mlx_infer.load(str(tiny), weights="float32")
    assert again.source.mlx_dir == first.source.mlx_dir
    assert again.generate("hello", max_tokens=3, chat_template=False).token_ids == \
        first.generate("hello", max_tokens=3, chat_template=False).token_ids


def test_unwritable_cache_converts_into_a_temporary_directory(tiny, blocked, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_INFER_CACHE", str(blocked / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = mlx_infer.load(str(tiny), weights="float32")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert str(blocked / "cache" / "gguf") in messages[0] and "temporary directory" in messages[0]
    mlx_dir = engine.source.mlx_dir
    assert (mlx_dir / "config.json").is_file() and not str(mlx_dir).startswith(str(blocked))
    assert len(engine.generate("hello", max_tokens=3, chat_template=False).token_ids) == 3


def test_the_temporary_conversion_is_removed_at_exit(tiny, blocked, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, MLX_INFER_CACHE=str(blocked / "cache"), TMPDIR=str(scratch))
    code = "import mlx_infer; e = mlx_infer.load(%r, weights='float32'); print(e.source.mlx_dir)" % str(tiny)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith(str(scratch))  # it was converted there
    assert list(scratch.iterdir()) == []  # and nothing is left


def test_convert_checks_the_output_before_converting(tiny, blocked, monkeypatch):
    """`mlx-infer convert` converted for ~19 s before finding its output unwritable."""
    monkeypatch.setattr(gguf_mod, "open_gguf", lambda *a, **k: pytest.fail("read the GGUF before checking"))
    for out in (blocked / "out", blocked / "deeper" / "out"):
        with pytest.raises(MlxInferError, match="cannot write") as info:
            gguf_mod.convert_gguf(tiny, out)
        message = str(info.value)
        assert "\n" not in message and str(out) in message and f"{blocked} is a file" in message


def test_convert_into_a_file_or_a_non_empty_directory(tiny, tmp_path, blocked):
    with pytest.raises(MlxInferError, match="is not a directory"):
        gguf_mod.convert_gguf(tiny, blocked)
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    with pytest.raises(MlxInferError, match="is not empty"):
        gguf_mod.convert_gguf(tiny, full)
    assert [p.name for p in full.iterdir()] == ["mine.txt"]
