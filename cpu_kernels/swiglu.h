// SwiGLU's gate, silu(gate) * up, as one MLX operation (a Primitive with eval_cpu). mlx-lm's `swiglu` is an
// mx.compile'd pair of operations that MLX's CPU backend runs through a generated kernel whose exp is
// scalar: about 37 us for the default model's 1536 values of one token, 230 us for 9 tokens.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// y = gate * sigmoid(gate) * up, sigmoid(g) = 1 / (1 + e^-g), in float32 with the vector e^x of the
// variant in use (within 2 ulp). gate and up: float32 of one shape (any strides). Throws
// std::invalid_argument on another dtype, differing shapes or a GPU stream.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

class SwiGlu : public mx::Primitive {
 public:
  explicit SwiGlu(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferSwiGlu"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // d/dgate = cot * up * s * (1 + gate * (1 - s)), d/dup = cot * gate * s, s = sigmoid(gate), as MLX ops
  // (training a drafter whose MLP runs this operation).
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;
};

}  // namespace mlx_infer_kernels
