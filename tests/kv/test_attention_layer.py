"""mlx-infer's attention layers (kv/attention_layer.py), swapped in by kv/attention_hook.install per model
instance: they compute what mlx-lm's attention blocks compute, and mlx-lm's own modules and any other model of
theirs stay untouched."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base, gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.cache import make_prompt_cache

from gguf_factory import MODEL_TYPES, TinySpec, random_weights, reference_model
from mlx_infer.kernels.rope import KernelRoPEAttention, rope_backend
from mlx_infer.kv import attention_hook
from mlx_infer.kv.attention_hook import install
from mlx_infer.kv.attention_layer import CacheAttention

TESTS = Path(__file__).resolve().parent.parent
#: Each architecture's mlx-lm attention class.
MLX_LM_ATTENTION = {"llama": llama.Attention, "qwen2": qwen2.Attention, "qwen3": qwen3.Attention,
                    "gemma3": gemma3_text.Attention}


def spec_of(arch: str) -> TinySpec:
    """4 heads of 64 (what the attention kernels tile), GQA 4:2, 2 layers; gemma3: 6, five of them sliding
    windows of 8 tokens."""
    return TinySpec(arch, hidden=256, ffn=256, layers=6 if arch == "gemma3" else 2, sliding_window=8)


def forwards(model) -> np.ndarray:
    """A 40-token prefill (past the tiled prefill attention's minimum) and three one-token decode steps over
    mlx-lm's prompt cache: the logits of every position, float32, flattened."""
    cache = make_prompt_cache(model)
    outs = [model(mx.array([[(37 * i) % 200 + 3 for i in range(40)]]), cache=cache)[0]]
    for t in (9, 1, 4):
        outs.append(model(mx.array([[t]]), cache=cache)[0])
    return np.concatenate([np.array(o.astype(mx.float32)).reshape(-1) for o in outs])


@pytest.mark.parametrize("arch", list(MODEL_TYPES))
def test_cache_attention_computes_mlx_lm_attention(arch):
    """Each architecture: a model whose attention blocks are CacheAttention attending through mlx-lm's own
    function gives mlx-lm's logits bit for bit (the same operations on the same modules), and through the
    project's `attention` the same tokens within float32 rounding; another instance of the same classes keeps
    mlx-lm's blocks."""
    spec = spec_of(arch)
    weights = random_weights(spec, seed=3)
    want = forwards(reference_model(spec, weights))
    model, other = reference_model(spec, weights), reference_model(spec, weights)
    assert install(model) == spec.layers and install(model) == spec.layers  # idempotent
    assert all(type(layer.self_attn) is CacheAttention for layer in model.layers)
    assert all(type(layer.self_attn) is MLX_LM_ATTENTION[arch] for layer in other.layers)
    assert np.array_equal(forwards(other), want)
    ours = forwards(model)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-3 * np.abs(want).max())
    for layer in model.layers:
        layer.self_attn.attend = attention_hook.mlx_lm_attention
    assert np.array_equal(forwards(model), want)


def test_kernel_attention_is_swapped_per_instance(tiny_engine):
    """A loaded llama on the kernels: every block a KernelRoPEAttention calling the project's `attention`,
    the modules it holds those of the block it replaced (same parameters)."""
    if rope_backend() == "reference":
        pytest.skip("no CPU kernels here: the blocks are CacheAttention (tested above)")
    model = tiny_engine.model
    assert all(type(layer.self_attn) is KernelRoPEAttention and layer.self_attn.attend is attention_hook.attention
               for layer in model.layers)
    again = KernelRoPEAttention(model.layers[0].self_attn, attend=attention_hook.mlx_lm_attention)
    assert again.q_proj is model.layers[0].self_attn.q_proj and again.qkv is model.layers[0].self_attn.qkv
    assert install(model) == len(model.layers)


#: The check run in a fresh process (nothing of mlx-infer loaded before it): an app's own mlx-lm model of each
#: architecture (weights as the GGUF's), its logits before and after mlx-infer loads that GGUF and runs requests.
SAME_PROCESS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import mlx_infer
    import mlx.core as mx
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from mlx_lm.models import base, gemma3_text, llama, qwen2, qwen3
    from mlx_lm.models.cache import make_prompt_cache
    from gguf_factory import MODEL_TYPES, TinySpec, random_weights, reference_model, write_gguf

    def forwards(model):
        cache = make_prompt_cache(model)
        outs = [model(mx.array([[(37 * i) % 200 + 3 for i in range(40)]]), cache=cache)[0]]
        for t in (9, 1, 4):
            outs.append(model(mx.array([[t]]), cache=cache)[0])
        return np.concatenate([np.array(o.astype(mx.float32)).reshape(-1) for o in outs])

    out = {}
    for arch in MODEL_TYPES:
        spec = TinySpec(arch, hidden=256, ffn=256, layers=6 if arch == "gemma3" else 2, sliding_window=8)
        weights = random_weights(spec, seed=3)
        theirs = reference_model(spec, weights)
        before = forwards(theirs)
        path = write_gguf(f"{sys.argv[2]}/{arch}.gguf", spec, weights, Q.F32)
        engine = mlx_infer.load(str(path), weights="native")
        tokens = engine.generate("Hello there, " * 8, max_tokens=4).token_ids
        engine.configure_kv(kv_bits=8)
        engine.generate("Hello there", max_tokens=4)
        after = forwards(theirs)
        out[arch] = {"same": bool(np.array_equal(before, after)), "tokens": len(tokens),
                     "ours": sorted({type(layer.self_attn).__name__ for layer in engine.model.layers})}
    out["functions"] = [m.__name__ for m in (llama, qwen2, qwen3, gemma3_text)
                        if m.scaled_dot_product_attention is not base.scaled_dot_product_attention]
    print(json.dumps(out))
""")


def test_an_apps_mlx_lm_model_is_untouched_by_mlx_infer(tmp_path):
    """In a fresh process, an app's own mlx-lm model of each architecture gives bit-identical logits (prefill
    and decode steps) before and after mlx_infer.load() of a model of the same architecture and requests
    through it (float and 8-bit KV), and mlx-lm's model modules still call mlx-lm's own
    scaled_dot_product_attention; mlx-infer's model attends through its own layers."""
    run = subprocess.run([sys.executable, "-c", SAME_PROCESS, str(TESTS), str(tmp_path)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out.pop("functions") == []
    for arch in MODEL_TYPES:
        assert out[arch]["same"], arch
        assert out[arch]["tokens"] >= 1
        assert out[arch]["ours"] in (["CacheAttention"], ["KernelRoPEAttention"]), out[arch]


def test_mlx_lm_modules_keep_their_attention_function(tiny_engine):
    """After mlx-infer loaded and ran a model here, mlx-lm's model modules still call mlx-lm's function."""
    tiny_engine.generate("Hello", max_tokens=2)
    for module in (llama, qwen2, qwen3, gemma3_text):
        assert module.scaled_dot_product_attention is base.scaled_dot_product_attention, module.__name__
