// CUDA's device words for a host C++ compiler (g++ / clang++, C++17), and an emulation of a block and its
// warps on the CPU, so that the CUDA source `mx.fast.cuda_kernel` builds (MLX's default header, the prelude
// cuda_kernels/metal_prelude.cuh as the kernel's header, then the __global__ function with the Metal body)
// runs unchanged on a machine without a GPU. The tests compile that source with g++ and -I cuda_kernels/host/emu,
// whose stand-ins for mlx/backend/cuda/device/utils.cuh and <cooperative_groups.h> include this header.
//
// The execution model is emu_core.h's (shared with metal_kernels/host/metal_emu.h): each block runs on a fresh
// OS thread, its threads as fibers, switched only at __syncthreads and at warp collectives, so a missing
// barrier or a wrong reduction deterministically gives wrong results. What maps to what:
//   __global__ / __device__ / __host__  -> nothing;  __forceinline__ -> inline
//   __shared__                          -> static thread_local (one copy per block, zeroed; as metal_shim.h's
//                                          `threadgroup`, so only arrays at kernel scope)
//   threadIdx, blockIdx, blockDim, gridDim -> the running fiber's thread attributes (uint3)
//   __syncthreads                       -> a barrier of the whole block
//   __shfl_sync / __shfl_xor_sync / __shfl_down_sync, __syncwarp -> warp collectives with CUDA's lane rules
//                                          (source lane modulo the width; a xor or down source past the width
//                                          keeps the lane's own value). Every lane the mask names must reach
//                                          the same call; only full-warp masks (0xffffffff) and width 32 are
//                                          emulated, anything else is reported as an error, as is a lane of
//                                          the mask that has returned (or does not exist: a block that is not
//                                          a whole number of warps);
//   __half / __nv_bfloat16              -> 16-bit types converting to float exactly and from float rounding to
//                                          nearest even, as cuda_fp16.h / cuda_bf16.h do
//   rsqrtf, make_uint3                  -> host definitions; the other float math is the C library's.

#ifndef MLX_INFER_CUDA_EMU_H
#define MLX_INFER_CUDA_EMU_H

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

typedef unsigned int uint;
struct uint3 {
  unsigned int x, y, z;
};
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return {x, y, z}; }

#include "../../metal_kernels/host/bf16_bits.h"
#include "../../metal_kernels/host/emu_core.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local

// CUDA's built-in variables, through functions: the prelude's macros of Metal's attribute names (which are
// emu::ThreadAttrs's member names) must not reach the member accesses.
namespace emu {
inline uint3 thread_idx() { return current_attrs().thread_position_in_threadgroup; }
inline uint3 block_idx() { return current_attrs().threadgroup_position_in_grid; }
inline uint3 block_dim() { return current_attrs().threads_per_threadgroup; }
inline uint3 grid_dim() { return current_attrs().threadgroups_per_grid; }
}  // namespace emu
#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx())
#define blockDim (::emu::block_dim())
#define gridDim (::emu::grid_dim())

// cuda::std (libcu++) as far as MLX's default header uses it: `inf`.
namespace cuda {
namespace std {
using ::std::numeric_limits;
}  // namespace std
}  // namespace cuda

inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }

// cuda_fp16.h's __half: IEEE binary16.
struct __half {
  _Float16 value_;
  __half() = default;
  __half(float f) : value_(_Float16(f)) {}  // NOLINT: implicit, as CUDA's
  operator float() const { return float(value_); }
};

// cuda_bf16.h's __nv_bfloat16: the top 16 bits of a float, rounded to nearest even.
struct __nv_bfloat16 {
  uint16_t bits_;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : bits_(bf16_bits_from_float(f)) {}  // NOLINT: implicit, as CUDA's
  operator float() const { return bf16_bits_to_float(bits_); }
};

namespace emu {

enum class WarpOp { shfl_idx, shfl_xor, shfl_down, syncwarp };

inline const char* warp_op_name(WarpOp op) {
  switch (op) {
    case WarpOp::shfl_idx: return "__shfl_sync";
    case WarpOp::shfl_xor: return "__shfl_xor_sync";
    case WarpOp::shfl_down: return "__shfl_down_sync";
    case WarpOp::syncwarp: return "__syncwarp";
  }
  return "?";
}

// CUDA's rules for one warp collective: every lane of the (full) mask present with the same mask.
template <typename U>
std::string combine_warp(Fiber** lanes) {
  Fiber* any = nullptr;
  for (int l = 0; l < kSimdWidth && !any; ++l) any = lanes[l];
  const char* name = any->name;
  for (int l = 0; l < kSimdWidth; ++l) {
    if (lanes[l] == nullptr) {
      return std::string(name) + " with a full mask, but lane " + std::to_string(l) +
             " has returned (or the block is not a whole number of warps)";
    }
    if (lanes[l]->mask != 0xffffffffu) {
      return std::string(name) + " with mask " + std::to_string(lanes[l]->mask) +
             ": only full-warp masks (0xffffffff) are emulated";
    }
  }
  U v[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) std::memcpy(&v[l], lanes[l]->in, sizeof(U));
  for (int l = 0; l < kSimdWidth; ++l) {
    Fiber& f = *lanes[l];
    uint src = uint(l);
    switch (WarpOp(f.op)) {
      case WarpOp::shfl_idx: src = f.arg % uint(kSimdWidth); break;
      case WarpOp::shfl_xor: src = uint(l) ^ f.arg; break;
      case WarpOp::shfl_down: src = uint(l) + f.arg; break;
      case WarpOp::syncwarp: break;
    }
    const U r = src < uint(kSimdWidth) ? v[src] : v[l];
    std::memcpy(f.out, &r, sizeof(U));
  }
  return "";
}

template <typename U>
U warp_collective(WarpOp op, unsigned int mask, U v, uint arg, int width) {
  if (width != kSimdWidth) fail(std::string(warp_op_name(op)) + " with width " + std::to_string(width) +
                                ": only width 32 is emulated");
  return collective<U>(&combine_warp<U>, int(op), warp_op_name(op), v, arg, mask);
}

}  // namespace emu

inline void __syncthreads() { emu::block(emu::Wait::barrier); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
  emu::warp_collective<uint>(emu::WarpOp::syncwarp, mask, 0u, 0u, emu::kSimdWidth);
}
template <typename T>
T __shfl_sync(unsigned int mask, T var, int src_lane, int width = 32) {
  return emu::warp_collective<T>(emu::WarpOp::shfl_idx, mask, var, uint(src_lane), width);
}
template <typename T>
T __shfl_xor_sync(unsigned int mask, T var, int lane_mask, int width = 32) {
  return emu::warp_collective<T>(emu::WarpOp::shfl_xor, mask, var, uint(lane_mask), width);
}
template <typename T>
T __shfl_down_sync(unsigned int mask, T var, unsigned int delta, int width = 32) {
  return emu::warp_collective<T>(emu::WarpOp::shfl_down, mask, var, delta, width);
}

#endif  // MLX_INFER_CUDA_EMU_H
