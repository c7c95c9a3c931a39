#include "swiglu.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_infer_kernels {
namespace {

// Values per chunk of the pool's parallel_for; fewer than two chunks run on the calling thread.
constexpr int64_t kSwigluChunk = 16384;

mx::array gated(const mx::array& gate, const mx::array& up, Gate kind, const char* op, mx::StreamOrDevice s) {
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("[") + op + "] gate and up must be float32");
  }
  if (gate.shape() != up.shape()) {
    throw std::invalid_argument(std::string("[") + op + "] gate and up must have one shape, got " +
                                shape_str(gate) + " and " + shape_str(up));
  }
  mx::Stream stream = cpu_stream(s);
  return mx::array(gate.shape(), mx::float32, std::make_shared<SwiGlu>(stream, kind), {gate, up});
}

}  // namespace

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, Gate::silu, "swiglu", s);
}

mx::array geglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, Gate::gelu_tanh, "geglu", s);
}

void SwiGlu::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& gate = inputs[0];
  const mx::array& up = inputs[1];
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(gate);
  encoder.set_input_array(up);
  encoder.set_output_array(out);
  encoder.dispatch([gate, up, out, kind = gate_]() mutable {
    std::vector<char> gate_copy, up_copy;  // row-major copies of inputs that are not
    const float* g = static_cast<const float*>(contiguous_data(gate, gate_copy));
    const float* u = static_cast<const float*>(contiguous_data(up, up_copy));
    float* y = out.data<float>();
    const int64_t n = int64_t(out.size());
    const QmmKernel& k = kernel();
    const auto values = kind == Gate::silu ? k.swiglu : k.geglu;
    ThreadPool& pool = ThreadPool::instance();
    const int chunks = int((n + kSwigluChunk - 1) / kSwigluChunk);
    if (chunks < 2 || pool.size() == 1) {
      values(g, u, y, n);
      return;
    }
    pool.parallel_for(chunks, [&](int c) {
      const int64_t i0 = c * kSwigluChunk;
      values(g + i0, u + i0, y + i0, std::min(n - i0, kSwigluChunk));
    });
  });
}

void SwiGlu::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[swiglu] the mlx-infer CPU kernels have no GPU implementation");
}

std::vector<mx::array> SwiGlu::vjp(const std::vector<mx::array>& primals, const std::vector<mx::array>& cotangents,
                                   const std::vector<int>& argnums, const std::vector<mx::array>&) {
  const mx::array& gate = primals[0];
  const mx::array& up = primals[1];
  const mx::array& cot = cotangents[0];
  const mx::Stream s = stream();
  const mx::array one = mx::array(1.0f);
  const mx::array g2 = mx::multiply(gate, gate, s);
  // the sigmoid's argument a and its derivative da / dgate
  const mx::array a = gate_ == Gate::silu ? gate : mx::multiply(gate, mx::add(mx::array(kGeluA), mx::multiply(mx::array(kGeluB), g2, s), s), s);
  const mx::array da = gate_ == Gate::silu ? one : mx::add(mx::array(kGeluA), mx::multiply(mx::array(3.0f * kGeluB), g2, s), s);
  const mx::array sig = mx::sigmoid(a, s);
  std::vector<mx::array> grads;
  for (int arg : argnums) {
    if (arg == 0) {  // d(gate * sig(a)) = sig + gate * sig (1 - sig) da
      const mx::array slope = mx::add(sig, mx::multiply(mx::multiply(gate, mx::multiply(sig, mx::subtract(one, sig, s), s), s), da, s), s);
      grads.push_back(mx::multiply(cot, mx::multiply(up, slope, s), s));
    } else {
      grads.push_back(mx::multiply(cot, mx::multiply(gate, sig, s), s));
    }
  }
  return grads;
}

std::vector<mx::Shape> SwiGlu::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

}  // namespace mlx_infer_kernels
