// Rotary position embedding (RoPE, arXiv 2104.09864) as one MLX operation (a Primitive with eval_cpu),
// replacing mx.fast.rope, which MLX's CPU backend runs as 29 separate operations (arange, exp, cos, sin,
// broadcasts, slices, multiplies, a concatenate).
#pragma once

#include <optional>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// mx.fast.rope(x, dims, traditional=, base=, scale=, offset=, freqs=): x [B, ..., T, D] (ndim >= 3,
// float32 / float16 / bfloat16), position of row t of batch b = (t + offset[b]) * scale, offset int32
// scalar or [B]; the first `dims` features rotated by theta_i = position / freqs[i] (freqs [dims / 2]) or
// position * base^(-i / (dims / 2)) when freqs is absent; pairs (i, i + dims / 2), or (2i, 2i + 1) when
// traditional; the features past dims copied. Computed as MLX's own fallback: angles in float32, cos /
// sin rounded to x's dtype, products and sums in x's dtype. The result is row-contiguous.
// Throws std::invalid_argument on a bad dtype, ndim, dims (odd, <= 0 or > D), offset shape or dtype,
// freqs shape, or a GPU stream.
mx::array rope(const mx::array& x, const mx::array& offset, int dims, bool traditional, float base, float scale,
               const std::optional<mx::array>& freqs = std::nullopt, mx::StreamOrDevice s = {});

// Attention's heads from its input projections, RoPE applied, in one operation (it replaces 3 reshapes, 3
// transposes and 2 rope operations per layer): q [B, T, n_q * D], k [B, T, n_kv * D], v [B, T, n_kv * Dv]
// (one float dtype, any strides) -> [q [B, n_q, T, D], k [B, n_kv, T, D], v [B, n_kv, T, Dv]], row-contiguous,
// q and k rotated exactly as rope() rotates them (same arguments), v copied.
// Throws std::invalid_argument on dtypes, shapes, head counts or dims that do not agree, or a GPU stream.
std::vector<mx::array> rope_heads(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& offset,
                                  int n_q, int n_kv, int dims, bool traditional, float base, float scale,
                                  const std::optional<mx::array>& freqs = std::nullopt, mx::StreamOrDevice s = {});

// rope_heads of one packed projection qkv [B, T, (n_q + 2 n_kv) * D] (the q, k and v columns in that order, as
// one fused q / k / v product gives them; any strides): the same outputs as rope_heads of its three column
// ranges, without the operation that would split them.
std::vector<mx::array> rope_heads_packed(const mx::array& qkv, const mx::array& offset, int n_q, int n_kv, int dims,
                                         bool traditional, float base, float scale,
                                         const std::optional<mx::array>& freqs = std::nullopt,
                                         mx::StreamOrDevice s = {});

class RopeHeads : public mx::Primitive {
 public:
  // packed: inputs are {qkv, offset, inv_freq} (rope_heads_packed), else {q, k, v, offset, inv_freq}
  RopeHeads(mx::Stream stream, int n_q, int n_kv, int dims, bool traditional, float scale, bool packed = false)
      : mx::Primitive(stream), n_q_(n_q), n_kv_(n_kv), dims_(dims), traditional_(traditional), scale_(scale),
        packed_(packed) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferRopeHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int n_q_, n_kv_, dims_;
  bool traditional_;
  float scale_;
  bool packed_;
};

class Rope : public mx::Primitive {
 public:
  // (the base enters as the inv_freq input, not as a parameter)
  Rope(mx::Stream stream, int dims, bool traditional, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferRope"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

}  // namespace mlx_infer_kernels
