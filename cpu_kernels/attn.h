// Attention over a quantized KV cache, and over a float paged KV pool, as MLX operations (Primitives with
// eval_cpu).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// {out [H, R, Dv], lse [H, R]} float32: out = softmax(scale * q k^T) v per KV head h over the first
// `length` tokens of a quantized cache, query row r seeing keys s <= length - positions + r % positions,
// and lse the log of the softmax's denominator (log sum_s exp(scale * q k_s)), to merge with other keys.
// q [H, R, D] float32/float16/bfloat16; k [H, C, D * k_bits / 32] uint32 and k_scales, k_biases
// [H, C, D / group_size] (MLX's affine layout, one row per token) or, with channel_keys (KIVI), k
// [H, D, C * k_bits / 32] and k_scales, k_biases [H, D, C / group_size] (each channel quantized along
// tokens); v per token like k, with v_bits and Dv; length <= C. bits 4 or 8, group_size 32, 64 or 128,
// D and Dv multiples of 32.
// Throws std::invalid_argument on other shapes or dtypes, or a stream that is not on the CPU.
std::vector<mx::array> quant_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v,
    const mx::array& v_scales,
    const mx::array& v_biases,
    int length,
    float scale,
    int positions,
    int group_size,
    int k_bits,
    int v_bits,
    bool channel_keys,
    mx::StreamOrDevice s = {});

class QuantAttention : public mx::Primitive {
 public:
  QuantAttention(mx::Stream stream, int length, float scale, int positions, int group_size, int k_bits,
                 int v_bits, bool channel_keys)
      : mx::Primitive(stream), length_(length), scale_(scale), positions_(positions),
        group_size_(group_size), k_bits_(k_bits), v_bits_(v_bits), channel_keys_(channel_keys) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferQuantAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int length_;
  float scale_;
  int positions_;
  int group_size_;
  int k_bits_;
  int v_bits_;
  bool channel_keys_;
};

// out [B, n_q, L, Dv] in q's dtype (accumulated in float32): softmax(scale * q k^T) v of each request b over
// its live tokens in a paged pool, read through the token table's rows (no gather). q [B, n_q, L, D]
// float32/float16/bfloat16; k_pool [rows, D] and v_pool [rows, Dv] one dtype (float32/float16/bfloat16;
// any leading dims, the same for both, taken together as the rows: [B, n_kv, capacity, D] is B * n_kv *
// capacity rows),
// D and Dv multiples of 16; index int32 [B, n_kv, S] the pool rows of request b's live tokens for KV head
// h (n_q a multiple of n_kv: query head g reads KV head g / (n_q / n_kv)), its first lengths[b] (int32 [B])
// entries used; q_pos int32 [B, L], k_pos int32 [B, S] original positions: query l sees key t iff
// k_pos[b, t] <= q_pos[b, l] and, with window > 0, q_pos[b, l] - k_pos[b, t] < window. An index outside
// [0, rows) is a key nobody sees; a query that sees no key gets zeros.
// Throws std::invalid_argument on other shapes or dtypes, window < 0, or a stream that is not on the CPU.
mx::array paged_attention(
    const mx::array& q,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& index,
    const mx::array& lengths,
    const mx::array& q_pos,
    const mx::array& k_pos,
    float scale,
    int window,
    mx::StreamOrDevice s = {});

// paged_attention over a pool of quantized blocks: k [rows, D * k_bits / 32] uint32 codes with k_scales,
// k_biases [rows, D / group_size] (MLX's affine layout, one row per (head, slot)), v likewise with v_bits
// and Dv; scales and biases one dtype (float32/float16/bfloat16). bits 4 or 8, group_size 32, 64 or 128, D
// and Dv multiples of 32 and of group_size. Each row is dequantized into the kernel's tile scratch as it is
// read through the index; otherwise as paged_attention.
// Throws std::invalid_argument on other shapes, dtypes, bits or group sizes, as paged_attention otherwise.
mx::array paged_quant_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v,
    const mx::array& v_scales,
    const mx::array& v_biases,
    const mx::array& index,
    const mx::array& lengths,
    const mx::array& q_pos,
    const mx::array& k_pos,
    float scale,
    int group_size,
    int window,
    mx::StreamOrDevice s = {});

// Inputs: q, k_pool, v_pool, index, lengths, q_pos, k_pos (float blocks: k_bits 0), or q, k, k_scales,
// k_biases, v, v_scales, v_biases, index, lengths, q_pos, k_pos (quantized blocks).
class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, float scale, int window, int group_size = 0, int k_bits = 0, int v_bits = 0)
      : mx::Primitive(stream), scale_(scale), window_(window), group_size_(group_size), k_bits_(k_bits),
        v_bits_(v_bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferPagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int window_;
  int group_size_;
  int k_bits_;
  int v_bits_;
};

}  // namespace mlx_infer_kernels
