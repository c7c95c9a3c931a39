// AVX-512 variant (16 floats per register, 4 x 4 register tiles). Compiled with -mavx512f/bw/dq/vl.
#include <immintrin.h>

#include "qmm_body.h"
#include "attn_body.h"

namespace mlx_infer_kernels {
namespace {

struct Avx512 {
  using V = __m512;
  static constexpr int L = 16;
  static constexpr int NB = 4;  // weight rows per block
  static constexpr int MB = 4;  // x rows per register tile (16 accumulators of 32 registers)
  static constexpr int TB = 4;  // the same over the scratch
  // fused_wide for MB < M <= MW rows: four weight rows per call, at 8 bits two above 6 rows. Measured on
  // Zen 4 with x row-major, one weight row per call up to 6 rows and two above (the default model's 30
  // layers of products against the scratch path, interleaved in one process): 0.87x the time at 5-6 rows,
  // 0.92x at 7, 0.94-0.96x at 8-10, 0.98x at 11, 1.05x at 12; 12 and more rows keep the scratch. On the
  // Zen 5 VM (the default model's shapes at group size 32, 2 threads), four rows per call over blocked x
  // took 0.71-0.86x the time of that form at 4 bits and 5-11 rows, and at 8 bits (the 576 x 49152 head)
  // 0.73x at 5 rows, 0.99-1.19x at 8-11, where two rows per call took 0.75-0.77x; not measured on Zen 4.
  static constexpr int MW = 11;
  static constexpr int wide_rows_per_call(int M, int bits) { return bits == 8 && M > 6 ? 2 : 4; }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static float hsum(V v) { return _mm512_reduce_add_ps(v); }
  // Lane i = the sum of v[i]'s lanes, for 16 vectors: pairs of lanes, then of 4-lane blocks, then of
  // 128-bit blocks are added (45 operations instead of 16 horizontal sums).
  static V hsum_each(const V* v) {
    V a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) {  // per 128-bit block: [v0 0+2, v1 0+2, v0 1+3, v1 1+3] of the pair
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    }
    for (int i = 0; i < 4; ++i) {  // per 128-bit block: the block's sum of v[4i .. 4i+3]
      b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int i = 0; i < 2; ++i) {  // blocks 0+1 and 2+3 of b[2i], then of b[2i+1]
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    }
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  // e^x (Cephes' expf polynomial after x = n ln2 + r, |r| <= ln2 / 2; within 2 ulp), 0 below -87.3 (-inf).
  static V exp(V x) {
    const __m512 lo = _mm512_set1_ps(kExpLo);
    const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(kExpHi));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    __m512 p = _mm512_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_mask_blend_ps(under, _mm512_scalef_ps(p, n), _mm512_setzero_ps());
  }
  // 16 bytes -> 32 codes in kernel order: out[0] = low nibbles (codes 0, 2, .., 30), out[1] = high.
  static void codes4(const uint8_t* p, V* out) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
    out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  // 16 bytes -> codes 0..15 and 16..31 in natural order (byte i: code 2i low nibble, 2i+1 high).
  static void codes4_natural(const uint8_t* p, V* out) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));
  }
  static void codes8(const uint8_t* p, V* out) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  }
  static V bcast_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_set1_epi16(short(*p))); }
  static V bcast_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32(*p), 16));
  }
  static float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static uint16_t f2h(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};

}  // namespace

const QmmKernel& kernel_avx512() {
  static const QmmKernel k{"avx512", Avx512::L, Avx512::NB, Avx512::MB, Avx512::MW, &rows<Avx512>,
                           &attend<Avx512>, &paged_attend<Avx512>, &softmax_rows<Avx512>, &swiglu_values<Avx512>,
                           &geglu_values<Avx512>};
  return k;
}

}  // namespace mlx_infer_kernels
