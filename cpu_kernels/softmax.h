// The causal softmax of a prefill tile's attention scores as an MLX operation (a Primitive with eval_cpu).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// y [..., R, S] float32: the softmax of scale * x over the keys each row sees, 0 for the others. Row r of
// each matrix is query position q0 + r % period (the tile's `period` queries, repeated for the heads of a
// GQA group); it sees key j iff j <= its position and, with window > 0, j > position - window. x
// [..., R, S] float32 (ndim >= 2); its buffer is reused for y when it can be donated.
// Throws std::invalid_argument on another dtype or ndim, period < 1, q0 < 0, window < 0, scale <= 0, or a
// stream that is not on the CPU.
mx::array causal_softmax(const mx::array& x, float scale, int period, int q0, int window,
                         mx::StreamOrDevice s = {});

class CausalSoftmax : public mx::Primitive {
 public:
  CausalSoftmax(mx::Stream stream, float scale, int period, int q0, int window)
      : mx::Primitive(stream), scale_(scale), period_(period), q0_(q0), window_(window) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferCausalSoftmax"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  int period_;
  int q0_;
  int window_;
};

}  // namespace mlx_infer_kernels
