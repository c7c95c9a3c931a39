#include "qmm.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <iterator>
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

#if defined(__x86_64__) || defined(_M_X64)
struct X86Features {
  bool avx512, vnni, avx2;  // what the avx512 / avx512vnni / avx2 (and avx2int8) variants need
};

X86Features x86_features() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return {avx512, avx512 && __builtin_cpu_supports("avx512vnni"),
          __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")};
}
#endif

const QmmKernel& pick_kernel() {
  // "avx512", "avx2" or "generic" force a variant (a faster one the CPU lacks is skipped); "avx512vnni" and
  // "avx2int8" ask for the int8-activation product (qmm_q8_body.h), which is never picked unasked
  const char* want = std::getenv("MLX_INFER_KERNEL_ISA");
  std::string w = want ? want : "";
  std::transform(w.begin(), w.end(), w.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  // a value naming no variant (a typo) counts as unset: the best variant this CPU has (the Python side
  // warns, mlx_infer.kernels.cpu.unknown_isa_request)
  const char* const known[] = {"avx512", "avx2", "generic", "avx512vnni", "avx2int8"};
  if (std::find(std::begin(known), std::end(known), w) == std::end(known)) w.clear();
#if defined(__x86_64__) || defined(_M_X64)
  // only the variants this build holds (CMakeLists.txt's MLX_INFER_VARIANTS: mlx_infer.kernels.cpu builds
  // the best one this CPU runs, and any other MLX_INFER_KERNEL_ISA asks for)
  [[maybe_unused]] const auto [avx512, vnni, avx2] = x86_features();
#ifdef MLX_INFER_VARIANT_AVX512VNNI
  if (vnni && w == "avx512vnni") return kernel_avx512_vnni();
#endif
#ifdef MLX_INFER_VARIANT_AVX2INT8
  if (avx2 && w == "avx2int8") return kernel_avx2_int8();
#endif
#ifdef MLX_INFER_VARIANT_AVX512
  if (avx512 && (w.empty() || w == "avx512vnni" || w == "avx512")) return kernel_avx512();
#endif
#ifdef MLX_INFER_VARIANT_AVX2
  if (avx2 && (w.empty() || w == "avx512vnni" || w == "avx512" || w == "avx2" || w == "avx2int8")) {
    return kernel_avx2();
  }
#endif
#endif
  return kernel_generic();
}

}  // namespace

#if defined(__x86_64__) || defined(_M_X64)
// A variant's functions with an int8-activation product added.
[[maybe_unused]] static QmmKernel with_int8(const QmmKernel& base, const char* name, const QmmQ8Kernel& q8) {
  QmmKernel v = base;
  v.name = name;
  v.q8 = &q8;
  return v;
}

#ifdef MLX_INFER_VARIANT_AVX512VNNI
const QmmKernel& kernel_avx512_vnni() {
  static const QmmKernel k = with_int8(kernel_avx512(), "avx512vnni", q8_avx512_vnni());
  return k;
}
#endif

#ifdef MLX_INFER_VARIANT_AVX2INT8
const QmmKernel& kernel_avx2_int8() {
  static const QmmKernel k = with_int8(kernel_avx2(), "avx2int8", q8_avx2());
  return k;
}
#endif
#endif

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

bool is_float_type(mx::Dtype t) { return t == mx::float32 || t == mx::float16 || t == mx::bfloat16; }

std::vector<int64_t> row_offsets(const mx::array& a) {
  const int nd = int(a.ndim()) - 1;
  int64_t rows = 1;
  for (int i = 0; i < nd; ++i) rows *= a.shape(i);
  std::vector<int64_t> out(size_t(std::max<int64_t>(rows, 0)));
  std::vector<int64_t> idx(size_t(std::max(nd, 0)), 0);
  int64_t off = 0;
  for (int64_t r = 0; r < rows; ++r) {
    out[size_t(r)] = off;
    for (int i = nd - 1; i >= 0; --i) {  // odometer over the leading dimensions
      off += a.strides()[i];
      if (++idx[i] < a.shape(i)) break;
      off -= a.strides()[i] * int64_t(a.shape(i));
      idx[i] = 0;
    }
  }
  return out;
}

const void* contiguous_data(const mx::array& a, std::vector<char>& scratch) {
  if (a.flags().row_contiguous) return a.data<void>();
  const size_t item = a.itemsize();
  scratch.resize(a.nbytes());
  if (a.ndim() == 0 || a.size() == 0) {
    std::memcpy(scratch.data(), a.data<char>(), a.nbytes());
    return scratch.data();
  }
  const int64_t W = a.shape(-1), sw = a.strides().back();
  const std::vector<int64_t> rows = row_offsets(a);
  const char* src = a.data<char>();
  char* dst = scratch.data();
  for (int64_t r : rows) {
    const char* row = src + r * int64_t(item);
    if (sw == 1) {
      std::memcpy(dst, row, size_t(W) * item);
    } else {
      for (int64_t j = 0; j < W; ++j) std::memcpy(dst + j * item, row + j * sw * int64_t(item), item);
    }
    dst += W * int64_t(item);
  }
  return scratch.data();
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

std::vector<std::string> int8_variants() {
  std::vector<std::string> out;
#if defined(__x86_64__) || defined(_M_X64)
  const X86Features f = x86_features();
  if (f.vnni) out.push_back("avx512vnni");
  if (f.avx2) out.push_back("avx2int8");
#endif
  return out;
}

std::vector<int> int8_bits() {
  const QmmQ8Kernel* q8 = kernel().q8;
  if (!q8) return {};
  if (q8->bits8) return {4, 8};
  return {4};
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
    const std::optional<mx::array>& residual,
    mx::StreamOrDevice s) {
  auto [N, K] = check_weights(w, scales, biases, group_size, bits);
  if (x.ndim() < 1 || x.shape(-1) != K) {
    throw std::invalid_argument(
        "[qmm] x must be [..., " + std::to_string(K) + "] for w " + shape_str(w) + ", got " + shape_str(x));
  }
  if (x.size() == 0) {
    throw std::invalid_argument("[qmm] x must have at least one row");
  }
  to_kernel_dtype(x.dtype(), "x");
  mx::Stream stream = cpu_stream(s);
  mx::Shape shape = x.shape();
  shape.back() = N;
  const mx::Dtype y_dtype = mx::promote_types(x.dtype(), scales.dtype());  // as mx::quantized_matmul
  std::vector<mx::array> inputs{x, row_contiguous(w, stream), row_contiguous(scales, stream),
                                row_contiguous(biases, stream)};
  if (residual) {
    if (residual->shape() != shape || residual->dtype() != mx::float32 || y_dtype != mx::float32) {
      std::ostringstream msg;  // (MLX's operator<< names a dtype)
      msg << "[qmm] the residual must be float32 " << shape_str(mx::zeros(shape, mx::float32))
          << " with a float32 product, got " << shape_str(*residual) << " " << residual->dtype() << " with a "
          << y_dtype << " product";
      throw std::invalid_argument(msg.str());
    }
    inputs.push_back(*residual);  // as it is (eval_cpu copies it if it is not row-contiguous): no copy operation
  }
  return mx::array(std::move(shape), y_dtype, std::make_shared<Qmm>(stream, group_size, bits, bool(residual)),
                   std::move(inputs));
}

QmmArgs product_args(const std::vector<mx::array>& inputs, mx::array& out, mx::Stream stream, int group_size,
                     int bits) {
  const mx::array& x = inputs[0];
  QmmArgs a = weight_args(inputs, 1, out, stream, group_size, bits);
  a.y = out.data<void>();
  a.K = x.shape(-1);
  a.M = int(x.size() / a.K);
  a.N = inputs[1].shape(0);
  a.ldy = a.N;
  a.G = a.K / a.group_size;
  a.y_dtype = to_kernel_dtype(out.dtype(), "y");
  return a;
}

void load_x_as(const mx::array& x, const std::vector<int64_t>& rows, int m0, int M, int bits, int lanes, int block,
               float* dst) {
  const int K = x.shape(-1);
  const int64_t sk = x.strides().back();
  const int64_t* r = rows.data() + m0;
  if (x.dtype() == mx::float32) {
    load_x(x.data<float>(), r, sk, M, K, bits, lanes, block, dst);
  } else if (x.dtype() == mx::float16) {
    load_x(x.data<mx::float16_t>(), r, sk, M, K, bits, lanes, block, dst);
  } else {
    load_x(x.data<mx::bfloat16_t>(), r, sk, M, K, bits, lanes, block, dst);
  }
}

std::vector<int64_t> strided_rows(int M, int64_t step) {
  std::vector<int64_t> rows(size_t(std::max(M, 0)));
  for (int m = 0; m < M; ++m) rows[size_t(m)] = m * step;
  return rows;
}

namespace {

// Rows of x per pass over the weight when a product has many (a prefill): as many as keep x's float32
// rows within kXPassBytes (L2-sized: every weight block of the pass reads all of them), at least 16.
constexpr int64_t kXPassBytes = 256 * 1024;

int rows_per_pass(int K) {
  return int(std::max<int64_t>(16, kXPassBytes / (int64_t(K) * 4)));
}

}  // namespace

void Qmm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  QmmArgs a = product_args(inputs, outputs[0], stream(), group_size_, bits_);
  const int64_t y_item = int64_t(outputs[0].itemsize());
  std::optional<mx::array> r_in;  // [M, N] float32, any strides
  if (residual_) r_in = inputs[4];
  mx::cpu::get_command_encoder(stream()).dispatch([a, x, y_item, r_in]() mutable {
    std::vector<char> r_copy;  // a row-major copy of the residual if it is not
    const float* residual = r_in ? static_cast<const float*>(contiguous_data(*r_in, r_copy)) : nullptr;
    const QmmKernel& k = kernel();
    const QmmQ8Kernel* q8 = k.q8 && (a.bits == 4 || k.q8->bits8) ? k.q8 : nullptr;
    // x as [M, K] float32 in the kernel's order (natural for q8), on a cache line, and its int8 codes: in
    // buffers this thread keeps between calls. Allocated per call, a prefill's x (past glibc's 128 KiB
    // mmap threshold: 57 rows at K = 576) came as fresh pages every time, and their first-touch faults
    // made a 113-row product on the default model's 3072 x 576 weight 1.7x slower (Zen 5 VM).
    thread_local std::vector<float> xbuf, xd, xs;
    thread_local std::vector<int8_t> xq;
    float* xf = aligned(xbuf, size_t(a.M) * a.K);
    const std::vector<int64_t> rows = row_offsets(x);
    const int M = a.M, pass = rows_per_pass(a.K);
    if (q8) {  // x rounded to int8 once for every weight row
      load_x_as(x, rows, 0, M, 8, k.lanes, 0, xf);
      xq.resize(size_t(a.M) * a.K);
      xd.resize(size_t(a.M) * (a.K / 32) * 4);
      xs.resize(size_t(a.M) * (a.K / a.group_size));
      q8->prepare(xf, a.M, a.K, a.group_size, a.bits, xq.data(), xd.data(), xs.data());
    }
    char* y = static_cast<char*>(a.y);
    for (int m0 = 0; m0 < M; m0 += pass) {  // one pass over the weight per `pass` rows of x
      a.M = std::min(pass, M - m0);
      a.x = xf + int64_t(m0) * a.K;
      if (!q8) {  // this pass's rows, in the layout of its row count (the last pass may take fused_wide)
        load_x_as(x, rows, m0, a.M, a.bits, k.lanes, x_block(k, a.M, a.bits), xf + int64_t(m0) * a.K);
      }
      a.y = y + int64_t(m0) * a.ldy * y_item;
      if (q8) {
        a.xq = xq.data() + int64_t(m0) * a.K;
        a.xd = xd.data() + int64_t(m0) * (a.K / 32) * 4;
        a.xs = xs.data() + int64_t(m0) * (a.K / a.group_size);
      }
      split_rows(a.N, a.K, int64_t(a.M) * a.N * a.K, [&](int n0, int n1, float* scratch) {
        if (q8) {
          q8->rows(a, n0, n1);
        } else {
          k.rows(a, n0, n1, scratch);
        }
        if (residual) {  // y = residual + product, this chunk's columns of the pass's rows
          for (int m = 0; m < a.M; ++m) {
            float* yr = static_cast<float*>(a.y) + int64_t(m) * a.ldy;
            const float* rr = residual + (int64_t(m0) + m) * a.N;
            for (int n = n0; n < n1; ++n) yr[n] = rr[n] + yr[n];
          }
        }
      });
    }
  });
}

void Qmm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[qmm] the mlx-infer CPU kernels have no GPU implementation");
}

bool Qmm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const Qmm&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && residual_ == o.residual_;
}

std::vector<mx::Shape> Qmm::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

}  // namespace mlx_infer_kernels
