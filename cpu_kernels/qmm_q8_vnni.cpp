// The int8-activation product on AVX-512 VNNI: vpdpbusd sums u8 x s8 quadruples exactly into int32 (no
// intermediate saturation, so 8-bit codes too). 4-bit weights: four chunks of 32 per 512-bit step (one per
// 128-bit lane); 8-bit: two (one per 256-bit half). Compiled with -mavx512f/bw/dq/vl -mavx512vnni -mfma
// -mf16c.
#include "qmm_q8_body.h"

namespace mlx_infer_kernels {
namespace {

struct VnniQ8 {
  using I = __m512i;
  using F = __m512;
  static constexpr int C4 = 4;  // chunks per 4-bit step: one per 128-bit lane
  static constexpr int MB = 4;  // x rows per register tile: 16 accumulators of 32 registers
  static constexpr bool bits8 = true;
  static F fzero() { return _mm512_setzero_ps(); }
  // 16 bytes per chunk of x (its even- or odd-indexed values); Tail: cn < 4 chunks, the rest zero.
  template <bool Tail>
  static I load_x16(const int8_t* p, int cn) {
    if constexpr (Tail) return _mm512_maskz_loadu_epi8((__mmask64(1) << (cn * 16)) - 1, p);
    return _mm512_loadu_si512(p);
  }
  template <bool Tail>
  static F load_dx(const float* p, int cn) {
    if constexpr (Tail) return _mm512_maskz_loadu_ps(__mmask16((1u << (cn * 4)) - 1), p);
    return _mm512_loadu_ps(p);
  }
  // 16 bytes per chunk -> lo: its low nibbles (even-indexed codes), hi: its high nibbles, a lane per chunk.
  template <bool Tail>
  static void codes4(const uint8_t* p, int cn, I& lo, I& hi) {
    __m512i b;
    if constexpr (Tail) {
      b = _mm512_maskz_loadu_epi8((__mmask64(1) << (cn * 16)) - 1, p);
    } else {
      b = _mm512_loadu_si512(p);
    }
    const __m512i mask = _mm512_set1_epi8(0x0f);
    lo = _mm512_and_si512(b, mask);
    hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), mask);
  }
  // Lane l (4 floats) = d[l].
  static F lane_scales(__m128 d) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d));
  }
  static I dot2(I lo, I xe, I hi, I xo) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
  }
  // 8-bit: 64 codes (chunks c, c + 1) per step, x in its own order.
  template <bool One>
  static I load_x8(const int8_t* p) {
    if constexpr (One) return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_loadu_si512(p);
  }
  // [dx(c) x 8, dx(c + 1) x 8] from the 4-per-chunk layout (One: dx(c) everywhere; x's upper half is 0).
  template <bool One>
  static F load_dx8(const float* p) {
    if constexpr (One) return _mm512_set1_ps(p[0]);
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(_mm256_loadu_ps(p)));
  }
  template <bool One>
  static I codes8(const uint8_t* p) { return load_x8<One>(reinterpret_cast<const int8_t*>(p)); }
  static F pair(float d0, float d1) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0)), _mm256_set1_ps(d1), 1);
  }
  static I dot(I q, I x) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x); }
  // acc + (b[b0 + g] * xs[g] for g < G, 16 per step, the last ones through masked loads).
  template <Dtype DT>
  static F bias_acc(const void* b, int64_t b0, const float* xs, int G, F acc) {
    for (int g = 0; g < G; g += 16) {
      const __mmask16 k = G - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (G - g)) - 1);
      __m512 bv;
      if constexpr (DT == Dtype::f32) {
        bv = _mm512_maskz_loadu_ps(k, static_cast<const float*>(b) + b0 + g);
      } else {
        const __m256i h = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(b) + b0 + g);
        if constexpr (DT == Dtype::f16) {
          bv = _mm512_cvtph_ps(h);
        } else {
          bv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
      }
      acc = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(k, xs + g), acc);
    }
    return acc;
  }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace

const QmmQ8Kernel& q8_avx512_vnni() {
  static const QmmQ8Kernel k{VnniQ8::bits8, &q8_prepare_x<VnniQ8::C4>, &q8_rows<VnniQ8>};
  return k;
}

}  // namespace mlx_infer_kernels
