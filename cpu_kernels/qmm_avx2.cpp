// AVX2 + FMA variant (8 floats per register, 2 x 4 register tiles of 16 registers). Compiled with
// -mavx2 -mfma -mf16c.
#include <immintrin.h>

#include "qmm_body.h"
#include "attn_body.h"

namespace mlx_infer_kernels {
namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int L = 8;
  static constexpr int NB = 4;
  static constexpr int MB = 2;  // rows dequantized in registers (fused): 8 accumulators + 8 weights + 1 x
  static constexpr int TB = 3;  // rows per register tile over the scratch: 12 accumulators + 3 x + 1 weight
  // fused_wide for MB < M <= MW rows: two weight rows per call at 3-4 rows (6-8 accumulators), one above
  // (8 accumulators at 8 rows). Measured on a Zen 3 (the default model's 210 layer products and its head
  // at M rows, two builds in one process, interleaved, medians of 12; 1-2 rows, the same code in both,
  // gave 0.97-1.02x): against the scratch path 0.73-0.81x the time at 3-4 rows, 0.84-0.93x at 5-8,
  // 0.98-1.03x at 9, 1.00-1.05x at 11 and 1.45x at 16, so 9 and more rows keep the scratch; two weight
  // rows per call at 5-9 rows measured 0.92-1.16x.
  static constexpr int MW = 8;
  static constexpr int wide_rows_per_call(int M, int) { return M <= 4 ? 2 : 1; }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static float hsum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  // Lane i = the sum of v[i]'s lanes, for 8 vectors: pairs of lanes, then 4-lane blocks, then the two
  // 128-bit halves are added (21 operations instead of 8 horizontal sums).
  static V hsum_each(const V* v) {
    V a[4], b[2];
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 2; ++i) {
      b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hmax(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  // e^x as Avx512::exp (2^n built in the exponent bits), 0 below -87.3 (-inf).
  static V exp(V x) {
    const __m256 lo = _mm256_set1_ps(kExpLo);
    const __m256 kept = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kExpHi));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), kept);
  }
  // 8 bytes -> 16 codes in kernel order: out[0] = low nibbles (codes 0, 2, .., 14), out[1] = high.
  static void codes4(const uint8_t* p, V* out) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    out[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
    out[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  // 8 bytes -> codes 0..7 and 8..15 in natural order (byte i: code 2i low nibble, 2i+1 high).
  static void codes4_natural(const uint8_t* p, V* out) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m128i v = _mm_unpacklo_epi8(lo, hi);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  }
  static void codes8(const uint8_t* p, V* out) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
  }
  static V bcast_f16(const uint16_t* p) { return set1(h2f(*p)); }
  static V bcast_bf16(const uint16_t* p) { return set1(bf16_to_float(*p)); }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

}  // namespace

const QmmKernel& kernel_avx2() {
  static const QmmKernel k{"avx2", Avx2::L, Avx2::NB, Avx2::MB, Avx2::MW, &rows<Avx2>,
                           &attend<Avx2>, &paged_attend<Avx2>, &softmax_rows<Avx2>, &swiglu_values<Avx2>,
                           &geglu_values<Avx2>};
  return k;
}

}  // namespace mlx_infer_kernels
