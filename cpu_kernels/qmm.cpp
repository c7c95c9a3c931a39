#include "qmm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/utils.h"
#include "common.h"
#include "qmm_kernel.h"
#include "thread_pool.h"

namespace mlx_infer_kernels {
namespace {

const QmmKernel& pick_kernel() {
  const char* want = std::getenv("MLX_INFER_KERNEL_ISA");  // "avx2" or "generic" force a variant
  std::string w = want ? want : "";
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx512 && (w.empty() || w == "avx512")) return kernel_avx512();
  if (avx2 && (w.empty() || w == "avx512" || w == "avx2")) return kernel_avx2();
#endif
  return kernel_generic();
}

}  // namespace

// Buffers the kernels stream through start on a cache line: unaligned 64-byte loads cost 1.5x in the
// register tiles of fewer than 4 rows (measured on Zen 4).
constexpr size_t kAlignFloats = 16;

float* aligned(std::vector<float>& buffer, size_t n) {
  if (buffer.size() < n + kAlignFloats) buffer.resize(n + kAlignFloats);
  const uintptr_t p = reinterpret_cast<uintptr_t>(buffer.data());
  return reinterpret_cast<float*>((p + 63) & ~uintptr_t(63));
}

float* thread_scratch(size_t n) {
  thread_local std::vector<float> scratch;
  return aligned(scratch, n);
}

const QmmKernel& kernel() {
  static const QmmKernel& k = pick_kernel();
  return k;
}

Dtype to_kernel_dtype(mx::Dtype t, const char* what) {
  if (t == mx::float32) return Dtype::f32;
  if (t == mx::float16) return Dtype::f16;
  if (t == mx::bfloat16) return Dtype::bf16;
  throw std::invalid_argument(std::string("[qmm] ") + what + " must be float32, float16 or bfloat16");
}

std::string shape_str(const mx::array& a) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < a.ndim(); ++i) s << (i ? ", " : "") << a.shape(i);
  s << "]";
  return s.str();
}

// A weight operand that is surely row-contiguous when the kernel runs.
mx::array row_contiguous(const mx::array& a, mx::Stream s) {
  if (a.status() != mx::array::unscheduled && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

mx::Stream cpu_stream(mx::StreamOrDevice s) {
  mx::Stream stream = mx::to_stream(s, mx::Device::cpu);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("[qmm] the CPU kernels run on a CPU stream only");
  }
  return stream;
}

void require_row_contiguous(const mx::array& a, const char* what) {
  if (!a.flags().row_contiguous) {
    throw std::runtime_error(std::string("[qmm] ") + what + " is not row-contiguous");
  }
}

void check_bits(int bits, const std::string& op, const std::string& what) {
  if (bits != 4 && bits != 8) {
    throw std::invalid_argument("[" + op + "] " + what + "bits must be 4 or 8, got " + std::to_string(bits));
  }
}

void check_group_size(int group_size, const std::string& op) {
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("[" + op + "] group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
}

// Checks the weight operands; returns N and K.
std::pair<int, int> check_weights(
    const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits) {
  check_bits(bits, "qmm");
  check_group_size(group_size, "qmm");
  if (w.ndim() != 2 || w.dtype() != mx::uint32) {
    throw std::invalid_argument("[qmm] w must be a 2-D uint32 array, got " + shape_str(w));
  }
  const int N = w.shape(0);
  const int K = w.shape(1) * 32 / bits;
  if (K % group_size != 0) {
    throw std::invalid_argument("[qmm] K must be a multiple of group_size");
  }
  const mx::Shape sb{N, K / group_size};
  if (scales.shape() != sb || biases.shape() != sb) {
    throw std::invalid_argument(
        "[qmm] scales and biases must be " + shape_str(mx::zeros(sb, mx::float32)) + " for w " +
        shape_str(w) + ", got " + shape_str(scales) + " and " + shape_str(biases));
  }
  if (scales.dtype() != biases.dtype()) {
    throw std::invalid_argument("[qmm] scales and biases must have one dtype");
  }
  to_kernel_dtype(scales.dtype(), "scales and biases");
  return {N, K};
}

// The start the primitives' eval_cpu share: the weight (inputs[first]), scales and biases must be
// row-contiguous; `out` gets its buffer; every input and the output are registered with the stream's CPU
// command encoder. Returns QmmArgs with the weight fields filled in (the caller adds x, y, M, N, K).
QmmArgs weight_args(const std::vector<mx::array>& inputs, size_t first, mx::array& out, mx::Stream stream,
                    int group_size, int bits) {
  const mx::array& w = inputs[first];
  const mx::array& scales = inputs[first + 1];
  const mx::array& biases = inputs[first + 2];
  require_row_contiguous(w, "w");
  require_row_contiguous(scales, "scales");
  require_row_contiguous(biases, "biases");
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const mx::array& a : inputs) {
    encoder.set_input_array(a);
  }
  encoder.set_output_array(out);
  QmmArgs a{};
  a.w = w.data<uint32_t>();
  a.scales = scales.data<void>();
  a.biases = biases.data<void>();
  a.group_size = group_size;
  a.bits = bits;
  a.sb_dtype = to_kernel_dtype(scales.dtype(), "scales");
  return a;
}

std::string isa() {
  return kernel().name;
}

int num_threads() {
  return ThreadPool::instance().size();
}

mx::array qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  auto [N, K] = check_weights(w, scales, biases, group_size, bits);
  if (x.ndim() != 2 || x.shape(1) != K) {
    throw std::invalid_argument(
        "[qmm] x must be [M, " + std::to_string(K) + "] for w " + shape_str(w) + ", got " + shape_str(x));
  }
  if (x.shape(0) < 1) {
    throw std::invalid_argument("[qmm] x must have at least one row");
  }
  to_kernel_dtype(x.dtype(), "x");
  mx::Stream stream = cpu_stream(s);
  return mx::array(
      {x.shape(0), N},
      mx::promote_types(x.dtype(), scales.dtype()),  // as mx::quantized_matmul
      std::make_shared<Qmm>(stream, group_size, bits),
      {x, row_contiguous(w, stream), row_contiguous(scales, stream), row_contiguous(biases, stream)});
}

mx::array dequantize_f32(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s) {
  auto [N, K] = check_weights(w, scales, biases, group_size, bits);
  mx::Stream stream = cpu_stream(s);
  return mx::array(
      {N, K},
      mx::float32,
      std::make_shared<DequantizeF32>(stream, group_size, bits),
      {row_contiguous(w, stream), row_contiguous(scales, stream), row_contiguous(biases, stream)});
}

QmmArgs product_args(const std::vector<mx::array>& inputs, mx::array& out, mx::Stream stream, int group_size,
                     int bits) {
  const mx::array& x = inputs[0];
  QmmArgs a = weight_args(inputs, 1, out, stream, group_size, bits);
  a.y = out.data<void>();
  a.M = x.shape(0);
  a.K = x.shape(1);
  a.N = inputs[1].shape(0);
  a.ldy = a.N;
  a.G = a.K / a.group_size;
  a.y_dtype = to_kernel_dtype(out.dtype(), "y");
  return a;
}

void load_x_as(const void* src, mx::Dtype dtype, const mx::Strides& st, int M, int K, int bits, int lanes,
               float* dst) {
  if (dtype == mx::float32) {
    load_x(static_cast<const float*>(src), st, M, K, bits, lanes, dst);
  } else if (dtype == mx::float16) {
    load_x(static_cast<const mx::float16_t*>(src), st, M, K, bits, lanes, dst);
  } else {
    load_x(static_cast<const mx::bfloat16_t*>(src), st, M, K, bits, lanes, dst);
  }
}

void Qmm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  QmmArgs a = product_args(inputs, outputs[0], stream(), group_size_, bits_);
  mx::cpu::get_command_encoder(stream()).dispatch([a, xp = x.data<void>(), xt = x.dtype(), xs = x.strides()]() mutable {
    const QmmKernel& k = kernel();
    std::vector<float> xbuf;  // x as [M, K] float32 in the kernel's order, on a cache line (small)
    float* xf = aligned(xbuf, size_t(a.M) * a.K);
    load_x_as(xp, xt, xs, a.M, a.K, a.bits, k.lanes, xf);
    a.x = xf;
    split_rows(a.N, a.K, int64_t(a.M) * a.N * a.K, [&](int n0, int n1, float* scratch) {
      k.rows(a, n0, n1, scratch);
    });
  });
}

void DequantizeF32::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  QmmArgs a = weight_args(inputs, 0, out, stream(), group_size_, bits_);
  a.N = out.shape(0);
  a.K = out.shape(1);
  a.G = a.K / a.group_size;
  a.y_dtype = Dtype::f32;
  mx::cpu::get_command_encoder(stream()).dispatch([a, y = out.data<float>()]() {
    const QmmKernel& k = kernel();
    // Weighted like a 4-row product: dequantizing is a few operations per value.
    split_rows(a.N, a.K, int64_t(4) * a.N * a.K, [&](int n0, int n1, float*) {
      k.dequant(a, n0, n1, y + int64_t(n0) * a.K);
    });
  });
}

void Qmm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[qmm] the mlx-infer CPU kernels have no GPU implementation");
}

void DequantizeF32::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[qmm] the mlx-infer CPU kernels have no GPU implementation");
}

bool Qmm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Qmm&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

bool DequantizeF32::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const DequantizeF32&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_;
}

std::vector<mx::Shape> Qmm::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[1].shape(0)}};
}

std::vector<mx::Shape> DequantizeF32::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1) * 32 / bits_}};
}

}  // namespace mlx_infer_kernels
