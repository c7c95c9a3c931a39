// A CPU emulation of Metal's compute execution model, to run the golden source of `mx.fast.metal_kernel`
// kernels (metal_shim.h) on a machine without a GPU: the threadgroups of fibers, barriers and SIMD-group
// collectives of emu_core.h (shared with cuda_kernels/host/cuda_emu.h), with Metal's collectives on top:
// simd_sum / simd_max / simd_shuffle* / simd_broadcast_first compute over the live lanes of the SIMD group
// (a lane that returned does not take part; reading it through a shuffle gives all-ones bits, NaN for floats).

#ifndef MLX_INFER_METAL_EMU_H
#define MLX_INFER_METAL_EMU_H

// emu_core.h's standard headers come before metal_shim.h's `device` / `constant` / `threadgroup` macros;
// emu_core.h itself after it, whose uint3 it uses.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "metal_shim.h"

#include "emu_core.h"

namespace emu {

enum class SimdOp { sum, max, shuffle_xor, shuffle_down, shuffle, broadcast_first };

inline const char* op_name(SimdOp op) {
  switch (op) {
    case SimdOp::sum: return "simd_sum";
    case SimdOp::max: return "simd_max";
    case SimdOp::shuffle_xor: return "simd_shuffle_xor";
    case SimdOp::shuffle_down: return "simd_shuffle_down";
    case SimdOp::shuffle: return "simd_shuffle";
    case SimdOp::broadcast_first: return "simd_broadcast_first";
  }
  return "?";
}

template <typename U>
std::string combine_lanes(Fiber** lanes) {
  U v[kSimdWidth];
  bool live[kSimdWidth];
  for (int l = 0; l < kSimdWidth; ++l) {
    live[l] = lanes[l] != nullptr;
    if (live[l]) std::memcpy(&v[l], lanes[l]->in, sizeof(U));
  }
  U poison;
  std::memset(&poison, 0xff, sizeof(U));  // NaN for float types: reading a dead lane shows up
  int first = 0;
  while (!live[first]) ++first;
  for (int l = 0; l < kSimdWidth; ++l) {
    if (!live[l]) continue;
    Fiber& f = *lanes[l];
    U r = poison;
    switch (SimdOp(f.op)) {
      case SimdOp::sum: {
        float acc = 0.0f;  // accumulated in lane order, in float for float-like types
        U s = U();
        bool any = false;
        for (int j = 0; j < kSimdWidth; ++j) {
          if (!live[j]) continue;
          if constexpr (std::is_integral<U>::value) {
            s = any ? U(s + v[j]) : v[j];
          } else {
            acc += float(v[j]);
          }
          any = true;
        }
        if constexpr (std::is_integral<U>::value) {
          r = s;
        } else {
          r = U(acc);
        }
        break;
      }
      case SimdOp::max: {
        r = v[first];
        for (int j = first + 1; j < kSimdWidth; ++j) {
          if (live[j] && float(v[j]) > float(r)) r = v[j];
        }
        break;
      }
      case SimdOp::shuffle_xor: {
        const uint src = uint(l) ^ f.arg;
        r = src < uint(kSimdWidth) && live[src] ? v[src] : poison;
        break;
      }
      case SimdOp::shuffle_down: {
        const uint src = uint(l) + f.arg;
        r = src < uint(kSimdWidth) && live[src] ? v[src] : v[l];  // Metal: lanes past the end keep theirs
        break;
      }
      case SimdOp::shuffle: {
        const uint src = f.arg;
        r = src < uint(kSimdWidth) && live[src] ? v[src] : poison;
        break;
      }
      case SimdOp::broadcast_first:
        r = v[first];
        break;
    }
    std::memcpy(f.out, &r, sizeof(U));
  }
  return "";
}

template <typename U>
U collective(SimdOp op, U v, uint arg) {
  return collective<U>(&combine_lanes<U>, int(op), op_name(op), v, arg, 0xffffffffu);
}

}  // namespace emu

namespace metal {

inline void threadgroup_barrier(mem_flags) { emu::block(emu::Wait::barrier); }
// A SIMD group executes in lockstep in the emulation's sense only at collectives: a simdgroup_barrier is
// modelled as a collective that moves no data.
inline void simdgroup_barrier(mem_flags) { emu::collective<uint>(emu::SimdOp::broadcast_first, 0u, 0u); }
template <typename U>
U simd_sum(U v) { return emu::collective<U>(emu::SimdOp::sum, v, 0u); }
template <typename U>
U simd_max(U v) { return emu::collective<U>(emu::SimdOp::max, v, 0u); }
template <typename U>
U simd_shuffle_xor(U v, ushort mask) { return emu::collective<U>(emu::SimdOp::shuffle_xor, v, mask); }
template <typename U>
U simd_shuffle_down(U v, ushort delta) { return emu::collective<U>(emu::SimdOp::shuffle_down, v, delta); }
template <typename U>
U simd_shuffle(U v, ushort lane) { return emu::collective<U>(emu::SimdOp::shuffle, v, lane); }
template <typename U>
U simd_broadcast_first(U v) { return emu::collective<U>(emu::SimdOp::broadcast_first, v, 0u); }

}  // namespace metal

#endif  // MLX_INFER_METAL_EMU_H
