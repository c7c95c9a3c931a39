// Metal's words and built-ins for a host C++ compiler (g++ / clang++, C++17), so that the Metal source
// `mx.fast.metal_kernel` generates (the "golden source": signature, template and host_name instantiation
// included) compiles on a machine without a Metal compiler. The tests compile it with -fsyntax-only
// (syntax, names, types of every instantiation) and, with metal_emu.h, run it on the CPU.
//
// What maps to what:
//   device / constant      -> nothing (host pointers);  thread -> nothing (in metal_poison.h, as it
//                             would clash with std::thread in host code)
//   threadgroup            -> static thread_local: one copy per OS thread, and the emulator runs each
//                             threadgroup's threads as fibers of one fresh OS thread, so the array is shared
//                             by exactly the threads of one threadgroup and starts zeroed. A body may only
//                             use `threadgroup` to declare arrays at kernel scope (all MLX kernels can).
//   [[kernel]], [[buffer(i)]], [[host_name(..)]], thread attributes -> unknown attributes (ignored, so
//                             compile with -Wno-attributes; the tests check the attribute names themselves)
//   half / float16_t       -> _Float16;  bfloat / bfloat16_t -> a 16-bit struct rounding to nearest even
//   uint, ushort, uchar, vector types uint2/3/4, int2/3/4, float2/3/4, half2/4
//   metal:: math (float), metal::threadgroup_barrier, metal::mem_flags, metal::simd_* -> declared here,
//                             implemented by the emulator (metal_emu.h)
// metal_poison.h, included after this (and after metal_emu.h) and before the kernel sources, poisons the
// words Metal kernels lack (double, std, printf, malloc, ...).

#ifndef MLX_INFER_METAL_SHIM_H
#define MLX_INFER_METAL_SHIM_H

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"

#define device
#define constant
#define threadgroup static thread_local

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef _Float16 half;

// bfloat (Metal 3.1): storage 16 bits, converts to float exactly and from float rounding to nearest even.
struct bfloat {
  uint16_t bits_;
  bfloat() = default;
  bfloat(float f) : bits_(bf16_bits_from_float(f)) {}  // NOLINT: implicit, as Metal's
  bfloat(half h) : bfloat(float(h)) {}
  operator float() const { return bf16_bits_to_float(bits_); }
};

// The scalar typedefs MLX's Metal preamble (kernels/utils.h, bf16.h) gives every custom kernel.
typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename S>
struct metal_vec2 { S x, y; };
template <typename S>
struct metal_vec3 { S x, y, z; };
template <typename S>
struct metal_vec4 { S x, y, z, w; };
typedef metal_vec2<uint> uint2;
typedef metal_vec3<uint> uint3;
typedef metal_vec4<uint> uint4;
typedef metal_vec2<int> int2;
typedef metal_vec3<int> int3;
typedef metal_vec4<int> int4;
typedef metal_vec2<float> float2;
typedef metal_vec3<float> float3;
typedef metal_vec4<float> float4;
typedef metal_vec2<half> half2;
typedef metal_vec4<half> half4;

namespace metal {

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

// Synchronization and SIMD-group collectives: implemented by the emulator (metal_emu.h).
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);
template <typename U>
U simd_sum(U v);
template <typename U>
U simd_max(U v);
template <typename U>
U simd_shuffle_xor(U v, ushort mask);
template <typename U>
U simd_shuffle_down(U v, ushort delta);
template <typename U>
U simd_shuffle(U v, ushort lane);
template <typename U>
U simd_broadcast_first(U v);

// metal:: math on float.
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float abs(float a) { return std::fabs(a); }
inline float exp(float a) { return std::exp(a); }
inline float log(float a) { return std::log(a); }
inline float sqrt(float a) { return std::sqrt(a); }
inline float rsqrt(float a) { return 1.0f / std::sqrt(a); }
inline int max(int a, int b) { return a > b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline uint max(uint a, uint b) { return a > b ? a : b; }
inline uint min(uint a, uint b) { return a < b ? a : b; }

}  // namespace metal

#endif  // MLX_INFER_METAL_SHIM_H

