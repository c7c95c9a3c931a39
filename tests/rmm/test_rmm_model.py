"""RMM on real models: rho = 1 leaves the output bit-identical; a reduced model's output does not depend
on how its tokens are chunked (per-row selection); the reduced view shares weights and leaves the model
as it was; the attention products; `--spec rmm` is lossless; the engine reports the retention."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_infer
from mlx_infer.errors import MlxInferError
from mlx_infer.kv.attention_hook import install
from mlx_infer.loading import load_model
from mlx_infer.rmm.apply import component_of, reduce_model, reduced_view
from mlx_infer.rmm.attention import pv_attention, reduce_queries, reduced_products
from mlx_infer.rmm.layers import RmmQuantizedLinear
from mlx_infer.rmm.options import Retention, parse_rmm

TEXT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "


@pytest.fixture(scope="module")
def native(default_gguf):
    """(model, tokenizer) of the default model, quantized weights on the kernels."""
    net, tok, _, _ = load_model(None, weights="native")
    return net, tok


@pytest.fixture(scope="module")
def ids(native):
    return mx.array(native[1].encode(TEXT * 3))[None]  # [1, L]


def test_component_of():
    assert component_of("model.layers.3.mlp.down_proj") == ("down", 3)
    assert component_of("model.layers.12.self_attn.q_proj") == ("q", 12)
    assert component_of("model.embed_tokens") == (None, None)


def test_full_retention_is_bit_identical(native, ids):
    """Every rule at rho = 1 (given explicitly, so the rules are there but keep everything): nothing is
    swapped and the logits are the same bits."""
    net, _ = native
    retention = Retention((("q", 0, None, 1.0), ("down", 0, None, 1.0)), "q=1,down=1")
    view = reduced_view(net, retention)
    assert not any(isinstance(m, RmmQuantizedLinear) for m in view.modules())
    assert mx.array_equal(view(ids), net(ids)).item()
    install(net)
    with reduced_products(1.0, 1.0):
        assert mx.array_equal(net(ids), view(ids)).item()


def test_view_shares_weights_and_leaves_the_model(native, ids):
    net, _ = native
    before = net(ids)
    view = reduced_view(net, parse_rmm("mlp=0.5"))
    layer = view.model.layers[4].mlp.down_proj
    assert isinstance(layer, RmmQuantizedLinear) and layer.keep == 24 and layer.groups == 48
    assert layer["weight"] is net.model.layers[4].mlp.down_proj["weight"]  # no copy
    assert not isinstance(net.model.layers[4].mlp.down_proj, RmmQuantizedLinear)
    reduced = view(ids)
    assert not mx.allclose(reduced, before).item()
    assert mx.array_equal(net(ids), before).item()


def test_reduced_model_does_not_depend_on_chunking(native, ids):
    """Prefill in one chunk (the reference path, rows > 16) and token by token (the kernel, one row):
    the same greedy tokens and logits within float32 accumulation error."""
    net, _ = native
    view = reduced_view(net, parse_rmm("attn=0.75,mlp=0.75"))
    n = 40
    whole = view(ids[:, :n])[0]  # [n, V]
    cache = make_prompt_cache(view)
    steps = mx.concatenate([view(ids[:, i:i + 1], cache=cache)[0] for i in range(n)])  # [n, V]
    assert (whole.argmax(-1) == steps.argmax(-1)).all().item()
    assert mx.abs(whole - steps).max().item() < 2e-2 * mx.abs(whole).max().item()


def test_reduce_model_counts_layers(default_gguf):
    net, _, _, _ = load_model(None, weights="native")
    assert reduce_model(net, parse_rmm("down=0.5")) == len(net.model.layers)
    assert reduce_model(net, parse_rmm("q@0-1=0.5")) == 2


def test_reduced_queries_keep_the_largest_entries():
    q = mx.array(np.random.default_rng(0).normal(size=(1, 2, 3, 8)).astype(np.float32))
    r = np.array(reduce_queries(q, 0.5))  # ceil(0.5 * 8) = 4 per row
    qn = np.array(q)
    for h in range(2):
        for l in range(3):
            kept = np.nonzero(r[0, h, l])[0]
            assert sorted(kept) == sorted(np.argsort(-np.abs(qn[0, h, l]))[:4])
            assert np.array_equal(r[0, h, l, kept], qn[0, h, l, kept])


def test_pv_attention_against_numpy():
    """PV over tokens: each row keeps ceil(pv * visible) most probable keys, unrenormalized (NumPy oracle,
    GQA with 2 query heads per KV head, causal)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 6)))
    out = np.array(pv_attention(mx.array(q), mx.array(k), mx.array(v), 0.3, "causal", 0.5))
    for h in range(4):
        kv = h // 2
        for l in range(5):
            visible = 7 - 5 + l + 1
            s = 0.3 * k[0, kv, :visible] @ q[0, h, l]
            p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            keep = int(np.ceil(0.5 * visible))
            p[np.argsort(-p)[keep:]] = 0
            assert np.allclose(out[0, h, l], p @ v[0, kv, :visible], atol=1e-5)
    full = np.array(pv_attention(mx.array(q), mx.array(k), mx.array(v), 0.3, None, 1.0))
    ref = np.array(mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.3,
                                                        mask=None))
    assert np.allclose(full, ref, atol=1e-5)


@pytest.fixture(scope="module")
def rmm_engine(default_gguf):
    return mlx_infer.load(weights="native", rmm="qk=0.5, ATTN=0.75")


def test_engine_reports_and_runs_the_products(rmm_engine, default_engine_native):
    prompt = "Name three colors."
    out = rmm_engine.generate(prompt, max_tokens=12)
    assert out.stats.rmm == "attn=0.75,qk=0.5"  # canonical, not as written
    assert out.to_dict()["stats"]["rmm"] == "attn=0.75,qk=0.5"
    assert default_engine_native.generate(prompt, max_tokens=12).stats.rmm is None
    with pytest.raises(MlxInferError, match="batched decoding"):
        rmm_engine.generate_batch([prompt, prompt], max_tokens=4)


def test_batched_requests_report_the_retention(default_gguf):
    """Batched decoding (linear components only) reports the same canonical retention as a single request."""
    engine = mlx_infer.load(weights="native", rmm="MLP=0.9")
    results = engine.generate_batch(["Name a color.", "Name a fruit."], max_tokens=3)
    assert [r.stats.rmm for r in results] == ["mlp=0.9", "mlp=0.9"]
    assert engine.generate("Name a color.", max_tokens=3).stats.rmm == "mlp=0.9"


def test_bad_rmm_fails_before_loading():
    """The Python API's message names its keyword (rmm), not the command line's flag (--rmm)."""
    with pytest.raises(MlxInferError, match="^rmm 'ffn=0.5': unknown component") as e:
        mlx_infer.load("/nonexistent/model.gguf", rmm="ffn=0.5")
    assert "--rmm" not in str(e.value)


@pytest.mark.parametrize("value", [0.5, 1, ["attn=0.5"]])
def test_rmm_of_another_type_fails_before_loading(value):
    with pytest.raises(MlxInferError, match='rmm must be a string like "attn=0.5,mlp=0.9" or a preset name'):
        mlx_infer.load("/nonexistent/model.gguf", rmm=value)


def test_layer_range_past_the_model_is_refused(default_gguf):
    """The default model has 30 decoder layers (0-29): mlp@40-50 selects none of them."""
    with pytest.raises(MlxInferError, match=r"'mlp@40-50=0.5': this model has 30 layers \(0-29\)"):
        mlx_infer.load(weights="native", rmm="attn=0.9,mlp@40-50=0.5")


@pytest.mark.parametrize("max_draft", [2, 4])
def test_spec_rmm_is_lossless_on_the_default_model(default_engine_native, max_draft):
    for prompt in ("What is 12 + 30? Answer briefly.", "Write one sentence about the sea."):
        plain = default_engine_native.generate(prompt, max_tokens=24)
        spec = default_engine_native.generate(prompt, max_tokens=24, speculative="rmm", max_draft=max_draft)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        assert spec.stats.spec_mode == "rmm" and spec.stats.rounds > 0
