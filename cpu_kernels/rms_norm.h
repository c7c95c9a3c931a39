// RMSNorm as one MLX operation (a Primitive with eval_cpu), replacing mx.fast.rms_norm, which MLX's CPU
// backend runs as 11 separate operations (square, sum, rsqrt, broadcasts, multiplies).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// y [..., D] = x / sqrt(mean(x^2) + eps) * weight, as mx.fast.rms_norm computes it: x read as float32,
// the normalized row rounded to the output dtype (the promotion of x's and weight's), then multiplied by
// the weight in that dtype. x [..., D] (ndim >= 1, any strides), weight [D]; float32 / float16 / bfloat16.
// Throws std::invalid_argument on another dtype, a weight that is not [D], eps < 0 or a GPU stream.
mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s = {});

class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::Primitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float eps_;
};

}  // namespace mlx_infer_kernels
