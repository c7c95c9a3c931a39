// The Metal words of the metal_kernels/*.metal bodies, mapped to CUDA, so that the same body compiles as
// the body of `mx.fast.cuda_kernel` (passed as its `header`). MLX puts the body in a
// `__global__ void name(...)` of `namespace mlx::core::cu`, after including
// mlx/backend/cuda/device/utils.cuh (which brings cuda_fp16.h / cuda_bf16.h); it declares the template
// constants as `constexpr int` / `using T = ...` at the top of the function, and adds no thread
// attributes: the names Metal passes as kernel arguments are macros over CUDA's own built-ins here.
//
// Assumptions a body must keep: no `device` / `constant` words (pointers come from the signature); a 1-D
// threadgroup (blockDim.y == blockDim.z == 1) whose size is a
// multiple of 32; `threadgroup` only declares arrays at kernel scope; SIMD-group reductions are called by all 32
// lanes of a warp (full mask).

#ifndef MLX_INFER_METAL_PRELUDE_CUH
#define MLX_INFER_METAL_PRELUDE_CUH

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// Address spaces: threadgroup memory is __shared__. `device` and `constant` only appear in the signatures
// MLX writes for Metal, never in a body, and cannot be macros here: CUDA's own __device__ / __constant__
// expand to __attribute__((device)) / ((constant)) where they are used.
#define threadgroup __shared__

// Thread attributes (Metal kernel arguments) from CUDA's built-ins, for 1-D threadgroups.
#define thread_index_in_threadgroup (threadIdx.x)
#define thread_index_in_simdgroup (threadIdx.x & 31u)
#define simdgroup_index_in_threadgroup (threadIdx.x >> 5)
#define simdgroups_per_threadgroup ((blockDim.x + 31u) >> 5)
#define threads_per_simdgroup (32u)
#define thread_execution_width (32u)
#define threadgroup_position_in_grid (blockIdx)
#define threadgroups_per_grid (gridDim)
#define threads_per_threadgroup (blockDim)
#define thread_position_in_threadgroup (threadIdx)
#define thread_position_in_grid \
  (make_uint3(blockIdx.x * blockDim.x + threadIdx.x, blockIdx.y * blockDim.y + threadIdx.y, \
              blockIdx.z * blockDim.z + threadIdx.z))

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

// Metal's threadgroup_barrier orders the named memory for the whole threadgroup: __syncthreads does
// both (and device-memory visibility within the block).
__device__ __forceinline__ void threadgroup_barrier(mem_flags) { __syncthreads(); }
__device__ __forceinline__ void simdgroup_barrier(mem_flags) { __syncwarp(); }

// SIMD-group (warp) collectives over all 32 lanes.
template <typename U>
__device__ __forceinline__ U simd_sum(U v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
template <typename U>
__device__ __forceinline__ U simd_max(U v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const U o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = o > v ? o : v;
  }
  return v;
}
template <typename U>
__device__ __forceinline__ U simd_shuffle_xor(U v, ushort mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
template <typename U>
__device__ __forceinline__ U simd_shuffle_down(U v, ushort delta) {
  return __shfl_down_sync(0xffffffffu, v, delta);
}
template <typename U>
__device__ __forceinline__ U simd_shuffle(U v, ushort lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}
template <typename U>
__device__ __forceinline__ U simd_broadcast_first(U v) {
  return __shfl_sync(0xffffffffu, v, 0);
}

// metal:: math used by bodies, on float.
__device__ __forceinline__ float fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ float min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ float abs(float a) { return fabsf(a); }
__device__ __forceinline__ float exp(float a) { return expf(a); }
__device__ __forceinline__ float log(float a) { return logf(a); }
__device__ __forceinline__ float sqrt(float a) { return sqrtf(a); }
__device__ __forceinline__ float rsqrt(float a) { return rsqrtf(a); }

}  // namespace metal

#endif  // MLX_INFER_METAL_PRELUDE_CUH
