// bfloat16 as 16 bits for the host emulators (metal_shim.h's `bfloat`, cuda_emu.h's `__nv_bfloat16`): the top
// 16 bits of a float, converted from float rounding to nearest even (NaN kept quiet) and back to float exactly,
// as Metal 3.1 and cuda_bf16.h do.

#ifndef MLX_INFER_BF16_BITS_H
#define MLX_INFER_BF16_BITS_H

#include <cstdint>
#include <cstring>

inline uint16_t bf16_bits_from_float(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) {
    return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  }
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#endif  // MLX_INFER_BF16_BITS_H
