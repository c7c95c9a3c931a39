#include "rms_norm.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_infer_kernels {
namespace {

// Rows per chunk of the pool's parallel_for; fewer rows than this run on the calling thread.
constexpr int64_t kNormChunkRows = 64;

// One row: x [D] (contiguous) into y [D].
template <class TX, class TO>
void norm_row(const TX* x, const TO* w, TO* y, int64_t D, float eps) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent sums the compiler vectorizes
  int64_t k = 0;
  for (; k + 8 <= D; k += 8) {
    for (int j = 0; j < 8; ++j) {
      const float v = static_cast<float>(x[k + j]);
      part[j] += v * v;
    }
  }
  for (; k < D; ++k) {
    const float v = static_cast<float>(x[k]);
    part[0] += v * v;
  }
  const float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  const float n = 1.0f / std::sqrt(ss * (1.0f / float(D)) + eps);  // MLX's mean: the sum times 1 / D
  for (int64_t j = 0; j < D; ++j) {
    // rounded to the output dtype, then the weight's product in that dtype (as MLX's fallback)
    const TO normed = static_cast<TO>(static_cast<float>(x[j]) * n);
    y[j] = static_cast<TO>(static_cast<float>(normed) * static_cast<float>(w[j]));
  }
}

template <class TX, class TO>
void norm_all(const mx::array& x, const mx::array& w, mx::array& y, float eps) {
  const int64_t D = x.shape(-1);
  const int64_t rows = D ? int64_t(x.size()) / D : 0;
  std::vector<char> copy;  // x row-major, when it is not already
  const TX* xp = static_cast<const TX*>(contiguous_data(x, copy));
  const TO* wp = w.data<TO>();
  TO* yp = y.data<TO>();
  auto norm_rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * D, wp, yp + r * D, D, eps);
  };
  ThreadPool& pool = ThreadPool::instance();
  if (rows < 2 * kNormChunkRows || pool.size() == 1) {
    norm_rows(0, rows);
    return;
  }
  const int chunks = int((rows + kNormChunkRows - 1) / kNormChunkRows);
  pool.parallel_for(chunks, [&](int c) {
    const int64_t r0 = c * kNormChunkRows;
    norm_rows(r0, std::min(rows, r0 + kNormChunkRows));
  });
}

template <class TO>
void norm_from(const mx::array& x, const mx::array& w, mx::array& y, float eps) {
  switch (x.dtype()) {
    case mx::float32:
      norm_all<float, TO>(x, w, y, eps);
      break;
    case mx::float16:
      norm_all<mx::float16_t, TO>(x, w, y, eps);
      break;
    default:
      norm_all<mx::bfloat16_t, TO>(x, w, y, eps);
  }
}

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || !is_float_type(x.dtype())) {
    throw std::invalid_argument("[rms_norm] x must be float32, float16 or bfloat16 with ndim >= 1, got " +
                                shape_str(x));
  }
  if (weight.ndim() != 1 || weight.shape(0) != x.shape(-1) || !is_float_type(weight.dtype())) {
    throw std::invalid_argument("[rms_norm] weight must be a float [" + std::to_string(x.shape(-1)) + "], got " +
                                shape_str(weight));
  }
  if (!(eps >= 0.0f)) {
    throw std::invalid_argument("[rms_norm] eps must be >= 0, got " + std::to_string(eps));
  }
  mx::Stream stream = cpu_stream(s);
  const mx::Dtype out_type = mx::promote_types(x.dtype(), weight.dtype());
  return mx::array(x.shape(), out_type, std::make_shared<RmsNorm>(stream, eps),
                   {x, row_contiguous(mx::astype(weight, out_type, stream), stream)});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& w = inputs[1];
  mx::array& out = outputs[0];
  require_row_contiguous(w, "weight");
  auto& encoder = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  encoder.dispatch([x, w, out, eps = eps_]() mutable {
    switch (out.dtype()) {
      case mx::float32:
        norm_from<float>(x, w, out, eps);
        break;
      case mx::float16:
        norm_from<mx::float16_t>(x, w, out, eps);
        break;
      default:
        norm_from<mx::bfloat16_t>(x, w, out, eps);
    }
  });
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[rms_norm] the mlx-infer CPU kernels have no GPU implementation");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const RmsNorm&>(other).eps_;
}

std::vector<mx::Shape> RmsNorm::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

}  // namespace mlx_infer_kernels
