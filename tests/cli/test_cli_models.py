"""`mlx-infer models` / `ls` (what serve would serve, with sizes; the cached GGUF conversions) and `serve` with
several models (--model repeated, --models-dir, --alias, --keep-alive), issue 49."""

import json
import os
import time
from pathlib import Path

import httpx
from cli_helpers import TIMEOUT_S, assert_user_error
from gguf_factory import TinySpec, random_weights, write_gguf
from test_cli_serve import serving


def models_dir(tmp_path: Path) -> Path:
    """A folder with a tiny GGUF, an MLX model directory, a file and a folder that are no models."""
    folder = tmp_path / "models"
    folder.mkdir()
    spec = TinySpec("llama")
    write_gguf(folder / "tiny.gguf", spec, random_weights(spec, seed=0))
    (folder / "mlx-model").mkdir()
    (folder / "mlx-model" / "config.json").write_text("{}")
    (folder / "mlx-model" / "model.safetensors").write_bytes(b"\0" * 3000)
    (folder / "notes.txt").write_text("not a model")
    (folder / "empty").mkdir()
    return folder


def test_models_lists_what_serve_would_serve_and_the_cache(run_cli, tmp_path, default_gguf):
    folder = models_dir(tmp_path)
    r = run_cli("models", "-m", "default", "--models-dir", folder, "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    tiny = folder / "tiny.gguf"
    assert listed["served"] == [
        {"name": "default", "format": "default", "size": default_gguf.stat().st_size, "path": str(default_gguf)},
        {"name": "mlx-model", "format": "mlx-dir", "size": 3002, "path": str(folder / "mlx-model")},
        {"name": "tiny", "format": "gguf", "size": tiny.stat().st_size, "path": str(tiny)},
    ]
    cache = Path(os.environ["MLX_INFER_CACHE"]) / "gguf"
    assert listed["cache"] == str(cache)
    conversions = sorted(p.name for p in cache.iterdir() if (p / "config.json").is_file()) if cache.is_dir() else []
    assert [m["name"] for m in listed["cached"]] == conversions
    table = run_cli("ls", "--models-dir", folder)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["NAME", "FORMAT", "SIZE", "PATH"]
    assert lines[1].split() == ["mlx-model", "mlx-dir", "3.0", "kB", str(folder / "mlx-model")]
    assert lines[2].split()[:2] == ["tiny", "gguf"] and lines[2].endswith(str(tiny))


def test_models_and_serve_refuse_bad_folders_and_names(run_cli, tmp_path):
    assert_user_error(run_cli("models", "--models-dir", tmp_path / "nowhere"), "--models-dir")
    assert_user_error(run_cli("serve", "--models-dir", tmp_path), "no .gguf files or model directories")
    folder = models_dir(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tiny.gguf").write_bytes((folder / "tiny.gguf").read_bytes())
    assert_user_error(run_cli("serve", "-m", other / "tiny.gguf", "--models-dir", folder), "two models are named 'tiny'")
    assert_user_error(run_cli("serve", "--models-dir", folder, "--alias", "gpt-4=llama"), "not a served model")
    assert_user_error(run_cli("serve", "--alias", "claude-*"), "NAME=MODEL")


def test_serve_two_models_an_alias_and_keep_alive(tmp_path, default_gguf):
    folder = models_dir(tmp_path)
    (folder / "mlx-model" / "config.json").unlink()  # only the GGUF is a model now
    with serving("-m", "default", "--models-dir", folder, "--alias", "claude-*=tiny", "--keep-alive", "0",
                 "--max-loaded-models", "2") as (port, proc):
        url = f"http://127.0.0.1:{port}/v1"

        def loaded():
            return {m["id"]: m["loaded"] for m in httpx.get(url + "/models", timeout=TIMEOUT_S).json()["data"]}
        assert loaded() == {"default": True, "tiny": False}
        r = httpx.post(url + "/completions", json={"model": "claude-3-haiku", "prompt": "the quick", "max_tokens": 4},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        deadline = time.monotonic() + TIMEOUT_S
        while loaded()["tiny"]:  # --keep-alive 0: unloaded after the request
            assert time.monotonic() < deadline
            time.sleep(0.2)
        r = httpx.post(url + "/completions", json={"model": "gpt-4", "prompt": "the quick"}, timeout=TIMEOUT_S)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert proc.returncode == 0, proc.stderr_text
    assert f"serving default on http://127.0.0.1:{port}/v1 (Ctrl-C stops); on demand: tiny" in proc.stderr_text


def active_bytes(port: int) -> float:
    """mlx_infer_memory_active_bytes from the server's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("mlx_infer_memory_active_bytes "))


def test_serve_frees_the_default_model_it_unloads(tmp_path, default_gguf):
    """The default model, loaded before serve listens, leaves memory when the pool unloads it for another
    (--max-loaded-models 1): MLX's active bytes fall below half of what they were with it loaded (its
    weights are most of them; the tiny model's are a few KB). Before the fix serve's own frame kept it."""
    folder = models_dir(tmp_path)
    with serving("-m", "default", "-m", str(folder / "tiny.gguf"), "--max-loaded-models", "1",
                 "--no-access-log") as (port, proc):
        url = f"http://127.0.0.1:{port}/v1"
        with_default = active_bytes(port)
        r = httpx.post(url + "/completions", json={"model": "tiny", "prompt": "the quick", "max_tokens": 4},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        loaded = {m["id"]: m["loaded"] for m in httpx.get(url + "/models", timeout=TIMEOUT_S).json()["data"]}
        assert loaded == {"default": False, "tiny": True}
        assert with_default > 50e6  # the default model's weights (SmolLM2-135M at 4 bits)
        deadline = time.monotonic() + TIMEOUT_S  # (only to fail a leak: the unload may still be under way)
        while (now := active_bytes(port)) >= with_default / 2:
            assert time.monotonic() < deadline, (now, with_default)
            time.sleep(0.5)
