"""On the int8-activation variants x's rounding turns a last-bit difference in an activation into a whole
rounding step, so every path must give a request's rows the same bits: the default model's logits after a
prompt prefilled whole, in chunks (across the decode kernel's 16-position blocks) or token by token are
equal bit for bit, and greedy answers batched on the paged cache equal each request alone on the dense
one (run in a fresh process per variant: the variant is chosen once per process)."""

import textwrap

import pytest
from qmm_helpers import run_in_variant

INVARIANCE = textwrap.dedent("""
    import sys
    import mlx_infer
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_infer.kernels import cpu
    assert cpu.isa() == sys.argv[2] and cpu.int8_activations(), cpu.isa()
    dense = mlx_infer.load(weights="native")
    model = dense.model
    ids = dense.encode("Write a haiku about the sea, then explain in detail what a haiku is and why it has "
                       "three lines, and give two more examples about mountains and rivers.")
    assert len(ids) > 40, len(ids)

    def last_logits(chunks):
        cache = make_prompt_cache(model)
        for chunk in chunks:
            out = model(mx.array([chunk]), cache=cache)
        return out[0, -1]  # [V]

    whole = last_logits([ids])
    for chunks in ([ids[:10], ids[10:]], [ids[:17], ids[17:40], ids[40:]], [[t] for t in ids]):
        got = last_logits(chunks)
        assert mx.array_equal(got, whole).item(), ([len(c) for c in chunks], mx.max(mx.abs(got - whole)).item())

    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
               "Explain what a CPU does in one sentence."]
    alone = [dense.generate(p, max_tokens=16).token_ids for p in prompts]
    paged = mlx_infer.load(weights="native", kv_cache="paged")
    assert [r.token_ids for r in paged.generate_batch(prompts, max_tokens=16)] == alone
""")


@pytest.mark.parametrize("variant", ["avx512vnni", "avx2int8"])
def test_rows_do_not_depend_on_chunking_batching_or_layout(cpu_kernels, variant, tmp_path):
    run_in_variant(INVARIANCE, variant, tmp_path)
