// The quantized skinny matmul as MLX operations (Primitives with eval_cpu).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// y = x @ dequantize(w, scales, biases).T, MLX's affine layout (as mx::quantized_matmul with
// transpose=true): x [..., K] float32/float16/bfloat16 (any strides; its leading axes are the M rows),
// w [N, K * bits / 32] uint32, scales and biases [N, K / group_size] float32/float16/bfloat16 (one
// dtype, usually x's); y [..., N]
// in promote_types(x, scales) (x's dtype when they match), accumulated in float32.
// Each weight group is read once for all M rows. bits 4 or 8, group_size 32, 64 or 128.
// With `residual` (float32, y's shape, y float32): y = residual + the product, each sum rounded once to
// float32 as a separate mx::add of the two would round it (a decoder block's residual connection
// without an operation of its own).
// Throws std::invalid_argument on other shapes or dtypes, or a stream that is not on the CPU.
mx::array qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    const std::optional<mx::array>& residual = std::nullopt,
    mx::StreamOrDevice s = {});

// The instruction set the kernels run with: "avx512", "avx2", "neon" or "generic".
std::string isa();
// The weight bit widths whose products run on the variant's int8-activation path (QmmQ8Kernel).
std::vector<int> int8_bits();
// The int8-activation variants this CPU can run ("avx512vnni", "avx2int8"; best first), whichever runs now.
std::vector<std::string> int8_variants();

// Threads the kernels split a product over (the caller included).
int num_threads();

class Qmm : public mx::Primitive {
 public:
  Qmm(mx::Stream stream, int group_size, int bits, bool residual = false)
      : mx::Primitive(stream), group_size_(group_size), bits_(bits), residual_(residual) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferQmm"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_;
  int bits_;
  bool residual_;  // inputs[4]: added to the product
};

}  // namespace mlx_infer_kernels
