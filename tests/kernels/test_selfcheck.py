"""The kernel self-check (mlx_infer/kernels/selfcheck.py) on the CPU backend: the CPU kernels pass with real,
nonzero errors below the tolerance; an injected wrong kernel is refused and one that fails names its error;
an injected slow kernel (20 products for one) loses to MLX's op; the results are cached per device, MLX
version and kernel sources; the GPU wiring changes nothing on the CPU."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_infer import defaults
from mlx_infer.kernels import selfcheck, switch
from mlx_infer.kernels.qmm import reference_qmm
from mlx_infer.kernels.quantized import KernelQuantizedEmbedding, KernelQuantizedLinear, use_gpu_qmm

#: Small shapes of a model: two linear layers, a tied lm_head, attention of 4 heads over 2 KV heads, D = 64.
SHAPES = selfcheck.ModelShapes(linears=((96, 128, 4, 32), (128, 256, 8, 64)), embeddings=((256, 128, 8, 32),),
                               dtype="float32", heads=4, kv_heads=2, head_dim=64)
FAST = dict(qmm_widths=(1, 3, 16), widths=(1, 4), repeats=1)


def by_name(checks):
    return {c.name: c for c in checks}


def test_cpu_kernels_pass_with_real_errors(cpu_kernels):
    checks = by_name(selfcheck.check_kernels(SHAPES, cache=False, **FAST))
    assert list(checks) == list(switch.KERNEL_NAMES)
    for c in checks.values():
        assert c.device == selfcheck.device_name() and c.device.startswith("cpu ")
        assert c.passed and c.used, c
        assert c.tolerance == defaults.SELFCHECK_TOLERANCE["float32"]
        assert 0 < c.max_error < c.tolerance, c  # float32 rounding of another accumulation order: not zero
        assert c.cases > 0 and 0 < c.timed <= c.cases and c.time_s > 0 and c.mlx_time_s > 0
        assert c.reason.startswith("the CPU backend always runs its kernels")
    assert checks["qmm"].cases == 3 * 3  # every shape (lm_head included) at every width
    assert checks["rmm_qmm"].cases == 2 * 2  # the linear layers only
    assert checks["quant_attention"].cases == len(defaults.SELFCHECK_KV_BITS) * 2
    assert checks["paged_attention"].cases == 2


def test_a_wrong_kernel_is_refused(cpu_kernels):
    def off_by_one_percent(x, w, scales, biases, group_size, bits):
        return cpu_kernels.cpu_qmm(x, w, scales, biases, group_size, bits) * 1.01

    checks = by_name(selfcheck.check_kernels(SHAPES, kernels={"qmm": off_by_one_percent}, cache=False, **FAST))
    qmm = checks["qmm"]
    assert not qmm.passed and not qmm.used
    assert 0.005 < qmm.max_error < 0.02  # 1 % of each value, relative to the largest
    assert qmm.reason.startswith("refused: max error") and "above the tolerance 1e-04" in qmm.reason
    for name in ("quant_attention", "paged_attention", "rmm_qmm"):  # not given: MLX's ops
        assert not checks[name].used and checks[name].reason.startswith("no custom kernel")


def test_a_kernel_that_raises_is_one_line_not_an_exception(cpu_kernels):
    def broken(x, w, scales, biases, group_size, bits):
        raise RuntimeError("unable to compile the kernel\nsecond line")

    qmm = by_name(selfcheck.check_kernels(SHAPES, kernels={"qmm": broken}, cache=False, **FAST))["qmm"]
    assert not qmm.passed and not qmm.used and qmm.max_error is None
    assert qmm.reason == "refused: the kernel failed (N=96 K=128 4-bit rows=1): RuntimeError: unable to compile the kernel"


def test_a_slow_kernel_loses_to_mlx(cpu_kernels):
    def twenty_products(x, w, scales, biases, group_size, bits):  # right values, 20x MLX's work
        ys = [reference_qmm(x * (1.0 + 0.0 * i), w, scales, biases, group_size, bits) for i in range(20)]
        return sum(ys) / 20

    qmm = by_name(selfcheck.check_kernels(SHAPES, kernels={"qmm": twenty_products}, cache=False, **FAST))["qmm"]
    assert qmm.passed and not qmm.faster and not qmm.used
    assert qmm.time_s > qmm.mlx_time_s and qmm.reason.startswith("MLX's op is faster")


def test_the_cpu_policy_keeps_a_checked_kernel_only_with_checked(cpu_kernels):
    """policy='always' (the CPU backend's) runs a kernel wherever it exists; 'checked' decides."""
    def off(x, w, scales, biases, group_size, bits):
        return cpu_kernels.cpu_qmm(x, w, scales, biases, group_size, bits) * 1.01

    always = by_name(selfcheck.check_kernels(SHAPES, kernels={"qmm": off}, policy="always", cache=False, **FAST))
    assert always["qmm"].used and not always["qmm"].passed and "refused: max error" in always["qmm"].reason
    with pytest.raises(ValueError, match="policy must be one of"):
        selfcheck.check_kernels(SHAPES, policy="sometimes", cache=False)
    with pytest.raises(ValueError, match="unknown kernel names"):
        selfcheck.check_kernels(SHAPES, kernels={"matmul": off}, cache=False)


def test_results_are_cached_per_device_mlx_and_sources(cpu_kernels, monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    calls = []

    def counted(x, w, scales, biases, group_size, bits):
        calls.append(x.shape[0])
        return cpu_kernels.cpu_qmm(x, w, scales, biases, group_size, bits)

    said = []
    first = selfcheck.check_kernels(SHAPES, kernels={"qmm": counted}, say=said.append, **FAST)
    runs = len(calls)
    assert runs >= 9 and len(said) == 1 and "cached in" in said[0]
    files = list((tmp_path / selfcheck.CACHE_KIND).glob("*.json"))
    assert len(files) == 1
    assert [c["name"] for c in json.loads(files[0].read_text())["checks"]] == list(switch.KERNEL_NAMES)
    second = selfcheck.check_kernels(SHAPES, kernels={"qmm": counted}, say=said.append, **FAST)
    assert second == first and len(calls) == runs and len(said) == 1  # read back: nothing ran, nothing said
    again = selfcheck.check_kernels(SHAPES, kernels={"qmm": counted}, recheck=True, **FAST)
    assert len(calls) > runs and [c.name for c in again] == [c.name for c in first]
    # another MLX version (or device, or kernel sources) is another key: checked again, in its own file
    monkeypatch.setattr(mx, "__version__", mx.__version__ + ".other")
    runs = len(calls)
    selfcheck.check_kernels(SHAPES, kernels={"qmm": counted}, **FAST)
    assert len(calls) > runs and len(list((tmp_path / selfcheck.CACHE_KIND).glob("*.json"))) == 2


def test_sources_hash_follows_the_kernel_sources():
    digest = selfcheck.sources_hash()
    assert len(digest) == 16 and digest == selfcheck.sources_hash()


def tiny_model() -> nn.Module:
    model = nn.Module()
    model.embed = nn.QuantizedEmbedding(256, 128, group_size=32, bits=8)
    model.q = nn.QuantizedLinear(128, 96, bias=False, group_size=32, bits=4)
    model.odd = nn.QuantizedLinear(128, 64, bias=False, group_size=32, bits=6)  # no GPU kernel: stays MLX's
    return model


def test_model_shapes_and_the_gpu_swap():
    model = tiny_model()
    shapes = selfcheck.model_shapes(model, {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256})
    assert shapes.linears == ((96, 128, 4, 32),) and shapes.embeddings == ((256, 128, 8, 32),)
    assert (shapes.heads, shapes.kv_heads, shapes.head_dim) == (4, 2, 64)
    x = mx.random.normal((3, 128), key=mx.random.key(0))
    before = model.q(x)
    assert use_gpu_qmm(model) == 2
    assert type(model.q) is KernelQuantizedLinear and type(model.embed) is KernelQuantizedEmbedding
    assert type(model.odd) is nn.QuantizedLinear
    assert mx.allclose(model.q(x), before, atol=1e-4)


def test_gpu_wiring_changes_nothing_on_the_cpu():
    model = tiny_model()
    saved = switch.decisions()
    assert selfcheck.checked_gpu_kernels(model, {}) == []
    assert type(model.q) is nn.QuantizedLinear and switch.decisions() == saved
