"""Tiny random GGUF models of each architecture and tensor type, loaded by mlx_infer, against the
same weights loaded straight into mlx-lm's model class in Hugging Face layout.

The llama files carry llama.cpp's Q/K row permutation, so equal logits over a multi-token input
mean RoPE is right; the negative control shows a mistake would be caught.
"""

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import mlx_infer
from gguf_factory import (
    TinySpec,
    llama_cpp_permute,
    llama_cpp_unpermute,
    logits,
    random_k_quant_blocks,
    random_weights,
    reference_model,
    spm_tokenizer,
    stored_weights,
    write_gguf,
)

IDS = [5, 17, 260, 99, 3, 101, 42, 7, 255, 12, 64, 200, 31, 8, 150, 11, 90, 2, 33, 70]


def _spec(arch, **kw):
    if arch == "gemma3":
        # 6 layers: five sliding-window layers and one global; head_dim != hidden / heads; IDS is
        # longer than the window, so the window, both RoPE bases and the query scale all matter.
        kw = {"layers": 6, "head_dim": 32, "sliding_window": 8, "rope_theta": 1e6, **kw}
    return TinySpec(arch, **kw)


def _rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_f32_logits_equal_reference(arch, tmp_path):
    spec = _spec(arch)
    weights = random_weights(spec, seed=1)
    path = write_gguf(tmp_path / f"{arch}.gguf", spec, weights, Q.F32)
    engine = mlx_infer.load(str(path), weights="native")
    assert engine.source.kind == "gguf"
    assert engine.config["model_type"] == {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                           "gemma3": "gemma3_text"}[arch]
    ref = reference_model(spec, weights)
    got, want = logits(engine.model, IDS), logits(ref, IDS)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("ttype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_tensor_types_logits_match_reference(arch, ttype, tmp_path):
    """weights='float32' reproduces the stored values (fp16 rounding of the dequantized weights);
    weights='native' runs them as stored (MLX float16/bfloat16 or affine-quantized matmuls)."""
    spec = _spec(arch)
    weights = random_weights(spec, seed=2)
    path = write_gguf(tmp_path / f"{arch}-{ttype.name}.gguf", spec, weights, ttype)
    ref_logits = logits(reference_model(spec, stored_weights(weights, ttype)), IDS)

    f32 = mlx_infer.load(str(path), weights="float32")
    assert f32.source.weights == "float32"
    assert _rel_err(logits(f32.model, IDS), ref_logits) < 2e-3

    native = mlx_infer.load(str(path), weights="native")
    assert native.source.weights == "native"
    if ttype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        bits = 8 if ttype == Q.Q8_0 else 4
        q_proj = native.model.model.layers[0].self_attn.q_proj
        assert (q_proj.bits, q_proj.group_size) == (bits, 32)
        quant = json.loads((native.source.mlx_dir / "config.json").read_text())["quantization"]
        assert quant["bits"] == bits and quant["group_size"] == 32
    # Half-precision activations: looser, but still far below a wrong layout (see the control).
    assert _rel_err(logits(native.model, IDS), ref_logits) < 3e-2


def test_llama_without_permutation_is_caught(tmp_path):
    """Negative control: a llama GGUF whose Q/K rows were NOT permuted (i.e. a loader that forgot to
    undo it) gives clearly different logits, so the checks above can fail."""
    spec = _spec("llama")
    weights = random_weights(spec, seed=1)
    path = write_gguf(tmp_path / "unpermuted.gguf", spec, weights, Q.F32, permute=False)
    engine = mlx_infer.load(str(path), weights="native")
    assert _rel_err(logits(engine.model, IDS), logits(reference_model(spec, weights), IDS)) > 0.05


def test_llama_permutation_round_trip():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    permuted = llama_cpp_permute(w, 4)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(llama_cpp_unpermute(permuted, 4), w)
    # interleaved layout: row 1 of head 0 in GGUF order is HF row hd/2 = 8
    np.testing.assert_array_equal(permuted[1], w[8])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_k_quant_model_loads_close_to_reference(arch, tmp_path):
    """A Q4_K_M-like mix (Q4_K / Q5_K / Q6_K blocks, Q5_0, Q8_0) loads with logits close to the
    file's exact dequantized weights, Q/K permutation included. (Q2_K / Q3_K re-quantization error
    is bounded per tensor in test_gguf_tensors.py.)"""
    from gguf import quants

    spec = _spec(arch, hidden=256, ffn=256, heads=4, kv_heads=2, layers=2)
    weights = random_weights(spec, seed=3)
    plan = {
        "self_attn.q_proj": Q.Q4_K, "self_attn.k_proj": Q.Q5_K, "self_attn.v_proj": Q.Q6_K,
        "self_attn.o_proj": Q.Q4_K, "mlp.gate_proj": Q.Q5_0, "mlp.up_proj": Q.Q4_K, "mlp.down_proj": Q.Q6_K,
        "model.embed_tokens": Q.Q8_0,
    }
    raw, exact = {}, dict(weights)
    for i, (name, w) in enumerate(weights.items()):
        qtype = next((t for k, t in plan.items() if name.endswith(k + ".weight")), None)
        if qtype is None:
            continue
        rows, cols = w.shape
        if qtype in (Q.Q5_0, Q.Q8_0):
            blocks = quants.quantize(w, qtype)
        else:
            blocks = random_k_quant_blocks(qtype, rows, cols, seed=i)
        raw[name] = (blocks, qtype)
        dense = quants.dequantize(blocks, qtype).reshape(rows, cols).astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # random blocks are in the file's (permuted) row order; HF order for the reference
            dense = llama_cpp_unpermute(dense, spec.heads if "q_proj" in name else spec.kv_heads)
        exact[name] = dense
    path = write_gguf(tmp_path / f"{arch}-kquants.gguf", spec, weights, Q.F32, raw=raw)
    engine = mlx_infer.load(str(path), weights="float32")
    want = logits(reference_model(spec, exact), IDS)
    got = logits(engine.model, IDS)
    assert _rel_err(got, want) < 3e-2
    # and the re-quantized bits are at least the source's
    native = mlx_infer.load(str(path), weights="native")
    layer = native.model.model.layers[0]
    assert layer.self_attn.q_proj.bits >= 4  # Q4_K
    assert layer.self_attn.k_proj.bits >= 5  # Q5_K
    assert layer.self_attn.v_proj.bits >= 6  # Q6_K
    assert layer.mlp.gate_proj.bits >= 5  # Q5_0
    assert layer.mlp.up_proj.bits >= 4  # Q4_K
    assert native.model.model.embed_tokens.bits == 8  # Q8_0, repacked


def test_gguf_conversion_is_cached(tmp_path, monkeypatch):
    from mlx_infer.loading import gguf as gguf_mod

    spec = _spec("qwen2")
    path = write_gguf(tmp_path / "cached.gguf", spec, random_weights(spec), Q.Q8_0)
    first = mlx_infer.load(str(path), weights="native")
    calls = []
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda *a, **k: calls.append(a))
    second = mlx_infer.load(str(path), weights="native")
    assert calls == [] and second.source.mlx_dir == first.source.mlx_dir
    np.testing.assert_array_equal(logits(first.model, IDS[:5]), logits(second.model, IDS[:5]))


# --------------------------------------------------------------------------------------------
# Tokenizer and metadata


def test_bpe_tokenizer_from_metadata(tiny_engine, tiny_llama):
    _, spec, _ = tiny_llama
    tok = tiny_engine.tokenizer
    text = "the quick brown fox, hello world!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # merges were applied: fewer tokens than bytes; " hello" is one learned piece ("Ġ" = space)
    assert len(ids) < len(text.encode())
    assert "\u0120hello" in [spec.tokenizer.tokens[i] for i in ids]
    # no BOS for this vocabulary (add_bos_token false), EOS from metadata
    assert spec.tokenizer.bos_id not in ids
    assert spec.tokenizer.eos_id in tok.eos_token_ids
    # special tokens stay whole; the chat template comes from the metadata
    im_start = spec.tokenizer.tokens.index("<|im_start|>")
    chat = tiny_engine.encode([{"role": "user", "content": "hello"}])
    assert chat[0] == im_start and chat.count(im_start) == 2
    assert tok.decode(chat).endswith("<|im_start|>assistant\n")


def test_bpe_tokenizer_encodes_any_utf8(tiny_engine):
    tok = tiny_engine.tokenizer
    text = "naïve café 日本語 🙂"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sentencepiece_tokenizer_from_metadata(arch, tmp_path):
    spec = _spec(arch, tokenizer=spm_tokenizer())
    path = write_gguf(tmp_path / f"spm-{arch}.gguf", spec, random_weights(spec), Q.Q8_0)
    engine = mlx_infer.load(str(path), weights="native")
    tok = engine.tokenizer
    ids = tok.encode("the capital of france")
    assert ids[0] == 1  # BOS added, as llama.cpp does for SentencePiece vocabularies
    assert len(ids) < 1 + len("the capital of france")  # merged pieces
    assert tok.decode(ids, skip_special_tokens=True).strip() == "the capital of france"
    # an emoji is not in the vocabulary: byte-fallback tokens <0xF0><0x9F><0x99><0x82>
    emoji = tok.encode("🙂")
    assert [spec.tokenizer.tokens[i] for i in emoji if i != 1][-4:] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert tok.decode(emoji, skip_special_tokens=True).strip() == "🙂"
    assert 2 in tok.eos_token_ids
    assert not tok.has_chat_template


def test_metadata_maps_to_config(tmp_path):
    spec = _spec("gemma3", context=1024)
    path = write_gguf(tmp_path / "g.gguf", spec, random_weights(spec), Q.F32,
                      extra_kv={"gemma3.attention.sliding_window": 8})
    engine = mlx_infer.load(str(path), weights="native")
    c = engine.config
    assert c["head_dim"] == 32 and c["query_pre_attn_scalar"] == 32
    assert c["sliding_window"] == 8 and c["rope_theta"] == 1e6 and c["rope_local_base_freq"] == 10000.0
    assert c["max_position_embeddings"] == 1024 == engine.context_length
    assert c["tie_word_embeddings"] is True
    assert c["num_key_value_heads"] == 2 and c["vocab_size"] == spec.vocab
