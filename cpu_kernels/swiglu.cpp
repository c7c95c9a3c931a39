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

mx::array gated_packed(const mx::array& gu, Gate kind, const char* op, mx::StreamOrDevice s) {
  if (gu.dtype() != mx::float32 || gu.ndim() < 1 || gu.shape(-1) % 2 != 0) {
    throw std::invalid_argument(std::string("[") + op + "] gu must be float32 [..., 2F], got " + shape_str(gu));
  }
  mx::Shape shape = gu.shape();
  shape.back() /= 2;
  mx::Stream stream = cpu_stream(s);
  return mx::array(std::move(shape), mx::float32, std::make_shared<SwiGlu>(stream, kind, true), {gu});
}

}  // namespace

mx::array swiglu_packed(const mx::array& gu, mx::StreamOrDevice s) {
  return gated_packed(gu, Gate::silu, "swiglu", s);
}

mx::array geglu_packed(const mx::array& gu, mx::StreamOrDevice s) {
  return gated_packed(gu, Gate::gelu_tanh, "geglu", s);
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, Gate::silu, "swiglu", s);
}

mx::array geglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, Gate::gelu_tanh, "geglu", s);
}

void SwiGlu::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  auto& encoder = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (const mx::array& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  if (packed_) {
    encoder.dispatch([gu = inputs[0], out, kind = gate_]() mutable {
      std::vector<char> copy;  // a row-major copy of gu if it is not
      const float* x = static_cast<const float*>(contiguous_data(gu, copy));
      float* y = out.data<float>();
      const int64_t F = out.shape(-1), rows = F ? int64_t(out.size()) / F : 0;
      const QmmKernel& k = kernel();
      const auto values = kind == Gate::silu ? k.swiglu : k.geglu;
      const int64_t per_chunk = std::max<int64_t>(1, kSwigluChunk / std::max<int64_t>(F, 1));  // rows
      const int chunks = int((rows + per_chunk - 1) / per_chunk);
      auto run = [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) values(x + r * 2 * F, x + r * 2 * F + F, y + r * F, F);
      };
      ThreadPool& pool = ThreadPool::instance();
      if (chunks < 2 || pool.size() == 1) {
        run(0, rows);
        return;
      }
      pool.parallel_for(chunks, [&](int c) { run(c * per_chunk, std::min(rows, (c + 1) * per_chunk)); });
    });
    return;
  }
  const mx::array& gate = inputs[0];
  const mx::array& up = inputs[1];
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
  const mx::Stream s = stream();
  if (packed_) {  // the gradients of gate and up, concatenated as gu packs them
    const int F = primals[0].shape(-1) / 2;
    std::vector<mx::array> halves = mx::split(primals[0], mx::Shape{F}, -1, s);
    std::vector<mx::array> g = SwiGlu(s, gate_).vjp(halves, cotangents, {0, 1}, {});
    return {mx::concatenate(g, -1, s)};
  }
  const mx::array& gate = primals[0];
  const mx::array& up = primals[1];
  const mx::array& cot = cotangents[0];
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
  if (packed_) {
    mx::Shape shape = inputs[0].shape();
    shape.back() /= 2;
    return {shape};
  }
  return {inputs[0].shape()};
}

}  // namespace mlx_infer_kernels
