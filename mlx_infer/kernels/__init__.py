"""The kernel layer: one small module per kernel, each picking Metal, CUDA, CPU or the pure-mx reference
by the default device and what is available.

- `qmm`: the quantized skinny matmul (`qmm.qmm`, `qmm.qmm_backend`), and `linear.use_kernels(model)`,
  which swaps a loaded model's quantized layers for ones that use it.
- `cpu`: the CPU kernels (an MLX C++ extension built on first use; `cpu.available()`, `cpu.why_not()`).
- `gpu_qmm`: the Metal body and its CUDA twin.
- `attention`: attention over a quantized KV cache (`attention.quant_attention`, `attention.attention_backend`),
  on the CPU kernel, the GPU body of `gpu_attention` or the pure-mx reference.
- `paged_attention`: attention over a float paged KV pool read in place through the token table's rows
  (`paged_attention.paged_attention`, `paged_attention.paged_attention_backend`), on the CPU kernel or the
  pure-mx reference (gather + masked softmax); batched decode steps use it (kv/batch.py).
- `move_rows`: the repacker's row moves inside a pool array (`move_rows.move_rows`), in place on the CPU
  kernel, a gather + scatter (a whole copy) elsewhere; and a batched step's write of its new K / V rows
  (`move_rows.write_rows`), one operation per pool plane on the CPU kernel.
- `rms_norm`, `rope`: RMSNorm and RoPE as one operation each on the CPU kernel (`KernelRMSNorm`,
  `KernelRoPE`, swapped in by `linear.use_kernels`); MLX's CPU backend runs mx.fast's as 11 and 29. And
  `rope.rope_heads`: attention's heads split and rotated as one operation (`KernelRoPEAttention`, swapped in
  for mlx-lm's llama / qwen2 attention blocks).
- `swiglu`: SwiGLU's gate, silu(gate) * up, and GeGLU's, gelu_approx(gate) * up, as one operation each on
  the CPU kernel (`KernelGatedMLP`, swapped in by `linear.use_kernels` for mlx-lm's
  llama / qwen2 / qwen3 and gemma2 / gemma3 MLPs).
- `fused`: projections of one input (q / k / v, gate / up) as one quantized product (`FusedLinear`, made by
  `linear.use_kernels` for the attention and MLP twins; the layers keep views of its arrays), whose packed
  output `rope.rope_heads_packed` and `swiglu.gated_packed` take without a split.
- `quantized`: the kernel layers (`KernelQuantizedLinear`, `KernelQuantizedEmbedding`) and `linear_add`, a
  layer's product with a residual added in the same operation (`qmm(..., residual=)`).
- `block`: mlx-lm's llama / qwen2 decoder block with its two residual adds inside o_proj's and down_proj's
  products (`KernelDecoderBlock`, swapped in by `linear.use_kernels`).
- `selfcheck`: every custom kernel the model would use, run on this device against the pure-mx reference and
  timed against MLX's own op (`mlx-infer doctor --kernels`), cached; on Metal / CUDA a kernel runs only
  where it passed and was faster (`switch`: the decisions).
- `rmm`: RMM's reduced quantized matmul (`rmm.rmm_qmm`: per row, only the kept quantization groups), on the
  CPU kernel, the GPU body of `gpu_rmm` or the pure-mx reference.
"""
