"""The disk-cache key of timings (cost curves, priors): a change of what the model runs on measures again."""

from pathlib import Path

from mlx_infer.loading import ModelSource
from mlx_infer.speculative import target as target_mod
from mlx_infer.speculative.target import measurement_key


def source(tmp_path: Path, **kwargs) -> ModelSource:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    return ModelSource("m", "mlx-dir", d, d, **kwargs)


def test_the_key_follows_the_kernels_build(tmp_path, monkeypatch):
    monkeypatch.setattr(target_mod, "backend_name", lambda: "cpu")
    monkeypatch.setattr(target_mod.cpu_kernels, "build_id", lambda: "build-a")
    first = measurement_key(source(tmp_path, kernels="cpu-avx2"))
    assert measurement_key(source(tmp_path, kernels="cpu-avx2")) == first
    monkeypatch.setattr(target_mod.cpu_kernels, "build_id", lambda: "build-b")  # the kernels' sources changed
    assert measurement_key(source(tmp_path, kernels="cpu-avx2")) != first
    # the float32 path's layers (RMSNorm, RoPE) run on the kernels too
    float_a = measurement_key(source(tmp_path, weights="float32"))
    monkeypatch.setattr(target_mod.cpu_kernels, "build_id", lambda: None)  # kernels off
    assert measurement_key(source(tmp_path, weights="float32")) != float_a
