// SwiGLU's gate, silu(gate) * up, and GeGLU's with GELU's tanh approximation, gelu_approx(gate) * up, each
// as one MLX operation (a Primitive with eval_cpu). mlx-lm's `swiglu` and mlx's `gelu_approx` are
// mx.compile'd operations that MLX's CPU backend runs through a generated kernel whose exp / tanh is
// scalar: about 37 us for the default model's 1536 values of one token, 230 us for 9 tokens (swiglu); 42 us
// for Gemma-3-270M's 2048 values, 405 us for 9 tokens (gelu_approx and the product).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// y = gate * sigmoid(gate) * up, sigmoid(g) = 1 / (1 + e^-g), in float32 with the vector e^x of the
// variant in use (within 2 ulp). gate and up: float32 of one shape (any strides). Throws
// std::invalid_argument on another dtype, differing shapes or a GPU stream.
mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// y = gelu_approx(gate) * up, gelu_approx(g) = 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), computed
// as g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3)) (the same function) with the vector e^x; float32,
// arguments and errors as swiglu.
mx::array geglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});

// swiglu / geglu of one packed product gu [..., 2F] (gate in features [0, F), up in [F, 2F), as one fused gate /
// up product gives them; any strides) -> y [..., F]: the same values, without the operation that would split
// gu. Throws std::invalid_argument on another dtype, an odd last axis or a GPU stream.
mx::array swiglu_packed(const mx::array& gu, mx::StreamOrDevice s = {});
mx::array geglu_packed(const mx::array& gu, mx::StreamOrDevice s = {});

// Which gate a GatedUnit computes.
enum class Gate : int { silu = 0, gelu_tanh = 1 };

class SwiGlu : public mx::Primitive {
 public:
  // packed: one input gu [..., 2F] (swiglu_packed), else gate and up
  SwiGlu(mx::Stream stream, Gate gate = Gate::silu, bool packed = false)
      : mx::Primitive(stream), gate_(gate), packed_(packed) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return gate_ == Gate::silu ? "MlxInferSwiGlu" : "MlxInferGeGlu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const SwiGlu&>(other);
    return o.gate_ == gate_ && o.packed_ == packed_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
  // silu: d/dgate = cot * up * s * (1 + gate * (1 - s)), d/dup = cot * gate * s, s = sigmoid(gate);
  // gelu_tanh: a = gate * (A + B gate^2), s = sigmoid(a), d/dgate = cot * up * (s + gate * s (1 - s) *
  // (A + 3 B gate^2)), d/dup = cot * gate * s; as MLX ops (training a drafter whose MLP runs this operation).
  // Packed: the two gradients concatenated along the last axis.
  std::vector<mx::array> vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                             const std::vector<int>& argnums, const std::vector<mx::array>& outputs) override;

 private:
  Gate gate_;
  bool packed_;
};

}  // namespace mlx_infer_kernels
