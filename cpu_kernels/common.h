// What the CPU kernels' MLX operations share (defined in qmm.cpp): the instruction-set variant in use,
// per-thread scratch, dtype and operand checks.
#pragma once

#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"
#include "mlx/utils.h"
#include "qmm_kernel.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// The variant picked for this CPU (or by $MLX_INFER_KERNEL_ISA), once per process.
const QmmKernel& kernel();
// n floats of this thread's scratch, starting on a cache line (valid until its next call).
float* thread_scratch(size_t n);
// The kernel dtype of float32 / float16 / bfloat16; throws std::invalid_argument naming `what` otherwise.
Dtype to_kernel_dtype(mx::Dtype t, const char* what);
// "[d0, d1, ...]".
std::string shape_str(const mx::array& a);
// `a`, or a row-contiguous copy of it when it may not be when the kernel runs.
mx::array row_contiguous(const mx::array& a, mx::Stream s);
// The CPU stream of `s`; throws std::invalid_argument for a GPU stream.
mx::Stream cpu_stream(mx::StreamOrDevice s);
// Throws std::runtime_error when `a` is not row-contiguous.
void require_row_contiguous(const mx::array& a, const char* what);

}  // namespace mlx_infer_kernels
