// What the CPU kernels' MLX operations share (the functions are defined in qmm.cpp): the instruction-set variant in use,
// per-thread scratch, dtype and operand checks.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "qmm_kernel.h"
#include "thread_pool.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// The variant picked for this CPU (or by $MLX_INFER_KERNEL_ISA), once per process.
const QmmKernel& kernel();
// n floats of this thread's scratch, starting on a cache line (valid until its next call).
float* thread_scratch(size_t n);
// The kernel dtype of float32 / float16 / bfloat16; throws std::invalid_argument naming `what` otherwise.
Dtype to_kernel_dtype(mx::Dtype t, const char* what);
// Whether t is float32, float16 or bfloat16 (the float dtypes the kernels take).
bool is_float_type(mx::Dtype t);
// "[d0, d1, ...]".
std::string shape_str(const mx::array& a);

// Throw std::invalid_argument "[op] <what>bits must be 4 or 8, got N" / "[op] group_size must be 32, 64 or
// 128, got N" for a bit width / group size the kernels do not take (what: "" or e.g. "k ").
void check_bits(int bits, const std::string& op, const std::string& what = "");
void check_group_size(int group_size, const std::string& op);
// `a`, or a row-contiguous copy of it when it may not be when the kernel runs.
mx::array row_contiguous(const mx::array& a, mx::Stream s);
// The CPU stream of `s`; throws std::invalid_argument for a GPU stream.
mx::Stream cpu_stream(mx::StreamOrDevice s);
// Element offsets of the rows of `a` (ndim >= 1, any strides): one per index of its leading ndim - 1
// dimensions, in row-major order; row i's element j is at data + offsets[i] + j * strides.back().
std::vector<int64_t> row_offsets(const mx::array& a);
// The bytes of `a` in row-major order: its own buffer when it is row-contiguous, else a copy made into
// `scratch` (call inside the dispatched task: the data is ready then). Lets an operation take an input as
// it comes instead of adding a copy operation to the graph for every lazily computed input.
const void* contiguous_data(const mx::array& a, std::vector<char>& scratch);
// Throws std::runtime_error when `a` is not row-contiguous.
void require_row_contiguous(const mx::array& a, const char* what);
// n floats of `buffer`, starting on a cache line.
float* aligned(std::vector<float>& buffer, size_t n);
// Checks a quantized weight's operands (bits, group size, shapes, dtypes); returns N and K.
std::pair<int, int> check_weights(
    const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits);
// The start of a matmul primitive's eval_cpu: the weight (inputs[first]), scales and biases must be
// row-contiguous; `out` gets its buffer; every input and the output are registered with the stream's CPU
// command encoder. Returns QmmArgs with the weight fields filled in (the caller adds x, y, M, N, K, G).
QmmArgs weight_args(const std::vector<mx::array>& inputs, size_t first, mx::array& out, mx::Stream stream,
                    int group_size, int bits);
// QmmArgs of a product primitive whose inputs are x [M, K], w, scales, biases (weight_args, then x's shape
// and the output's buffer and dtype; every group read).
QmmArgs product_args(const std::vector<mx::array>& inputs, mx::array& out, mx::Stream stream, int group_size,
                     int bits);
// load_x (below) for x of dtype float32, float16 or bfloat16: rows [m0, m0 + M) of x [..., K] (any strides;
// its rows are those of row_offsets(x), given as `rows`) as float32 [M, K] at dst.
void load_x_as(const mx::array& x, const std::vector<int64_t>& rows, int m0, int M, int bits, int lanes, int block,
               float* dst);

// Products smaller than this (M * N * K multiply-adds) run on one thread: splitting them costs more
// than it saves (measured with bench/kernels.py on 2 cores).
constexpr int64_t kParallelMinMacs = 1 << 18;
// Chunks of rows per thread in a split product (later chunks balance a core that was busy).
constexpr int kChunksPerThread = 4;

// Calls fn(n0, n1, scratch) over [0, N) in chunks of whole row blocks, on one thread for small work.
template <class F>
void split_rows(int N, int K, int64_t macs, F&& fn) {
  const QmmKernel& k = kernel();
  ThreadPool& pool = ThreadPool::instance();
  const size_t scratch_floats = size_t(k.rows_per_block) * K;
  if (macs < kParallelMinMacs || pool.size() == 1) {
    fn(0, N, thread_scratch(scratch_floats));
    return;
  }
  const int rb = k.rows_per_block;
  const int blocks = (N + rb - 1) / rb;
  const int chunks = std::max(1, std::min(blocks, pool.size() * kChunksPerThread));
  const int per_chunk = (blocks + chunks - 1) / chunks * rb;  // rows, a multiple of rb
  const int n_chunks = (N + per_chunk - 1) / per_chunk;
  pool.parallel_for(n_chunks, [&](int c) {
    const int n0 = c * per_chunk;
    fn(n0, std::min(N, n0 + per_chunk), thread_scratch(scratch_floats));
  });
}

// x's M rows (row m at src + rows[m], element k at + k * sk) as float32 dst [M, K], in the kernel's
// order: for bits 4 each block of 2 * lanes values holds its even-indexed values first, then the odd
// ones (the order the kernel unpacks 4-bit codes in, see qmm_body.h). block 0: row-major; else blocked
// as x_block (qmm_kernel.h) describes (block a multiple of 2 * lanes at bits 4, and a divisor of K).
template <class T>
void load_x(const T* src, const int64_t* rows, int64_t sk, int M, int K, int bits, int lanes, int block,
            float* dst) {
  const int64_t row_step = block ? block : K;                 // from row m to row m + 1 (in a block)
  const int64_t block_step = block ? int64_t(M) * block : 0;  // from a row's block to its next (row-major: + k0)
  for (int m = 0; m < M; ++m) {
    const T* row = src + rows[m];
    float* out = dst + int64_t(m) * row_step;
    const int width = block ? block : K;
    for (int k0 = 0; k0 < K; k0 += width, out += block_step) {
      float* o = out + (block ? 0 : k0);
      if (bits == 4) {
        for (int b = 0; b < width; b += 2 * lanes) {
          for (int i = 0; i < lanes; ++i) {
            o[b + i] = static_cast<float>(row[(k0 + b + 2 * i) * sk]);
            o[b + lanes + i] = static_cast<float>(row[(k0 + b + 2 * i + 1) * sk]);
          }
        }
      } else {
        for (int k = 0; k < width; ++k) {
          o[k] = static_cast<float>(row[(k0 + k) * sk]);
        }
      }
    }
  }
}

// Row offsets 0, step, 2 * step, ... (M of them): the rows of a row-contiguous [M, step] matrix.
std::vector<int64_t> strided_rows(int M, int64_t step);

}  // namespace mlx_infer_kernels
