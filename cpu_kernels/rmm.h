// RMM's reduced quantized matmul (arXiv 2608.13426) as an MLX operation (a Primitive with eval_cpu).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T over the contraction groups each row keeps: per row m, group g
// (columns [g * group_size, (g + 1) * group_size)) scores sum_j |x[m, j]| in float32; g beats h when its
// score is larger, or equal and g < h; the row keeps the `keep` groups beaten by fewer than `keep` others.
// Operands as qmm's (qmm.h): x [M, K], w [N, K * bits / 32] uint32, scales / biases [N, K / group_size];
// y [M, N] in promote_types(x, scales), accumulated in float32. Only the groups some row keeps are read
// from w, scales and biases. Throws std::invalid_argument on bad operands or keep outside
// [1, K / group_size].
mx::array rmm_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int keep,
    mx::StreamOrDevice s = {});

class RmmQmm : public mx::Primitive {
 public:
  RmmQmm(mx::Stream stream, int group_size, int bits, int keep)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), keep_(keep) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferRmmQmm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  int keep_;
};

}  // namespace mlx_infer_kernels
