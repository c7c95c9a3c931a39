"""The user cache: computed once, written atomically under concurrent writers, and a cache that cannot
be written costs a warning, never a failure; model fingerprints that survive moving the cache.

Tests run as root here, and root ignores permission bits, so "cannot be written" is made real by
pointing MLX_INFER_CACHE at a path under a regular file (every mkdir and open for writing there
fails with ENOTDIR, for root too). A populated cache that is read-only is played by making every
write fail (the OS's EACCES) after it was filled.
"""

import errno
import json
import threading
import warnings
from pathlib import Path

import pytest

from mlx_infer import paths
from mlx_infer.errors import MlxInferError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh, writable cache for one test (and no cache folder warned about yet)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("MLX_INFER_CACHE", str(path))
    monkeypatch.setattr(paths, "_warned", set())
    return path


@pytest.fixture
def unwritable_cache(tmp_path, monkeypatch):
    """MLX_INFER_CACHE under a regular file: nothing can be created there, not even by root."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = blocker / "cache"
    monkeypatch.setenv("MLX_INFER_CACHE", str(path))
    monkeypatch.setattr(paths, "_warned", set())
    return path


def read_only(monkeypatch):
    """Every new file in the cache fails as in a read-only folder (EACCES); reads still work."""
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(paths.tempfile, "mkstemp", refuse)


class Counter:
    def __init__(self, value):
        self.calls, self.value = 0, value

    def __call__(self):
        self.calls += 1
        return dict(self.value)


def test_computed_once_then_read(cache):
    compute = Counter({"widths": [1, 2, 4], "ms": [3.5, 3.9, 4.4]})
    said = []
    first = paths.cached_json("cost", "model-a|cpu", compute, say=said.append, message="measuring")
    second = paths.cached_json("cost", "model-a|cpu", compute, say=said.append, message="measuring")
    assert first == second == {"widths": [1, 2, 4], "ms": [3.5, 3.9, 4.4]}
    assert compute.calls == 1
    assert said == [f"measuring (once per model and install; cached in {cache / 'cost'})"]
    files = list((cache / "cost").iterdir())
    assert len(files) == 1 and files[0].suffix == ".json"  # no temporary file left
    assert json.loads(files[0].read_text()) == first


def test_invalid_cached_object_is_computed_again(cache):
    paths.cached_json("cost", "k", Counter({"version": 1}))
    compute = Counter({"version": 2})
    said = []
    data = paths.cached_json("cost", "k", compute, valid=lambda d: d["version"] == 2, say=said.append,
                             message="measuring", stale="the cached one is old")
    assert data == {"version": 2} and compute.calls == 1
    assert said == [f"measuring (again: the cached one is old; cached in {cache / 'cost'})"]
    assert paths.cached_json("cost", "k", Counter({"version": 3}), valid=lambda d: d["version"] == 2) == data


def test_cache_dir_does_not_fail_where_it_cannot_be_created(unwritable_cache):
    assert paths.cache_dir() == unwritable_cache
    assert not unwritable_cache.exists()


def test_unwritable_cache_says_it_once_and_returns_the_result(unwritable_cache):
    """With `say`, its one line tells the folder cannot be written (no warning besides); without, one
    warning per folder."""
    compute = Counter({"skip": [3, 5]})
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert paths.cached_json("layerskip", "m", compute, say=said.append, message="measuring") == {"skip": [3, 5]}
        assert paths.cached_json("layerskip", "m", compute) == {"skip": [3, 5]}
        assert caught == []
        assert paths.cached_json("prior", "m", compute) == {"skip": [3, 5]}
        assert paths.cached_json("prior", "n", compute) == {"skip": [3, 5]}
    assert compute.calls == 4  # not cached, computed each time
    assert said == [f"measuring (not cached: {unwritable_cache / 'layerskip'} cannot be written)"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert "\n" not in messages[0]
    assert str(unwritable_cache / "prior") in messages[0] and "not cached" in messages[0]


def test_read_only_populated_cache_is_used_without_writing(cache, monkeypatch):
    paths.cached_json("prior", "drafter-x", Counter({"alpha": 0.71}))
    read_only(monkeypatch)
    compute = Counter({"alpha": 0.5})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert paths.cached_json("prior", "drafter-x", compute) == {"alpha": 0.71}
        assert caught == [] and compute.calls == 0
        assert paths.cached_json("prior", "drafter-y", compute) == {"alpha": 0.5}  # new: computed, not kept
    assert compute.calls == 1 and len(caught) == 1
    assert len(list((cache / "prior").iterdir())) == 1


def test_concurrent_writers_never_collide(cache):
    """Many writers of the same cache file at once (two processes measuring the same model): every
    write succeeds, the file is always one whole object, and no temporary file is left behind."""
    target = cache / "cost" / "same.json"
    errors, blobs = [], [json.dumps({"writer": i, "pad": "x" * 20000}) for i in range(8)]

    def writer(blob):
        try:
            for _ in range(40):
                paths.write_atomic(target, blob)
                json.loads(target.read_text())  # never half a file
        except Exception as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(b,)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() in blobs
    assert [p.name for p in target.parent.iterdir()] == ["same.json"]


def make_model_dir(path: Path, config: bytes = b'{"model_type": "llama"}', weights: int = 1000) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_bytes(config)
    (path / "model.safetensors").write_bytes(b"\0" * weights)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_fingerprint_does_not_depend_on_the_location(tmp_path):
    a = paths.model_fingerprint(make_model_dir(tmp_path / "here" / "m"))
    b = paths.model_fingerprint(make_model_dir(tmp_path / "moved" / "elsewhere"))
    assert a == b
    assert len(a) == paths.KEY_DIGITS and int(a, 16) >= 0


def test_fingerprint_follows_config_and_weights(tmp_path):
    base = paths.model_fingerprint(make_model_dir(tmp_path / "base"))
    other_config = paths.model_fingerprint(make_model_dir(tmp_path / "c", config=b'{"model_type": "qwen3"}'))
    other_size = paths.model_fingerprint(make_model_dir(tmp_path / "s", weights=1001))
    renamed = make_model_dir(tmp_path / "r")
    (renamed / "model.safetensors").rename(renamed / "model-00001-of-00001.safetensors")
    tokenizer_changed = make_model_dir(tmp_path / "t")
    (tokenizer_changed / "tokenizer.json").write_text('{"changed": true}')
    assert len({base, other_config, other_size, paths.model_fingerprint(renamed)}) == 4
    assert paths.model_fingerprint(tokenizer_changed) == base  # only config and weights count


def test_fingerprint_of_a_directory_without_config(tmp_path):
    with pytest.raises(MlxInferError, match="no config.json"):
        paths.model_fingerprint(tmp_path)
