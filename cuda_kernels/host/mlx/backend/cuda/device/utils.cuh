// A minimal stand-in for MLX's mlx/backend/cuda/device/utils.cuh, which the Linux CPU wheel of MLX does not
// ship: just what `mx.fast.cuda_kernel`'s generated source (its default header and signature) and the
// bodies of metal_kernels/ rely on, so that tests/kernels/test_cuda_qmm.py can compile that source with
// nvcc and bench/gpu_qmm_device.py can launch it through CuPy. On a machine with MLX's CUDA back-end the
// real header is used instead; a body must not rely on anything that is only here.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
// libcu++ (the toolkit's, or CuPy's copy under NVRTC); without it there are no Shape / Strides types.
#if __has_include(<cuda/std/array>)
#include <cuda/std/array>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
#define MLX_INFER_HAVE_LIBCUDACXX 1
#endif

// As mlx/backend/cuda/device/config.h (which the wheel does ship).
#define MAX_NDIM 10
#define WARP_SIZE 32

#ifdef MLX_INFER_HAVE_LIBCUDACXX
namespace mlx::core::cu {

// Types of the `<name>_shape` / `<name>_strides` kernel parameters MLX writes when a body names them.
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;

}  // namespace mlx::core::cu
#endif
