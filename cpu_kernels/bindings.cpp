// Python bindings (nanobind, in MLX's "mlx" domain so that mx.array passes through unchanged).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "attn.h"
#include "move.h"
#include "qmm.h"
#include "rms_norm.h"
#include "rmm.h"
#include "rope.h"
#include "softmax.h"
#include "swiglu.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "mlx-infer's CPU kernels (see mlx_infer/kernels/cpu.py)";
  m.def("qmm", &mlx_infer_kernels::qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "residual"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "y [..., N] = [residual +] x [..., K] @ dequantize(w, scales, biases).T, accumulated in float32.");
  m.def("quant_attention", &mlx_infer_kernels::quant_attention, "q"_a, "k"_a, "k_scales"_a, "k_biases"_a, "v"_a,
        "v_scales"_a, "v_biases"_a, "length"_a, "scale"_a, "positions"_a, "group_size"_a, "k_bits"_a, "v_bits"_a,
        "channel_keys"_a = false, nb::kw_only(), "stream"_a = nb::none(),
        "[out [H, R, Dv], lse [H, R]] float32: attention of q [H, R, D] over a quantized KV cache (see attn.h).");
  m.def("paged_attention", &mlx_infer_kernels::paged_attention, "q"_a, "k_pool"_a, "v_pool"_a, "index"_a,
        "lengths"_a, "q_pos"_a, "k_pos"_a, "scale"_a, "window"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        "out [B, n_q, L, Dv] in q's dtype: attention of q [B, n_q, L, D] over a float paged KV pool read "
        "through the token table's rows (see attn.h).");
  m.def("paged_quant_attention", &mlx_infer_kernels::paged_quant_attention, "q"_a, "k"_a, "k_scales"_a, "k_biases"_a,
        "v"_a, "v_scales"_a, "v_biases"_a, "index"_a, "lengths"_a, "q_pos"_a, "k_pos"_a, "scale"_a, "group_size"_a,
        "window"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        "out [B, n_q, L, Dv] in q's dtype: attention of q [B, n_q, L, D] over a paged KV pool of quantized "
        "blocks, each row dequantized as the kernel reads it through the token table's rows (see attn.h).");
  m.def("rmm_qmm", &mlx_infer_kernels::rmm_qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        "keep"_a, nb::kw_only(), "stream"_a = nb::none(),
        "y [M, N]: x [M, K] @ dequantize(w).T over the `keep` groups each row keeps (RMM, see rmm.h).");
  m.def("causal_softmax", &mlx_infer_kernels::causal_softmax, "x"_a, "scale"_a, "period"_a, "q0"_a,
        "window"_a = 0, nb::kw_only(), "stream"_a = nb::none(),
        "y [..., R, S] float32: the causal softmax of scale * x for a prefill tile (see softmax.h).");
  m.def("move_rows", &mlx_infer_kernels::move_rows, "a"_a, "src"_a, "dst"_a, nb::kw_only(), "stream"_a = nb::none(),
        "a [R, W] with row dst[i] replaced by row src[i] (int32 [M]), in place when MLX can donate a's buffer "
        "(see move.h).");
  m.def("write_rows", &mlx_infer_kernels::write_rows, "a"_a, "x"_a, "dst"_a, nb::kw_only(), "stream"_a = nb::none(),
        "a [R, W] with row dst[i] replaced by row i of x [..., W], in place when MLX can donate a's buffer "
        "(see move.h).");
  m.def("rms_norm", &mlx_infer_kernels::rms_norm, "x"_a, "weight"_a, "eps"_a, nb::kw_only(), "stream"_a = nb::none(),
        "y [..., D] = x / sqrt(mean(x^2) + eps) * weight, as mx.fast.rms_norm (see rms_norm.h).");
  m.def("rope", &mlx_infer_kernels::rope, "x"_a, "offset"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a,
        "freqs"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "mx.fast.rope of x [B, ..., T, D] at positions (t + offset) * scale (see rope.h).");
  m.def("rope_heads", &mlx_infer_kernels::rope_heads, "q"_a, "k"_a, "v"_a, "offset"_a, "n_q"_a, "n_kv"_a, "dims"_a,
        "traditional"_a, "base"_a, "scale"_a, "freqs"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "[q [B, n_q, T, D], k [B, n_kv, T, D], v [B, n_kv, T, Dv]]: attention's heads from q [B, T, n_q * D], "
        "k, v, with q and k rotated as rope() rotates them (see rope.h).");
  m.def("rope_heads_packed", &mlx_infer_kernels::rope_heads_packed, "qkv"_a, "offset"_a, "n_q"_a, "n_kv"_a, "dims"_a,
        "traditional"_a, "base"_a, "scale"_a, "freqs"_a = nb::none(), nb::kw_only(), "stream"_a = nb::none(),
        "rope_heads of one packed projection qkv [B, T, (n_q + 2 n_kv) * D] (see rope.h).");
  m.def("swiglu", &mlx_infer_kernels::swiglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "y = gate * sigmoid(gate) * up, float32 (SwiGLU's gate, see swiglu.h).");
  m.def("geglu", &mlx_infer_kernels::geglu, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "y = gelu_approx(gate) * up, float32 (GeGLU's gate with GELU's tanh approximation, see swiglu.h).");
  m.def("swiglu_packed", &mlx_infer_kernels::swiglu_packed, "gu"_a, nb::kw_only(), "stream"_a = nb::none(),
        "swiglu of gu [..., 2F] (gate, then up), float32 -> [..., F] (see swiglu.h).");
  m.def("geglu_packed", &mlx_infer_kernels::geglu_packed, "gu"_a, nb::kw_only(), "stream"_a = nb::none(),
        "geglu of gu [..., 2F] (gate, then up), float32 -> [..., F] (see swiglu.h).");
  m.def("isa", &mlx_infer_kernels::isa, "The instruction set in use: avx512, avx2, neon or generic.");
  m.def("int8_bits", &mlx_infer_kernels::int8_bits,
        "The weight bit widths whose products round x to int8 in chunks of 32 (empty: all in float32).");
  m.def("int8_variants", &mlx_infer_kernels::int8_variants,
        "The int8-activation variants this CPU can run (MLX_INFER_KERNEL_ISA values), best first.");
  m.def("num_threads", &mlx_infer_kernels::num_threads, "Threads a product is split over.");
}
