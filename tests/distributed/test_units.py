"""The distributed package's pieces in one process: layer ranges, the tensor plan's splits and checks, the
model digest, the step timeout's parsing, a group of one."""

import shutil

import pytest

import mlx_infer
from gguf_factory import Q, tiny_gguf
from mlx_infer.distributed import broadcast_list, init_group
from mlx_infer.distributed.digest import model_digest
from mlx_infer.distributed.pipeline import layer_ranges
from mlx_infer.distributed.tensor import tensor_plan
from mlx_infer.distributed.watchdog import step_timeout
from mlx_infer.errors import DistributedError, MlxInferError
from mlx_infer.loading import resolve


def test_layer_ranges_contiguous_first_ranks_take_the_extra():
    assert layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert layer_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(DistributedError, match="at least 4 layers"):
        layer_ranges(3, 4)


def test_tensor_plan_splits_by_kv_head():
    engine = mlx_infer.load()  # 9 query / 3 KV heads, head_dim 64, MLP 1536 rows, 4-bit group 32
    plan = tensor_plan(engine.model, 2)
    assert plan.kv == [0, 1, 3] and [plan.heads(0), plan.heads(1)] == [(0, 3), (3, 9)]
    assert plan.ffn == [0, 768, 1536]
    assert tensor_plan(engine.model, 3).kv == [0, 1, 2, 3]
    with pytest.raises(DistributedError, match="at least 4 KV heads"):
        tensor_plan(engine.model, 4)


def test_digest_tells_weights_apart_and_ignores_the_folder(tmp_path):
    a = resolve(str(tiny_gguf(tmp_path / "a.gguf", "llama", Q.F32, seed=1)[0])).mlx_dir
    b = resolve(str(tiny_gguf(tmp_path / "b.gguf", "llama", Q.F32, seed=2)[0])).mlx_dir
    copy = shutil.copytree(a, tmp_path / "elsewhere")
    assert model_digest(a) != model_digest(b)
    assert model_digest(a) == model_digest(copy)


def test_step_timeout_env(monkeypatch):
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "12.5")
    assert step_timeout() == 12.5
    monkeypatch.setenv("MLX_INFER_DIST_TIMEOUT", "soon")
    with pytest.raises(MlxInferError, match="MLX_INFER_DIST_TIMEOUT must be a positive number"):
        step_timeout()


def test_group_of_one():
    group = init_group("any")
    assert (group.size, group.rank, group.is_root) == (1, 0, True)
    assert broadcast_list(group, [3, 1, 4], "ids") == [3, 1, 4]
    with pytest.raises(MlxInferError, match="unknown distributed backend"):
        init_group("carrier-pigeon")
