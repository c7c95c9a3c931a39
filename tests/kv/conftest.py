"""Fixtures of the paged KV cache tests: tiny GGUF models of each architecture, a wikitext prompt."""

import pytest
from gguf import GGMLQuantizationType as Q

import mlx_infer
from gguf_factory import MODEL_TYPES, TinySpec, random_weights, write_gguf

#: Every architecture the GGUF loader maps (gguf_factory writes each).
ARCHS = list(MODEL_TYPES)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> an mlx-lm model loaded by mlx_infer from a tiny random F32 GGUF (gemma3: 6 layers, five with
    a sliding window of 8, shorter than the inputs, so the window mask matters)."""
    out = {}
    for arch in ARCHS:
        kw = {"layers": 6, "head_dim": 32, "sliding_window": 8, "rope_theta": 1e6} if arch == "gemma3" else {}
        spec = TinySpec(arch, **kw)
        path = write_gguf(tmp_path_factory.mktemp("kv") / f"{arch}.gguf", spec, random_weights(spec, seed=3), Q.F32)
        out[arch] = mlx_infer.load(str(path), weights="native").model
    return out


@pytest.fixture(scope="session")
def default_model(default_engine):
    return default_engine.model
