// The int8-activation product on AVX2: 4-bit weights only (8-bit codes times int8 could overflow
// vpmaddubsw's int16 pair sums), two chunks of 32 per 256-bit step (one per 128-bit lane), u8 x s8 pairs
// through vpmaddubsw, summed to int32 by vpmaddwd. Compiled with -mavx2 -mfma -mf16c.
#include "qmm_q8_body.h"

namespace mlx_infer_kernels {
namespace {

struct Avx2Q8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int C4 = 2;  // chunks per 4-bit step: one per 128-bit lane
  static constexpr int MB = 2;  // x rows per register tile: 8 accumulators of 16 registers
  static constexpr bool bits8 = false;
  static F fzero() { return _mm256_setzero_ps(); }
  // 16 bytes per chunk of x (its even- or odd-indexed values); Tail: the one chunk left (cn is 1).
  template <bool Tail>
  static I load_x16(const int8_t* p, int) {
    if constexpr (Tail) return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  template <bool Tail>
  static F load_dx(const float* p, int) {
    if constexpr (Tail) return _mm256_zextps128_ps256(_mm_loadu_ps(p));
    return _mm256_loadu_ps(p);
  }
  // 16 bytes per chunk -> lo: its low nibbles (even-indexed codes), hi: its high nibbles, a lane per chunk.
  template <bool Tail>
  static void codes4(const uint8_t* p, int, I& lo, I& hi) {
    __m256i b;
    if constexpr (Tail) {
      b = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    }
    const __m256i mask = _mm256_set1_epi8(0x0f);
    lo = _mm256_and_si256(b, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
  }
  // Lane l (4 floats) = d[l].
  static F lane_scales(__m128 d) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  }
  // lo . xe + hi . xo per group of 4 bytes, in int32 (each int16 pair sum is at most 2 * 15 * 128).
  static I dot2(I lo, I xe, I hi, I xo) {
    const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
  }
  // acc + (b[b0 + g] * xs[g] for g < G, 8 per lane group; the last ones through a zero-padded copy).
  template <Dtype DT>
  static F bias_acc(const void* b, int64_t b0, const float* xs, int G, F acc) {
    int g = 0;
    for (; g + 8 <= G; g += 8) acc = _mm256_fmadd_ps(load8<DT>(b, b0 + g), _mm256_loadu_ps(xs + g), acc);
    if (g < G) {
      float bt[8] = {}, xt[8] = {};
      for (int i = 0; g + i < G; ++i) {
        bt[i] = q8_scale<DT>(b, b0 + g + i);
        xt[i] = xs[g + i];
      }
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(bt), _mm256_loadu_ps(xt), acc);
    }
    return acc;
  }
  template <Dtype DT>
  static F load8(const void* p, int64_t i) {
    if constexpr (DT == Dtype::f32) {
      return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
      if constexpr (DT == Dtype::f16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  // The 8-bit step's operations: never called (bits8 is false), declared for q8_step8's instantiation.
  template <bool One>
  static I load_x8(const int8_t* p) { return load_x16<One>(p, 1); }
  template <bool One>
  static F load_dx8(const float* p) { return load_dx<One>(p, 1); }
  template <bool One>
  static I codes8(const uint8_t* p) { return load_x16<One>(reinterpret_cast<const int8_t*>(p), 1); }
  static F pair(float d0, float) { return _mm256_set1_ps(d0); }
  static I dot(I q, I x) { return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1)); }
};

}  // namespace

const QmmQ8Kernel& q8_avx2() {
  static const QmmQ8Kernel k{Avx2Q8::bits8, &q8_prepare_x<Avx2Q8::C4>, &q8_rows<Avx2Q8>};
  return k;
}

}  // namespace mlx_infer_kernels
