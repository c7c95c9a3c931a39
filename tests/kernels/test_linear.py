"""use_kernels(model): the swapped layers hold the same arrays and change the output only by float
rounding, on a tiny quantized mlx-lm llama and on the default model (greedy decoding token-identical to
the reference path)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

import mlx_infer
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.kernels.linear import KernelQuantizedEmbedding, KernelQuantizedLinear, use_kernels
from mlx_infer.kernels.rms_norm import KernelRMSNorm

#: Greedy tokens compared per prompt on the default model.
GREEDY_TOKENS = 16
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
    assert use_kernels(model) == len(layers) + len(norms_and_ropes) + 2  # and an MLP per layer
    assert quantized_layers(model) == []
    assert [type(m) for _, m in model.named_modules() if isinstance(m, (nn.RMSNorm, nn.RoPE))].count(KernelRMSNorm) == 5
    swapped = [m for _, m in model.named_modules() if isinstance(m, (KernelQuantizedLinear, KernelQuantizedEmbedding))]
    assert len(swapped) == len(layers) and {id(m["weight"]) for m in swapped} == weights  # no copies
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert use_kernels(model) == 0  # already swapped

    short, long = model(ids[:, :3]), model(mx.concatenate([ids] * 2, axis=1))
    for got, ref in ((short, ref_short), (long, ref_long)):
        scale = mx.max(mx.abs(ref)).item()
        assert mx.max(mx.abs(got - ref)).item() <= 1e-4 * scale
        assert mx.array_equal(got.argmax(-1), ref.argmax(-1)).item()


def test_layer_with_bias_and_unsupported_modes(cpu_kernels):
    layer = nn.QuantizedLinear(64, 40, bias=True, group_size=32, bits=4)
    layer.bias = mx.arange(40, dtype=mx.float32)
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    ref = layer(x)
    got = KernelQuantizedLinear(layer)(x)
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-4).item()
    with pytest.raises(ValueError, match="affine"):
        KernelQuantizedLinear(nn.QuantizedLinear(64, 40, mode="mxfp4"))


def test_default_model_greedy_identical(cpu_kernels, monkeypatch):
    """The real Q4_1 GGUF model (group 32, 4 bits; its tied lm_head at 8 bits), loaded as users get it: its
    quantized layers run on the kernels, and its greedy tokens equal those of MLX's own quantized matmul
    (MLX_INFER_KERNELS=off), prompt prefill included (the wide path)."""
    engine = mlx_infer.load(weights="native")
    assert engine.source.kernels == f"cpu-{cpu_kernels.isa()}"
    kinds = (KernelQuantizedLinear, KernelQuantizedEmbedding)
    swapped = [m for _, m in engine.model.named_modules() if isinstance(m, kinds)]
    assert len(swapped) == 211  # 30 layers x 7 linears + the tied embedding
    monkeypatch.setenv("MLX_INFER_KERNELS", "off")
    cpu_kernels.refresh()
    try:
        reference = mlx_infer.load(weights="native")
    finally:
        monkeypatch.delenv("MLX_INFER_KERNELS")
        cpu_kernels.refresh()
    assert reference.source.kernels is None
    params = SamplingParams(temperature=0.0)
    for prompt in PROMPTS:
        ids = reference.encode(prompt)
        ref = list(plain_tokens(reference.model, ids, params, GREEDY_TOKENS))
        got = list(plain_tokens(engine.model, ids, params, GREEDY_TOKENS))
        assert got == ref, prompt
