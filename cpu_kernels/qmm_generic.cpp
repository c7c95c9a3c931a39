// Portable variant: 8-float "vectors" as plain arrays that the compiler vectorizes at -O3 (NEON on
// arm64, SSE2 on baseline x86-64). Used where neither AVX-512 nor AVX2 is available.
#include <algorithm>
#include <cmath>

#include "qmm_body.h"
#include "attn_body.h"

namespace mlx_infer_kernels {
namespace {

// IEEE binary16 <-> binary32, round to nearest even (software; hardware __fp16 on arm64).
inline float half_to_float(uint16_t h) {
#if defined(__aarch64__)
  __fp16 v;
  std::memcpy(&v, &h, sizeof v);
  return float(v);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: value = man * 2^-24
      float f = std::ldexp(float(man), -24);
      std::memcpy(&u, &f, sizeof u);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

inline uint16_t float_to_half(float f) {
#if defined(__aarch64__)
  __fp16 v = __fp16(f);
  uint16_t h;
  std::memcpy(&h, &v, sizeof h);
  return h;
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
  if (a < 0x38800000u) {  // subnormal or zero in half: round |f| * 2^24 to an integer (even ties)
    float m = std::nearbyint(std::fabs(f) * 16777216.0f);
    return uint16_t(sign | uint16_t(m));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return uint16_t(sign | ((r - 0x38000000u) >> 13));
#endif
}

struct Generic {
  static constexpr int L = 8;
  static constexpr int NB = 4;
  static constexpr int MB = 2;
  static constexpr int TB = 2;
  static constexpr int MW = 0;  // no fused_wide (not measured where this variant runs)
  static constexpr int wide_rows_per_call(int, int) { return 1; }
  struct V {
    float v[L];
  };
  static V zero() { return V{}; }
  static V load(const float* p) {
    V r;
    for (int i = 0; i < L; ++i) r.v[i] = p[i];
    return r;
  }
  static void store(float* p, V a) {
    for (int i = 0; i < L; ++i) p[i] = a.v[i];
  }
  static V fma(V a, V b, V c) {
    for (int i = 0; i < L; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static V add(V a, V b) {
    for (int i = 0; i < L; ++i) a.v[i] += b.v[i];
    return a;
  }
  static V mul(V a, V b) {
    for (int i = 0; i < L; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static V div(V a, V b) {
    for (int i = 0; i < L; ++i) a.v[i] /= b.v[i];
    return a;
  }
  static V set1(float f) {
    V r;
    for (int i = 0; i < L; ++i) r.v[i] = f;
    return r;
  }
  static float hsum(V a) {
    float s = 0.0f;
    for (int i = 0; i < L; ++i) s += a.v[i];
    return s;
  }
  // Lane i = the sum of v[i]'s lanes (hsum), for L vectors.
  static V hsum_each(const V* v) {
    V r;
    for (int i = 0; i < L; ++i) r.v[i] = hsum(v[i]);
    return r;
  }
  static V max(V a, V b) {
    for (int i = 0; i < L; ++i) a.v[i] = std::max(a.v[i], b.v[i]);
    return a;
  }
  static float hmax(V a) {
    float m = a.v[0];
    for (int i = 1; i < L; ++i) m = std::max(m, a.v[i]);
    return m;
  }
  static V exp(V a) {
    for (int i = 0; i < L; ++i) a.v[i] = std::exp(a.v[i]);
    return a;
  }
  // L bytes -> 2L codes in kernel order: out[0] = low nibbles (codes 0, 2, ..), out[1] = high.
  static void codes4(const uint8_t* p, V* out) {
    for (int i = 0; i < L; ++i) {
      out[0].v[i] = float(p[i] & 0x0f);
      out[1].v[i] = float(p[i] >> 4);
    }
  }
  static void codes4_natural(const uint8_t* p, V* out) {  // byte i: code 2i low, 2i+1 high nibble
    for (int i = 0; i < L / 2; ++i) {
      out[0].v[2 * i] = float(p[i] & 0x0f);
      out[0].v[2 * i + 1] = float(p[i] >> 4);
      out[1].v[2 * i] = float(p[L / 2 + i] & 0x0f);
      out[1].v[2 * i + 1] = float(p[L / 2 + i] >> 4);
    }
  }
  static void codes8(const uint8_t* p, V* out) {
    for (int i = 0; i < L; ++i) out[0].v[i] = float(p[i]);
  }
  static V bcast_f16(const uint16_t* p) { return set1(h2f(*p)); }
  static V bcast_bf16(const uint16_t* p) { return set1(bf16_to_float(*p)); }
  static float h2f(uint16_t h) { return half_to_float(h); }
  static uint16_t f2h(float f) { return float_to_half(f); }
};

}  // namespace

const QmmKernel& kernel_generic() {
#if defined(__aarch64__)
  static const QmmKernel k{"neon", Generic::L, Generic::NB, Generic::MB, Generic::MW, &rows<Generic>,
                           &attend<Generic>, &paged_attend<Generic>, &softmax_rows<Generic>, &swiglu_values<Generic>,
                           &geglu_values<Generic>};
#else
  static const QmmKernel k{"generic", Generic::L, Generic::NB, Generic::MB, Generic::MW, &rows<Generic>,
                           &attend<Generic>, &paged_attend<Generic>, &softmax_rows<Generic>, &swiglu_values<Generic>,
                           &geglu_values<Generic>};
#endif
  return k;
}

}  // namespace mlx_infer_kernels
