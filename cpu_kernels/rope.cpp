#include "rope.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_infer_kernels {
namespace {

// (batch, position) rows per chunk of the pool's parallel_for; fewer run on the calling thread.
constexpr int64_t kRopeChunkRows = 16;

struct RopeArgs {
  int64_t B, N, T, D;      // x viewed as [B, N, T, D]
  const int64_t* rows;     // row (b, n, t) of x at x + rows[(b * N + n) * T + t]
  int64_t sd;              // x's feature stride
  int dims;
  bool traditional;
  float scale;
  const int32_t* offset;   // [1] or [B]
  int64_t n_offsets;
  const float* inv_freq;   // [dims / 2]
};

// Rows (b, t) in [r0, r1) (r = b * T + t), every head n: cos / sin of the row's angles, then the rotation.
template <class T>
void rope_rows(const RopeArgs& a, const T* x, T* y, int64_t r0, int64_t r1) {
  const int half = a.dims / 2;
  std::vector<T> cs(half), sn(half), copy(a.sd == 1 ? 0 : size_t(a.D));
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t b = r / a.T, t = r % a.T;
    const int32_t off = a.offset[a.n_offsets == 1 ? 0 : b];
    const float pos = (float(t) + float(off)) * a.scale;  // MLX: (arange(T) + offset) * scale in float32
    for (int i = 0; i < half; ++i) {
      const float theta = pos * a.inv_freq[i];
      cs[i] = static_cast<T>(std::cos(theta));
      sn[i] = static_cast<T>(std::sin(theta));
    }
    for (int64_t n = 0; n < a.N; ++n) {
      const int64_t row = (b * a.N + n) * a.T + t;
      const T* in = x + a.rows[row];
      if (a.sd != 1) {  // features not contiguous: through a contiguous copy of the row
        for (int64_t j = 0; j < a.D; ++j) copy[size_t(j)] = in[j * a.sd];
        in = copy.data();
      }
      T* out = y + row * a.D;
      // each product and the difference rounded to T, as MLX's multiply / subtract / add ops
      auto rot = [](T x1, T x2, T c, T s, T& o1, T& o2) {
        const T a1 = static_cast<T>(static_cast<float>(x1) * static_cast<float>(c));
        const T a2 = static_cast<T>(static_cast<float>(x2) * static_cast<float>(s));
        const T b1 = static_cast<T>(static_cast<float>(x1) * static_cast<float>(s));
        const T b2 = static_cast<T>(static_cast<float>(x2) * static_cast<float>(c));
        o1 = static_cast<T>(static_cast<float>(a1) - static_cast<float>(a2));
        o2 = static_cast<T>(static_cast<float>(b1) + static_cast<float>(b2));
      };
      if (a.traditional) {
        for (int i = 0; i < half; ++i) rot(in[2 * i], in[2 * i + 1], cs[i], sn[i], out[2 * i], out[2 * i + 1]);
      } else {
        for (int i = 0; i < half; ++i) rot(in[i], in[i + half], cs[i], sn[i], out[i], out[i + half]);
      }
      for (int64_t j = a.dims; j < a.D; ++j) out[j] = in[j];
    }
  }
}

template <class T>
void rope_all(const RopeArgs& a, const T* x, T* y) {
  const int64_t rows = a.B * a.T;
  ThreadPool& pool = ThreadPool::instance();
  if (rows < 2 * kRopeChunkRows || pool.size() == 1) {
    rope_rows(a, x, y, 0, rows);
    return;
  }
  const int chunks = int((rows + kRopeChunkRows - 1) / kRopeChunkRows);
  pool.parallel_for(chunks, [&](int c) {
    const int64_t r0 = c * kRopeChunkRows;
    rope_rows(a, x, y, r0, std::min(rows, r0 + kRopeChunkRows));
  });
}

template <class T>
void rope_all_typed(const RopeArgs& a, const mx::array& x, mx::array& out) {
  rope_all<T>(a, x.data<T>(), out.data<T>());
}

// rope_all over x's dtype.
void rope_any(const RopeArgs& a, const mx::array& x, mx::array& out) {
  switch (x.dtype()) {
    case mx::float32:
      rope_all_typed<float>(a, x, out);
      break;
    case mx::float16:
      rope_all_typed<mx::float16_t>(a, x, out);
      break;
    default:
      rope_all_typed<mx::bfloat16_t>(a, x, out);
  }
}

// The inverse frequencies [dims / 2] float32: 1 / freqs, else base^(-i / (dims / 2)) computed on the host.
mx::array inv_freq_of(int dims, float base, const std::optional<mx::array>& freqs, mx::Stream stream) {
  const int half = dims / 2;
  if (freqs) {
    if (freqs->ndim() != 1 || freqs->shape(0) != half) {
      throw std::invalid_argument("[rope] freqs must be [" + std::to_string(half) + "], got " + shape_str(*freqs));
    }
    return row_contiguous(mx::reciprocal(mx::astype(*freqs, mx::float32, stream), stream), stream);
  }
  // base^(-i / half) = exp(-i * (log(base) / half)), in float32 as MLX's fallback
  std::vector<float> f(half);
  const float step = std::log(base) / float(half);
  for (int i = 0; i < half; ++i) f[i] = std::exp(float(-i) * step);
  return mx::array(f.begin(), mx::Shape{half}, mx::float32);
}

// offset as int32 scalar or [B]; throws std::invalid_argument on another shape or a non-integer dtype.
mx::array offset_of(const mx::array& offset, int B, mx::Stream stream) {
  if (offset.ndim() > 1 || (offset.size() != 1 && offset.size() != size_t(B)) ||
      !mx::issubdtype(offset.dtype(), mx::integer)) {
    throw std::invalid_argument("[rope] offset must be an integer scalar or [" + std::to_string(B) + "], got " +
                                shape_str(offset));
  }
  return row_contiguous(offset.dtype() == mx::int32 ? offset : mx::astype(offset, mx::int32, stream), stream);
}

// The rows (b, n, t) of head n of x [B, T, col0 + N * D + ...] (any strides; the heads from feature col0
// on), as rope_rows reads them.
std::vector<int64_t> head_rows(const mx::array& x, int64_t N, int64_t D, int64_t col0 = 0) {
  const int64_t B = x.shape(0), T = x.shape(1);
  const auto& st = x.strides();
  std::vector<int64_t> rows(size_t(B * N * T));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t t = 0; t < T; ++t) {
        rows[size_t((b * N + n) * T + t)] = b * st[0] + t * st[1] + (col0 + n * D) * st[2];
      }
    }
  }
  return rows;
}

}  // namespace

std::vector<mx::array> rope_heads(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& offset,
                                  int n_q, int n_kv, int dims, bool traditional, float base, float scale,
                                  const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3 || !is_float_type(q.dtype()) || k.dtype() != q.dtype() ||
      v.dtype() != q.dtype()) {
    throw std::invalid_argument("[rope_heads] q, k, v must be [B, T, heads * D] of one float dtype, got " +
                                shape_str(q) + ", " + shape_str(k) + ", " + shape_str(v));
  }
  if (n_q <= 0 || n_kv <= 0 || q.shape(2) % n_q != 0 || k.shape(2) % n_kv != 0 || v.shape(2) % n_kv != 0 ||
      q.shape(2) / n_q != k.shape(2) / n_kv || k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) ||
      k.shape(1) != q.shape(1) || v.shape(1) != q.shape(1)) {
    throw std::invalid_argument("[rope_heads] " + std::to_string(n_q) + " query and " + std::to_string(n_kv) +
                                " key / value heads do not split " + shape_str(q) + ", " + shape_str(k) + ", " +
                                shape_str(v));
  }
  const int B = q.shape(0), T = q.shape(1), D = q.shape(2) / n_q, Dv = v.shape(2) / n_kv;
  if (dims <= 0 || dims % 2 != 0 || dims > D) {
    throw std::invalid_argument("[rope_heads] dims must be even, positive and at most " + std::to_string(D) +
                                ", got " + std::to_string(dims));
  }
  mx::Stream stream = cpu_stream(s);
  return mx::array::make_arrays(
      {mx::Shape{B, n_q, T, D}, mx::Shape{B, n_kv, T, D}, mx::Shape{B, n_kv, T, Dv}}, {q.dtype(), q.dtype(), q.dtype()},
      std::make_shared<RopeHeads>(stream, n_q, n_kv, dims, traditional, scale),
      {q, k, v, offset_of(offset, B, stream), inv_freq_of(dims, base, freqs, stream)});
}

std::vector<mx::array> rope_heads_packed(const mx::array& qkv, const mx::array& offset, int n_q, int n_kv, int dims,
                                         bool traditional, float base, float scale,
                                         const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  const int heads = n_q + 2 * n_kv;
  if (qkv.ndim() != 3 || !is_float_type(qkv.dtype()) || n_q <= 0 || n_kv <= 0 || qkv.shape(2) % heads != 0) {
    throw std::invalid_argument("[rope_heads] qkv must be [B, T, (n_q + 2 n_kv) * D] of a float dtype for " +
                                std::to_string(n_q) + " query and " + std::to_string(n_kv) +
                                " key / value heads, got " + shape_str(qkv));
  }
  const int B = qkv.shape(0), T = qkv.shape(1), D = qkv.shape(2) / heads;
  if (dims <= 0 || dims % 2 != 0 || dims > D) {
    throw std::invalid_argument("[rope_heads] dims must be even, positive and at most " + std::to_string(D) +
                                ", got " + std::to_string(dims));
  }
  mx::Stream stream = cpu_stream(s);
  const mx::Dtype dt = qkv.dtype();
  return mx::array::make_arrays(
      {mx::Shape{B, n_q, T, D}, mx::Shape{B, n_kv, T, D}, mx::Shape{B, n_kv, T, D}}, {dt, dt, dt},
      std::make_shared<RopeHeads>(stream, n_q, n_kv, dims, traditional, scale, true),
      {qkv, offset_of(offset, B, stream), inv_freq_of(dims, base, freqs, stream)});
}

void RopeHeads::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const size_t n_x = packed_ ? 1 : 3;  // the projection inputs before offset and inv_freq
  const mx::array& offset = inputs[n_x];
  const mx::array& inv_freq = inputs[n_x + 1];
  require_row_contiguous(offset, "offset");
  require_row_contiguous(inv_freq, "inv_freq");
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const mx::array& in : inputs) encoder.set_input_array(in);
  for (mx::array& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  RopeArgs a{};
  a.B = inputs[0].shape(0);
  a.T = inputs[0].shape(1);
  a.traditional = traditional_;
  a.scale = scale_;
  a.offset = offset.data<int32_t>();
  a.n_offsets = int64_t(offset.size());
  a.inv_freq = inv_freq.data<float>();
  const int heads[3] = {n_q_, n_kv_, n_kv_};
  encoder.dispatch([a, heads, packed = packed_, dims = dims_, ins = inputs, outs = outputs]() mutable {
    int64_t col0 = 0;  // (packed) the first feature of projection i in qkv
    for (int i = 0; i < 3; ++i) {  // q and k rotated, v copied (rope over 0 features)
      const mx::array& x = ins[packed ? 0 : i];
      RopeArgs h = a;
      h.N = heads[i];
      h.D = outs[i].shape(3);
      h.sd = x.strides()[2];
      h.dims = i < 2 ? dims : 0;
      const std::vector<int64_t> rows = head_rows(x, h.N, h.D, packed ? col0 : 0);
      h.rows = rows.data();
      rope_any(h, x, outs[i]);
      col0 += h.N * h.D;
    }
  });
}

void RopeHeads::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[rope_heads] the mlx-infer CPU kernels have no GPU implementation");
}

bool RopeHeads::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RopeHeads&>(other);
  return n_q_ == o.n_q_ && n_kv_ == o.n_kv_ && dims_ == o.dims_ && traditional_ == o.traditional_ &&
         scale_ == o.scale_ && packed_ == o.packed_;
}

std::vector<mx::Shape> RopeHeads::output_shapes(const std::vector<mx::array>& inputs) {
  const int B = inputs[0].shape(0), T = inputs[0].shape(1);
  if (packed_) {
    const int D = inputs[0].shape(2) / (n_q_ + 2 * n_kv_);
    return {mx::Shape{B, n_q_, T, D}, mx::Shape{B, n_kv_, T, D}, mx::Shape{B, n_kv_, T, D}};
  }
  return {mx::Shape{B, n_q_, T, inputs[0].shape(2) / n_q_}, mx::Shape{B, n_kv_, T, inputs[1].shape(2) / n_kv_},
          mx::Shape{B, n_kv_, T, inputs[2].shape(2) / n_kv_}};
}

mx::array rope(const mx::array& x, const mx::array& offset, int dims, bool traditional, float base, float scale,
               const std::optional<mx::array>& freqs, mx::StreamOrDevice s) {
  if (x.ndim() < 3 || !is_float_type(x.dtype())) {
    throw std::invalid_argument("[rope] x must be float32, float16 or bfloat16 with ndim >= 3, got " + shape_str(x));
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument("[rope] dims must be even, positive and at most " + std::to_string(x.shape(-1)) +
                                ", got " + std::to_string(dims));
  }
  mx::Stream stream = cpu_stream(s);
  return mx::array(x.shape(), x.dtype(), std::make_shared<Rope>(stream, dims, traditional, scale),
                   {x, offset_of(offset, x.shape(0), stream), inv_freq_of(dims, base, freqs, stream)});
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  const mx::array& offset = inputs[1];
  const mx::array& inv_freq = inputs[2];
  mx::array& out = outputs[0];
  require_row_contiguous(offset, "offset");
  require_row_contiguous(inv_freq, "inv_freq");
  auto& encoder = mx::cpu::get_command_encoder(stream());
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(x);
  encoder.set_input_array(offset);
  encoder.set_input_array(inv_freq);
  encoder.set_output_array(out);
  RopeArgs a{};
  a.B = x.shape(0);
  a.T = x.shape(-2);
  a.D = x.shape(-1);
  a.N = a.B * a.T * a.D ? int64_t(x.size()) / (a.B * a.T * a.D) : 0;
  a.sd = x.strides().back();
  a.dims = dims_;
  a.traditional = traditional_;
  a.scale = scale_;
  a.offset = offset.data<int32_t>();
  a.n_offsets = int64_t(offset.size());
  a.inv_freq = inv_freq.data<float>();
  encoder.dispatch([a, x, out]() mutable {
    const std::vector<int64_t> rows = row_offsets(x);
    a.rows = rows.data();
    rope_any(a, x, out);
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[rope] the mlx-infer CPU kernels have no GPU implementation");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
}

std::vector<mx::Shape> Rope::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

}  // namespace mlx_infer_kernels
