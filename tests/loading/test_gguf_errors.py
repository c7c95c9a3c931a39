"""Bad GGUF files: each raises the right MlxInferError subclass with a one-line message naming the problem."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import mlx_infer
from gguf_factory import TinySpec, random_weights, write_gguf
from mlx_infer.errors import InvalidGGUFError, MlxInferError, ModelNotFoundError, UnsupportedModelError


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    spec = TinySpec("llama")
    return write_gguf(tmp_path_factory.mktemp("bad") / "good.gguf", spec, random_weights(spec), Q.Q8_0)


def _load_error(path, cls):
    with pytest.raises(cls) as info:
        mlx_infer.load(str(path), weights="native")
    msg = str(info.value)
    assert "\n" not in msg and msg
    assert isinstance(info.value, MlxInferError)
    return msg


def test_missing_file(tmp_path):
    msg = _load_error(tmp_path / "nope.gguf", ModelNotFoundError)
    assert "nope.gguf" in msg


def test_missing_path_that_is_not_a_repo_id(tmp_path):
    msg = _load_error(tmp_path / "no" / "such" / "dir", ModelNotFoundError)
    assert "no model at" in msg


def test_bad_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(1000))
    msg = _load_error(path, InvalidGGUFError)
    assert "not a GGUF file" in msg and "model.gguf" in msg


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    assert "not a GGUF file" in _load_error(path, InvalidGGUFError)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_file(good_file, tmp_path, keep):
    """Cut inside the tensor data: the tensor table points past the end of the file."""
    data = good_file.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    msg = _load_error(path, InvalidGGUFError)
    assert "truncated" in msg and "truncated.gguf" in msg


def test_truncated_in_metadata(good_file, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good_file.read_bytes()[:200])
    msg = _load_error(path, InvalidGGUFError)
    assert "truncated or corrupt" in msg or "truncated" in msg


def test_unsupported_architecture(tmp_path):
    spec = TinySpec("llama")
    path = write_gguf(tmp_path / "mamba.gguf", spec, random_weights(spec), Q.F32, arch_name="mamba")
    msg = _load_error(path, UnsupportedModelError)
    assert "'mamba'" in msg and "not supported" in msg and "llama" in msg


def test_unsupported_tensor_type(tmp_path):
    from gguf import quants

    spec = TinySpec("llama", hidden=256, ffn=256)
    weights = random_weights(spec)
    name = "model.layers.0.mlp.up_proj.weight"
    blocks = quants.quantize(weights[name], Q.TQ2_0)  # ternary: no MLX mapping
    path = write_gguf(tmp_path / "tq.gguf", spec, weights, Q.F32, raw={name: (blocks, Q.TQ2_0)})
    msg = _load_error(path, UnsupportedModelError)
    assert "TQ2_0" in msg and "blk.0.ffn_up.weight" in msg


def test_unknown_tensor_name(tmp_path):
    spec = TinySpec("llama")
    weights = random_weights(spec)
    weights["model.layers.0.mystery.weight"] = np.zeros((4, 64), np.float32)
    from gguf_factory import _LAYER

    _LAYER["mystery"] = "ssm_conv1d"
    try:
        path = write_gguf(tmp_path / "odd.gguf", spec, weights, Q.F32)
    finally:
        del _LAYER["mystery"]
    msg = _load_error(path, UnsupportedModelError)
    assert "blk.0.ssm_conv1d.weight" in msg


def test_failed_conversion_leaves_no_cache_entry(tmp_path, mlx_infer_cache):
    spec = TinySpec("llama")
    path = write_gguf(tmp_path / "arch.gguf", spec, random_weights(spec), Q.F32, arch_name="rwkv6")
    before = set((mlx_infer_cache / "gguf").glob("*")) if (mlx_infer_cache / "gguf").exists() else set()
    _load_error(path, UnsupportedModelError)
    after = set((mlx_infer_cache / "gguf").glob("*")) if (mlx_infer_cache / "gguf").exists() else set()
    assert after == before


def test_bad_weights_mode(good_file):
    with pytest.raises(MlxInferError, match="weights must be one of"):
        mlx_infer.load(str(good_file), weights="int3")
