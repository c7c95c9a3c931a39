#include "softmax.h"

#include <stdexcept>
#include <string>

#include "common.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_infer_kernels {
namespace {

// Rows per chunk of the pool's parallel_for (a chunk is at least this many score rows).
constexpr int64_t kSoftmaxChunkRows = 16;

}  // namespace

mx::array causal_softmax(const mx::array& x, float scale, int period, int q0, int window, mx::StreamOrDevice s) {
  if (x.ndim() < 2 || x.dtype() != mx::float32) {
    throw std::invalid_argument("[causal_softmax] x must be float32 with ndim >= 2, got " + shape_str(x));
  }
  if (period < 1 || q0 < 0 || window < 0 || !(scale > 0.0f)) {
    throw std::invalid_argument("[causal_softmax] needs period >= 1, q0 >= 0, window >= 0 and scale > 0, got period " +
                                std::to_string(period) + ", q0 " + std::to_string(q0) + ", window " +
                                std::to_string(window) + ", scale " + std::to_string(scale));
  }
  mx::Stream stream = cpu_stream(s);
  return mx::array(x.shape(), mx::float32, std::make_shared<CausalSoftmax>(stream, scale, period, q0, window),
                   {row_contiguous(x, stream)});
}

void CausalSoftmax::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  mx::array& out = outputs[0];
  require_row_contiguous(x, "x");
  if (x.is_donatable()) {
    out.copy_shared_buffer(x);
  } else {
    out.set_data(mx::allocator::malloc(out.nbytes()));
  }
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  SoftmaxArgs a{};
  a.x = x.data<float>();
  a.y = out.data<float>();
  a.R = x.shape(-2);
  a.S = x.shape(-1);
  a.period = period_;
  a.q0 = q0_;
  a.window = window_;
  a.scale = scale_;
  const int64_t rows = x.size() / std::max<int64_t>(1, a.S);
  encoder.dispatch([a, rows]() {
    const QmmKernel& k = kernel();
    ThreadPool& pool = ThreadPool::instance();
    const int64_t per = std::max(kSoftmaxChunkRows, (rows + kChunksPerThread * pool.size() - 1) /
                                                         (int64_t(kChunksPerThread) * pool.size()));
    const int chunks = int((rows + per - 1) / per);
    pool.parallel_for(chunks, [&](int c) {
      const int64_t r0 = c * per;
      k.softmax_rows(a, r0, std::min(rows, r0 + per));
    });
  });
}

void CausalSoftmax::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[causal_softmax] the mlx-infer CPU kernels have no GPU implementation");
}

bool CausalSoftmax::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const CausalSoftmax&>(other);
  return scale_ == o.scale_ && period_ == o.period_ && q0_ == o.q0_ && window_ == o.window_;
}

std::vector<mx::Shape> CausalSoftmax::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

}  // namespace mlx_infer_kernels
