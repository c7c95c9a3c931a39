#include "move.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_infer_kernels {

mx::array move_rows(const mx::array& a, const mx::array& src, const mx::array& dst, mx::StreamOrDevice s) {
  if (a.ndim() != 2) {
    throw std::invalid_argument("[move_rows] a must be [R, W], got " + shape_str(a));
  }
  if (src.ndim() != 1 || dst.ndim() != 1 || src.dtype() != mx::int32 || dst.dtype() != mx::int32 ||
      src.size() != dst.size()) {
    throw std::invalid_argument("[move_rows] src and dst must be int32 [M] of one size, got " + shape_str(src) +
                                " and " + shape_str(dst));
  }
  mx::Stream stream = cpu_stream(s);
  return mx::array(a.shape(), a.dtype(), std::make_shared<MoveRows>(stream),
                   {a, row_contiguous(src, stream), row_contiguous(dst, stream)});
}

namespace {

// out takes a's buffer when a is row-contiguous and MLX can donate it (returns true), else a new one.
bool take_or_allocate(const mx::array& a, mx::array& out) {
  if (a.flags().row_contiguous && a.is_donatable()) {
    out.copy_shared_buffer(a);
    return true;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return false;
}

// Row r of `p` (element strides st, W items of `item` bytes) into `to`.
void copy_row(const char* p, const mx::Strides& st, int64_t r, int64_t W, size_t item, char* to) {
  const char* from = p + r * st[0] * int64_t(item);
  if (st[1] == 1) {
    std::memcpy(to, from, size_t(W) * item);
  } else {
    for (int64_t j = 0; j < W; ++j) std::memcpy(to + j * item, from + j * st[1] * int64_t(item), item);
  }
}

}  // namespace

mx::array write_rows(const mx::array& a, const mx::array& x, const mx::array& dst, mx::StreamOrDevice s) {
  if (a.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != a.shape(1) || x.dtype() != a.dtype()) {
    throw std::invalid_argument("[write_rows] a must be [R, W] and x [..., W] of a's dtype, got " + shape_str(a) +
                                " and " + shape_str(x));
  }
  const size_t M = a.shape(1) ? x.size() / size_t(a.shape(1)) : 0;
  if (dst.ndim() != 1 || dst.dtype() != mx::int32 || dst.size() != M) {
    throw std::invalid_argument("[write_rows] dst must be int32 [" + std::to_string(M) + "], got " + shape_str(dst));
  }
  mx::Stream stream = cpu_stream(s);
  return mx::array(a.shape(), a.dtype(), std::make_shared<WriteRows>(stream), {a, x, row_contiguous(dst, stream)});
}

void WriteRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& a = inputs[0];
  const mx::array& x = inputs[1];
  const mx::array& dst = inputs[2];
  mx::array& out = outputs[0];
  require_row_contiguous(dst, "dst");
  const bool in_place = take_or_allocate(a, out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const mx::array& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  const int64_t R = a.shape(0), W = a.shape(1), M = dst.size();
  const size_t item = a.itemsize(), row_bytes = size_t(W) * item;
  encoder.dispatch([in_place, R, W, M, item, row_bytes, a, x, dp = dst.data<int32_t>(), op = out.data<char>()]() {
    if (!in_place) {
      for (int64_t r = 0; r < R; ++r) copy_row(a.data<char>(), a.strides(), r, W, item, op + r * int64_t(row_bytes));
    }
    std::vector<char> copy;  // x row-major, if it is not
    const char* xp = static_cast<const char*>(contiguous_data(x, copy));
    for (int64_t i = 0; i < M; ++i) {
      if (dp[i] >= 0 && dp[i] < R) std::memcpy(op + dp[i] * int64_t(row_bytes), xp + i * int64_t(row_bytes), row_bytes);
    }
  });
}

void WriteRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[write_rows] the mlx-infer CPU kernels have no GPU implementation");
}

std::vector<mx::Shape> WriteRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

void MoveRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& a = inputs[0];
  const mx::array& src = inputs[1];
  const mx::array& dst = inputs[2];
  mx::array& out = outputs[0];
  require_row_contiguous(src, "src");
  require_row_contiguous(dst, "dst");
  const bool in_place = take_or_allocate(a, out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(a);
  encoder.set_input_array(src);
  encoder.set_input_array(dst);
  encoder.set_output_array(out);
  const int64_t R = a.shape(0), W = a.shape(1), M = src.size();
  const size_t item = a.itemsize(), row_bytes = size_t(W) * item;
  encoder.dispatch([in_place, R, W, M, item, row_bytes, ap = a.data<char>(), as = a.strides(),
                    sp = src.data<int32_t>(), dp = dst.data<int32_t>(), op = out.data<char>()]() {
    if (!in_place) {
      for (int64_t r = 0; r < R; ++r) copy_row(ap, as, r, W, item, op + r * int64_t(row_bytes));
    }
    // Every source row first, then the writes: a destination may be another move's source.
    std::vector<char> moved(size_t(M) * row_bytes);
    for (int64_t i = 0; i < M; ++i) {
      if (sp[i] >= 0 && sp[i] < R) std::memcpy(moved.data() + i * row_bytes, op + sp[i] * int64_t(row_bytes), row_bytes);
    }
    for (int64_t i = 0; i < M; ++i) {
      if (sp[i] >= 0 && sp[i] < R && dp[i] >= 0 && dp[i] < R) {
        std::memcpy(op + dp[i] * int64_t(row_bytes), moved.data() + i * row_bytes, row_bytes);
      }
    }
  });
}

void MoveRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[move_rows] the mlx-infer CPU kernels have no GPU implementation");
}

std::vector<mx::Shape> MoveRows::output_shapes(const std::vector<mx::array>& inputs) {
  return {inputs[0].shape()};
}

}  // namespace mlx_infer_kernels
