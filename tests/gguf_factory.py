"""Tiny random models written as GGUF files with the `gguf` package, and their references.

Reusable by any test (loading, generation, speculative decoding):

    spec = TinySpec("llama")
    weights = random_weights(spec, seed=0)            # mlx-lm (HF layout) names -> float32 numpy
    path = write_gguf(tmp_path / "m.gguf", spec, weights, tensor_type=Q.Q8_0)
    ref = reference_model(spec, stored_weights(weights, Q.Q8_0))   # mlx-lm model, float32
    engine = mlx_infer.load(str(path), weights="float32")

The GGUF layout follows llama.cpp's convert_hf_to_gguf.py, written here independently of
mlx_infer: Q/K rows permuted for llama, Gemma norm weights stored as 1 + w, tied embeddings
without an `output.weight`, and a small tokenizer in the metadata (a byte-level BPE `gpt2`
vocabulary with merges, or a SentencePiece `llama` one with byte fallback).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

#: GGUF architecture -> mlx-lm model_type.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

#: mlx-lm per-layer module path -> GGUF tensor base name (llama.cpp's tensor names).
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_LAYER = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

#: A small English corpus the tiny tokenizers learn their merges from.
CORPUS = (
    "the quick brown fox jumps over the lazy dog. the capital of france is paris. "
    "hello world, hello there. stop here and there. a tokenizer for the tests of the loader "
    "and the generator: one two three four five six seven eight nine ten. The End."
)

#: Byte offsets of the float16 scale fields in each K-quant block (llama.cpp ggml-common.h).
K_QUANT_F16_FIELDS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


# --------------------------------------------------------------------------------------------
# Tokenizers


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def learn_merges(words: List[List[str]], n_merges: int) -> List[Tuple[str, str]]:
    """Plain BPE training: repeatedly merge the most frequent adjacent pair."""
    words = [list(w) for w in words]
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w in words:
            pairs.update(zip(w, w[1:]))
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        merges.append((a, b))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                else:
                    i += 1
    return merges


@dataclass
class TinyTokenizer:
    """Tokenizer metadata for a GGUF file."""

    kind: str  # "gpt2" or "llama"
    tokens: List[str]
    token_types: List[int]
    scores: Optional[List[float]] = None
    merges: Optional[List[str]] = None
    bos_id: int = 0
    eos_id: int = 0
    unk_id: Optional[int] = None
    add_bos: bool = False
    chat_template: Optional[str] = None
    extra: dict = field(default_factory=dict)

    def __len__(self):
        return len(self.tokens)


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def gpt2_tokenizer(n_merges: int = 120) -> TinyTokenizer:
    """A byte-level BPE vocabulary: 256 byte tokens, merges learned on CORPUS, and three specials
    (<|endoftext|> = BOS, <|im_start|>, <|im_end|> = EOS) with a ChatML template."""
    alphabet = bytes_to_unicode()
    words = []
    for i, word in enumerate(CORPUS.split(" ")):
        text = word if i == 0 else " " + word
        words.append([alphabet[b] for b in text.encode("utf-8")])
    merges = learn_merges(words, n_merges)
    tokens = [alphabet[b] for b in range(256)] + [a + b for a, b in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * len(tokens) + [3] * len(specials)
    tokens += specials
    return TinyTokenizer(
        kind="gpt2", tokens=tokens, token_types=types, merges=[f"{a} {b}" for a, b in merges],
        bos_id=tokens.index("<|endoftext|>"), eos_id=tokens.index("<|im_end|>"), add_bos=False,
        chat_template=CHATML, extra={"tokenizer.ggml.pre": "gpt2"},
    )


def spm_tokenizer(n_merges: int = 120) -> TinyTokenizer:
    """A SentencePiece (llama) vocabulary: <unk> <s> </s>, 256 byte-fallback tokens <0xNN>,
    the corpus characters and pieces merged from them (scores = -merge rank); adds BOS."""
    words = [list("\u2581" + w) for w in CORPUS.split(" ")]
    chars = sorted({c for w in words for c in w})
    merges = learn_merges(words, n_merges)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    for i, c in enumerate(chars):
        tokens.append(c)
        types.append(1)
        scores.append(-1000.0 - i)
    for rank, (a, b) in enumerate(merges):
        if a + b not in tokens:
            tokens.append(a + b)
            types.append(1)
            scores.append(-float(rank))
    return TinyTokenizer(
        kind="llama", tokens=tokens, token_types=types, scores=scores,
        bos_id=1, eos_id=2, unk_id=0, add_bos=True,
        extra={"tokenizer.ggml.add_space_prefix": False},
    )


# --------------------------------------------------------------------------------------------
# Model spec, weights, reference


@dataclass
class TinySpec:
    """The shape of a tiny model. `head_dim` defaults to hidden // heads."""

    arch: str = "llama"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: Optional[int] = None
    ffn: int = 128
    context: int = 512
    rope_theta: float = 10000.0
    eps: float = 1e-6
    tie: Optional[bool] = None  # default: tied for qwen3 and gemma3
    sliding_window: int = 8  # gemma3 only
    tokenizer: TinyTokenizer = None

    def __post_init__(self):
        if self.tokenizer is None:
            self.tokenizer = spm_tokenizer() if self.arch == "gemma3" else gpt2_tokenizer()
        if self.head_dim is None:
            self.head_dim = self.hidden // self.heads
        if self.tie is None:
            self.tie = self.arch in ("qwen3", "gemma3")

    @property
    def vocab(self) -> int:
        return len(self.tokenizer)


def hf_config(spec: TinySpec) -> dict:
    """The Hugging Face-style config mlx-lm builds the reference model from."""
    config = {
        "model_type": MODEL_TYPES[spec.arch],
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "intermediate_size": spec.ffn,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": spec.eps,
        "vocab_size": spec.vocab,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.context,
        "tie_word_embeddings": spec.tie,
    }
    if spec.arch == "gemma3":
        config.update(
            sliding_window=spec.sliding_window, sliding_window_pattern=6, rope_local_base_freq=10000.0,
            query_pre_attn_scalar=spec.head_dim,
        )
    return config


def _model_class(spec: TinySpec):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(hf_config(spec))
    return model_cls, args_cls.from_dict(hf_config(spec))


def random_weights(spec: TinySpec, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random float32 weights in mlx-lm / HF layout, named as the mlx-lm model's parameters.

    Matrices ~ N(0, 1/in), embeddings ~ N(0, 1), norm weights near their identity value
    (1 for llama-style norms, 0 for Gemma's (1 + w) norms), biases ~ N(0, 0.1).
    """
    from mlx.utils import tree_flatten

    model_cls, args = _model_class(spec)
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in tree_flatten(model_cls(args).parameters()):
        shape = tuple(p.shape)
        if name == "lm_head.weight" and spec.tie:
            continue
        if name.endswith("norm.weight"):
            base = 0.0 if spec.arch == "gemma3" else 1.0
            w = base + 0.2 * rng.standard_normal(shape)
        elif name.endswith("bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = w.astype(np.float32)
    return out


def stored_weights(weights: Dict[str, np.ndarray], tensor_type: Q) -> Dict[str, np.ndarray]:
    """The float32 values a GGUF of `tensor_type` holds for each matrix (norms and biases stay F32),
    i.e. what an exact loader must reproduce."""
    out = {}
    for name, w in weights.items():
        if w.ndim == 2 and tensor_type != Q.F32:
            w = quants.dequantize(quants.quantize(w, tensor_type), tensor_type).reshape(w.shape)
        out[name] = np.asarray(w, dtype=np.float32)
    return out


def reference_model(spec: TinySpec, weights: Dict[str, np.ndarray]):
    """The mlx-lm model of `spec` with these float32 weights, in float32."""
    import mlx.core as mx

    model_cls, args = _model_class(spec)
    model = model_cls(args)
    weights = dict(weights)
    if spec.tie and spec.arch == "gemma3":
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    mx.eval(model.parameters())
    return model


def logits(model, ids: List[int]) -> np.ndarray:
    """Float32 logits [T, V] of a full forward pass over `ids`."""
    import mlx.core as mx

    out = model(mx.array(ids)[None])
    return np.array(out[0].astype(mx.float32))


# --------------------------------------------------------------------------------------------
# GGUF writing


def gguf_name(mlx_name: str, arch: str) -> str:
    """'model.layers.1.self_attn.q_proj.weight' -> 'blk.1.attn_q.weight'."""
    module, param = mlx_name.rsplit(".", 1)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{param}"
    parts = module.split(".", 3)
    table = _GEMMA_LAYER if arch == "gemma3" else _LAYER
    return f"blk.{parts[2]}.{table[parts[3]]}.{param}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's Q/K row permutation (HF half-split -> interleaved RoPE)."""
    out = w.shape[0]
    hd = out // n_head
    return w.reshape(n_head, 2, hd // 2, *w.shape[1:]).swapaxes(1, 2).reshape(out, *w.shape[1:])


def random_k_quant_blocks(qtype: Q, rows: int, cols: int, seed: int = 0, std: Optional[float] = None) -> np.ndarray:
    """Valid random blocks of a K-quant type (which `gguf` cannot quantize to): random bytes with
    positive float16 scale fields, rescaled so the dequantized values have about `std`
    (default 1/sqrt(cols)). Returns uint8 [rows, cols / 256 * block_bytes]."""
    from gguf.constants import GGML_QUANT_SIZES

    block, nbytes = GGML_QUANT_SIZES[qtype]
    assert cols % block == 0, f"{qtype.name} needs columns in multiples of {block}"
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    fields = K_QUANT_F16_FIELDS[qtype]
    scales = {off: rng.uniform(0.5, 1.0, size=(rows, cols // block)) for off in fields}

    def put(factor):
        for off, s in scales.items():
            f16 = (s * factor).astype(np.float16)
            blocks[..., off:off + 2] = f16[..., None].view(np.uint8).reshape(rows, cols // block, 2)
        return blocks.reshape(rows, -1)

    dense = quants.dequantize(put(1.0), qtype)
    target = std if std is not None else 1.0 / np.sqrt(cols)
    return put(target / float(dense.std()))


def write_gguf(
    path: Path,
    spec: TinySpec,
    weights: Dict[str, np.ndarray],
    tensor_type: Q = Q.F32,
    *,
    raw: Optional[Dict[str, Tuple[np.ndarray, Q]]] = None,
    permute: bool = True,
    arch_name: Optional[str] = None,
    extra_kv: Optional[dict] = None,
) -> Path:
    """Write `weights` (mlx-lm names, HF layout, float32) as a llama.cpp-style GGUF file.

    Args:
        tensor_type: type of every 2-D weight (norms and biases are always F32, as llama.cpp does).
        raw: {mlx name: (already-encoded uint8 blocks in GGUF row order, type)} written as they are
            (e.g. random K-quant blocks); their rows must already be permuted for llama Q/K.
        permute: apply llama.cpp's Q/K permutation for llama (False writes a wrong file on purpose).
        arch_name: the general.architecture to claim (default spec.arch).
        extra_kv: more metadata, {key: value} (str, int, float, bool or list of str).
    """
    arch = arch_name or spec.arch
    tok = spec.tokenizer
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{spec.arch}")
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_block_count(spec.layers)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_layer_norm_rms_eps(spec.eps)
    w.add_rope_freq_base(spec.rope_theta)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    if spec.arch == "gemma3":
        w.add_sliding_window(spec.sliding_window)
    w.add_tokenizer_model(tok.kind)
    w.add_token_list(tok.tokens)
    w.add_token_types(tok.token_types)
    if tok.scores is not None:
        w.add_token_scores(tok.scores)
    if tok.merges is not None:
        w.add_token_merges(tok.merges)
    w.add_bos_token_id(tok.bos_id)
    w.add_eos_token_id(tok.eos_id)
    if tok.unk_id is not None:
        w.add_unk_token_id(tok.unk_id)
    w.add_add_bos_token(tok.add_bos)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
    for key, value in {**tok.extra, **(extra_kv or {})}.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)

    raw = raw or {}
    for name, a in weights.items():
        gname = gguf_name(name, spec.arch)
        if name in raw:
            data, qtype = raw[name]
            w.add_tensor(gname, data, raw_dtype=qtype)
            continue
        a = np.asarray(a, dtype=np.float32)
        if spec.arch == "llama" and permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            a = llama_cpp_permute(a, spec.heads if "q_proj" in name else spec.kv_heads)
        if spec.arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1.0
        if a.ndim == 1 or tensor_type == Q.F32:
            w.add_tensor(gname, a)
        elif tensor_type == Q.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, quants.quantize(a, tensor_type), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def tiny_gguf(path: Path, arch: str = "llama", tensor_type: Q = Q.F32, seed: int = 0, **spec_kwargs):
    """Shortcut: (path, spec, float32 HF-layout weights) of a freshly written tiny GGUF model."""
    spec = TinySpec(arch, **spec_kwargs)
    weights = random_weights(spec, seed)
    write_gguf(path, spec, weights, tensor_type)
    return Path(path), spec, weights


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `llama_cpp_permute` (GGUF row order -> HF row order)."""
    out = w.shape[0]
    hd = out // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(out, *w.shape[1:])
