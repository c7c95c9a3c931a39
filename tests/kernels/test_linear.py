"""use_kernels(model): the swapped layers hold the same arrays and change the output only by float
rounding (and, on the bit widths an instruction set runs with int8 activations, by x's rounding to int8),
on a tiny quantized mlx-lm llama and on the default model (on the float32 body greedy decoding is
token-identical to the reference path; on the int8 path teacher-forced next tokens agree with it)."""

import os
import textwrap

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from qmm_helpers import run_in_variant

import mlx_infer
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.kernels.block import KernelDecoderBlock
from mlx_infer.kernels.linear import (WIDENED_BITS, KernelQuantizedEmbedding, KernelQuantizedLinear, use_kernels,
                                      widen_codes)
from mlx_infer.kernels.rms_norm import KernelRMSNorm
from mlx_infer.kernels.rope import KernelRoPEAttention
from mlx_infer.kv.attention_hook import attention, mlx_lm_attention
from mlx_infer.kv.attention_layer import CacheAttention

#: Greedy tokens compared per prompt on the default model.
GREEDY_TOKENS = 16
#: The int8 path against the reference: largest error of a tiny model's logits (fraction of their largest
#: magnitude; the kernel issue's 5%), and the least teacher-forced next-token agreement on the default model
#: (measured on an AVX-512 VNNI Xeon: 43 of the 48 positions of PROMPTS).
INT8_LOGIT_TOL = 0.05
INT8_MIN_AGREEMENT = 0.85
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


def tiny_llama(bits: int, group_size: int) -> nn.Module:
    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=320,
                           tie_word_embeddings=True)
    mx.random.seed(0)
    model = llama.Model(args)
    nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def quantized_layers(model: nn.Module) -> list:
    return [m for _, m in model.named_modules() if type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding)]


@pytest.mark.parametrize("bits,group_size", [(4, 32), (4, 64), (8, 128)])
def test_tiny_llama_output_unchanged(cpu_kernels, bits, group_size):
    model = tiny_llama(bits, group_size)
    layers = quantized_layers(model)
    assert len(layers) == 2 * 7 + 1  # q k v o gate up down per layer, and the tied embedding
    weights = {id(m["weight"]) for m in layers}
    ids = mx.array([[5, 17, 250, 3, 99, 42, 7, 1, 0, 311], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    ref_short, ref_long = model(ids[:, :3]), model(mx.concatenate([ids] * 2, axis=1))  # skinny, wide
    mx.eval(ref_short, ref_long)

    norms_and_ropes = [m for _, m in model.named_modules() if type(m) in (nn.RMSNorm, nn.RoPE)]
    assert len(norms_and_ropes) == 2 * 3 + 1  # 2 norms and a RoPE per layer, the final norm
    # and an MLP, an attention, the block per layer
    assert use_kernels(model) == len(layers) + len(norms_and_ropes) + 2 + 2 + 2
    assert [type(layer) for layer in model.layers] == [KernelDecoderBlock] * 2
    assert [type(layer.self_attn) for layer in model.layers] == [KernelRoPEAttention] * 2
    assert quantized_layers(model) == []
    assert [type(m) for _, m in model.named_modules() if isinstance(m, (nn.RMSNorm, nn.RoPE))].count(KernelRMSNorm) == 5
    swapped = [m for _, m in model.named_modules() if isinstance(m, (KernelQuantizedLinear, KernelQuantizedEmbedding))]
    assert len(swapped) == len(layers)
    fused = {id(m) for layer in model.layers for f in (layer.self_attn.qkv, layer.mlp.gate_up) for m in f.layers}
    assert len(fused) == 2 * 5  # q k v gate up per layer: views of their fused product's arrays (test_fused.py)
    assert {id(m["weight"]) for m in swapped if id(m) not in fused} < weights  # the others: no copies
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert use_kernels(model) == 0  # already swapped

    short, long = model(ids[:, :3]), model(mx.concatenate([ids] * 2, axis=1))
    int8 = bits in cpu_kernels.int8_bits()
    for got, ref in ((short, ref_short), (long, ref_long)):
        scale = mx.max(mx.abs(ref)).item()
        assert mx.max(mx.abs(got - ref)).item() <= (INT8_LOGIT_TOL if int8 else 1e-4) * scale
        if not int8:
            assert mx.array_equal(got.argmax(-1), ref.argmax(-1)).item()


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 6, 7])
@pytest.mark.parametrize("group_size", [32, 64])
def test_widen_codes_keeps_every_weight(bits, group_size):
    """Codes of any width re-stored as 8-bit codes dequantize to the very same weights (scales and biases
    unchanged), and every integer code survives (row 0 checked against its bit stream read by hand)."""
    if bits not in (2, 3, 4, 5, 6, 8):  # widths mx.quantize does not make: a random bit stream instead
        w = mx.random.randint(0, 2 ** 31, (12, 128 * bits // 32), key=mx.random.key(bits)).astype(mx.uint32)
        scales = mx.random.uniform(shape=(12, 128 // group_size), key=mx.random.key(7))
        biases = mx.zeros_like(scales)
    else:
        x = mx.random.normal((12, 128), key=mx.random.key(bits))
        w, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    wide = widen_codes(w, bits)
    assert wide.dtype == mx.uint32 and wide.shape == (12, 128 // 4)
    codes = mx.view(wide, mx.uint8).reshape(12, 128)  # [N, K]: code j in byte j
    assert mx.max(codes).item() < 2 ** bits
    if bits in (2, 3, 5, 6):
        assert mx.array_equal(mx.dequantize(wide, scales, biases, group_size=group_size, bits=8),
                              mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)).item()
    # the bit stream read back by hand: value j in bits [bits * j, bits * (j + 1)) of the little-endian words
    stream = int.from_bytes(bytes(mx.view(w[0], mx.uint8).tolist()), "little")
    assert codes[0].tolist() == [(stream >> (bits * j)) & (2 ** bits - 1) for j in range(128)]
    with pytest.raises(ValueError, match="widen"):
        widen_codes(w, 9)


@pytest.mark.parametrize("bits", WIDENED_BITS)
def test_tiny_llama_widened_layers(cpu_kernels, bits):
    """A model quantized at a width the kernels do not take runs on them with its codes widened to 8 bits:
    every quantized layer swapped, at 8 bits, and the logits equal MLX's own quantized matmul's up to float
    rounding (int8 rounding of x where 8-bit products run on int8 activations), greedy the same."""
    model = tiny_llama(bits, 32)
    ids = mx.array([[5, 17, 250, 3, 99, 42, 7, 1, 0, 311]])
    refs = [model(ids[:, :3]), model(mx.concatenate([ids] * 4, axis=1))]  # skinny, wide
    mx.eval(refs)
    use_kernels(model)
    assert quantized_layers(model) == []
    swapped = [m for _, m in model.named_modules() if isinstance(m, (KernelQuantizedLinear, KernelQuantizedEmbedding))]
    assert len(swapped) == 2 * 7 + 1 and {m.bits for m in swapped} == {8}
    int8 = 8 in cpu_kernels.int8_bits()
    for got, ref in zip([model(ids[:, :3]), model(mx.concatenate([ids] * 4, axis=1))], refs):
        scale = mx.max(mx.abs(ref)).item()
        assert mx.max(mx.abs(got - ref)).item() <= (INT8_LOGIT_TOL if int8 else 1e-4) * scale
        if not int8:
            assert mx.array_equal(got.argmax(-1), ref.argmax(-1)).item()


def test_rope_attention_equals_mlx_lm_block(cpu_kernels, monkeypatch):
    """The default model's attention blocks run as KernelRoPEAttention in KernelDecoderBlocks (q / k / v as
    one packed product split into heads by one operation, the residual adds inside o_proj's and down_proj's
    products); its logits over a prefill, a 3-token verify and a decode step equal, bit for bit, those of
    mlx-lm's own block forward with its own adds, of the project's CacheAttention on an mlx-lm attention block
    holding the same modules, and, both attending through mlx-lm's own function, of that mlx-lm block."""
    engine = mlx_infer.load(weights="native")
    model = engine.model
    assert {type(layer.self_attn) for layer in model.layers} == {KernelRoPEAttention}
    assert {type(layer) for layer in model.layers} == {KernelDecoderBlock}
    ids = engine.encode("The quick brown fox jumps over the lazy dog. Once upon a time")

    def forwards() -> list:
        cache = make_prompt_cache(model)
        outs = [model(mx.array([ids[:-3]]), cache=cache), model(mx.array([ids[-3:]]), cache=cache),
                model(mx.array([[5]]), cache=cache)]
        mx.eval(outs)
        return outs

    fused = forwards()
    with monkeypatch.context() as patch:  # mlx-lm's block forward on the same modules: its two adds of its own
        patch.setattr(KernelDecoderBlock, "__call__", llama.TransformerBlock.__call__)
        for got, want in zip(fused, forwards()):
            assert mx.array_equal(got, want).item()
    kernel_attns, blocks = [layer.self_attn for layer in model.layers], []
    for attn in kernel_attns:
        block = llama.Attention(model.args)
        block.q_proj, block.k_proj, block.v_proj, block.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        block.rope = attn.rope
        blocks.append(block)
    for layer, block in zip(model.layers, blocks):
        layer.self_attn = CacheAttention(block, attention)
    for got, want in zip(fused, forwards()):
        assert mx.array_equal(got, want).item()
    for layer, attn in zip(model.layers, kernel_attns):
        layer.self_attn = KernelRoPEAttention(attn, attend=mlx_lm_attention)
    fused = forwards()
    for layer, block in zip(model.layers, blocks):
        layer.self_attn = block
    for got, want in zip(fused, forwards()):
        assert mx.array_equal(got, want).item()


def test_layer_with_bias_and_unsupported_modes(cpu_kernels):
    layer = nn.QuantizedLinear(64, 40, bias=True, group_size=32, bits=4)
    layer.bias = mx.arange(40, dtype=mx.float32)
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    ref = layer(x)
    got = KernelQuantizedLinear(layer)(x)
    if 4 in cpu_kernels.int8_bits():
        assert mx.max(mx.abs(got - ref)).item() <= INT8_LOGIT_TOL * mx.max(mx.abs(ref)).item()
    else:
        assert mx.allclose(got, ref, rtol=1e-5, atol=1e-4).item()
    with pytest.raises(ValueError, match="affine"):
        KernelQuantizedLinear(nn.QuantizedLinear(64, 40, mode="mxfp4"))


def reference_engine(cpu_kernels):
    """The default model on MLX's own quantized matmul (MLX_INFER_KERNELS=off for its loading)."""
    os.environ["MLX_INFER_KERNELS"] = "off"
    cpu_kernels.refresh()
    try:
        reference = mlx_infer.load(weights="native")
    finally:
        del os.environ["MLX_INFER_KERNELS"]
        cpu_kernels.refresh()
    assert reference.source.kernels is None
    return reference


def check_default_model(cpu_kernels) -> None:
    """The real Q4_1 GGUF model (group 32, 4 bits; its tied lm_head at 8 bits), loaded as users get it: its
    quantized layers run on the kernels. Its greedy tokens equal those of MLX's own quantized matmul where
    every product is float32; with int8 activations, teacher-forced on the reference's greedy tokens (one
    token per forward: the int8 path), its next-token argmax agrees with the reference's at >= 85% of the
    positions."""
    engine = mlx_infer.load(weights="native")
    assert engine.source.kernels == f"cpu-{cpu_kernels.isa()}"
    kinds = (KernelQuantizedLinear, KernelQuantizedEmbedding)
    swapped = [m for _, m in engine.model.named_modules() if isinstance(m, kinds)]
    assert len(swapped) == 211  # 30 layers x 7 linears + the tied embedding
    reference = reference_engine(cpu_kernels)
    params = SamplingParams(temperature=0.0)
    agree = total = 0
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        ref = list(plain_tokens(reference.model, ids, params, GREEDY_TOKENS))
        if not cpu_kernels.int8_bits():
            assert list(plain_tokens(engine.model, ids, params, GREEDY_TOKENS)) == ref, prompt
            continue
        caches = [make_prompt_cache(reference.model), make_prompt_cache(engine.model)]
        prefill = mx.array([ids[:-1]])
        for model, cache in zip((reference.model, engine.model), caches):
            mx.eval(model(prefill, cache=cache))
        for token in [ids[-1]] + ref[:-1]:
            step = [model(mx.array([[token]]), cache=cache)[0, -1].argmax().item()
                    for model, cache in zip((reference.model, engine.model), caches)]
            agree += step[0] == step[1]
            total += 1
    if total:
        assert agree / total >= INT8_MIN_AGREEMENT, f"{agree} of {total}"


def test_default_model_greedy_identical(cpu_kernels):
    """On the variant this machine picks (float32 products): greedy tokens equal the reference's."""
    check_default_model(cpu_kernels)


#: In a fresh process on an int8-activation variant: check_default_model's agreement check.
INT8_AGREEMENT = textwrap.dedent("""
    import sys
    import mlx_infer
    from mlx_infer.kernels import cpu
    sys.path.insert(0, sys.argv[1])
    from test_linear import check_default_model
    assert cpu.isa() == sys.argv[2] and cpu.int8_bits(), cpu.isa()
    check_default_model(cpu)
""")


@pytest.mark.parametrize("variant", ["avx512vnni", "avx2int8"])
def test_default_model_on_int8_activations(cpu_kernels, variant, tmp_path):
    """The int8-activation variants: teacher-forced next tokens agree with the reference path."""
    run_in_variant(INT8_AGREEMENT, variant, tmp_path)
