// The int8-activation body of the quantized matmul, written once over a small integer-SIMD trait S and
// included by one translation unit per instruction set (qmm_q8_avx2.cpp, qmm_q8_vnni.cpp), inside an
// anonymous namespace.
//
// Algorithm (llama.cpp's Q4_1 x Q8_1 dot product, arXiv 2208.07339's vector-wise int8 idea): each row of x
// is quantized once per call in chunks of 32 values, x[c] ~ dx[c] * xq[c] with xq int8 = round(x / dx),
// dx = max|x[c]| / 127; then for a weight group with scale d and bias b (w = d * q + b)
//   sum_k w_k x_k = d * sum_c dx[c] * (sum_{k in c} q_k xq_k) + b * sum_{k in group} x_k,
// where the inner sums are exact integer dot products (u8 codes x s8 activations: 32 or 64 products per
// instruction) and sum x is taken exactly from the float x. The only error against the float product is
// x's rounding: |y - y_float| <= sum_k |d q_k| * dx[c(k)] / 2 (tests/kernels/test_cpu_qmm.py checks it).
// Every output adds the same terms in the same order whatever the row count and tiling, so a row's
// result does not depend on M (speculative verify reproduces plain decoding's logits exactly).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "qmm_kernel.h"

namespace mlx_infer_kernels {
namespace {

#if defined(__clang__)
#define MLX_INFER_Q8_UNROLL _Pragma("unroll")
#else
#define MLX_INFER_Q8_UNROLL _Pragma("GCC unroll 16")
#endif

constexpr int kQ8Chunk = 32;  // x values per int8 scale
// How far ahead of the codes being read the weight stream is prefetched (bytes), and into which cache:
// L2 (T1). Measured on a Zen 4 VM (the default model's 8-bit output head and its 210 4-bit layer
// products, one row, 2 threads, variants interleaved in one process): the head 1.18-1.24 ms and the layers
// 5.30-5.45 ms with T1 / T2 hints at 8-16 KiB, against 1.70 and 6.11 ms with the non-temporal hint (NTA)
// and 2.44 / 7.27 ms with no software prefetch.
constexpr int64_t kQ8PrefetchBytes = 16384;

__attribute__((always_inline)) inline void q8_prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kQ8PrefetchBytes, _MM_HINT_T1);
}

inline float q8_param(const void* p, int64_t i, Dtype dt) {
  switch (dt) {
    case Dtype::f32:
      return static_cast<const float*>(p)[i];
    case Dtype::f16:
      return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
    default: {
      uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
      float f;
      std::memcpy(&f, &u, sizeof f);
      return f;
    }
  }
}

// x [M, K] float32 in natural order -> xq [M, K] int8, xd [M, K / 32, 4] (each chunk's scale 4 times: one
// per 128-bit lane) and xs [M, G] (x summed over each group read). For bits 4 the chunks are laid out in
// steps of C4 (the last step holds the rest), each step holding the even-indexed values of its chunks (16 bytes
// per chunk, in chunk order) and then the odd-indexed ones: the order the codes unpack in (q8_step4).
// For bits 8 xq keeps x's order.
template <int C4>
void q8_prepare_x(const float* x, int M, int K, int group_size, int bits, int8_t* xq, float* xd, float* xs) {
  const int chunks = K / kQ8Chunk, G = K / group_size;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int m = 0; m < M; ++m) {
    const float* xr = x + int64_t(m) * K;
    int8_t* q = xq + int64_t(m) * K;
    for (int c0 = 0; c0 < chunks;) {
      const int step = bits == 4 ? std::min(C4, chunks - c0) : 1;  // chunks in this step
      for (int c = c0; c < c0 + step; ++c) {
        const float* v = xr + c * kQ8Chunk;
        __m256 part[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          part[i] = _mm256_loadu_ps(v + 8 * i);
          amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, part[i]));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        const float top = _mm_cvtss_f32(h);
        const float d = top / 127.0f;
        const __m256 inv = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
        int32_t r[kQ8Chunk];  // rint(x / d): the default rounding, to nearest even
        for (int i = 0; i < 4; ++i) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inv)));
        }
        if (bits == 4) {
          int8_t* even = q + c0 * kQ8Chunk + (c - c0) * 16;
          int8_t* odd = even + step * 16;
          for (int i = 0; i < 16; ++i) {
            even[i] = int8_t(r[2 * i]);
            odd[i] = int8_t(r[2 * i + 1]);
          }
        } else {
          for (int i = 0; i < kQ8Chunk; ++i) q[c * kQ8Chunk + i] = int8_t(r[i]);
        }
        _mm_storeu_ps(xd + (int64_t(m) * chunks + c) * 4, _mm_set1_ps(d));
      }
      c0 += step;
    }
    for (int g = 0; g < G; ++g) {  // 8 partial sums per group, then their total
      __m256 s = _mm256_setzero_ps();
      for (int i = 0; i < group_size; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + g * group_size + i));
      __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      t = _mm_add_ps(t, _mm_movehl_ps(t, t));
      t = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
      xs[int64_t(m) * G + g] = _mm_cvtss_f32(t);
    }
  }
}

// Scale i of a weight row (dtype DT).
template <Dtype DT>
inline float q8_scale(const void* p, int64_t i) {
  if constexpr (DT == Dtype::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (DT == Dtype::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  } else {
    uint32_t u = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
}

// The scales of chunks c .. c + cn of weight row s0 (cn <= C <= 4) as 4 floats, 0 past cn: one vector
// load where a chunk is a group and the step is whole (no scalar stores for the vector to wait on).
template <Dtype DT, int C, bool TAIL>
__attribute__((always_inline)) inline __m128 q8_scales4(const void* p, int64_t s0, int c, int cpg, int cn) {
  if (!TAIL && cpg == 1) {
    const int64_t i = s0 + c;
    if constexpr (DT == Dtype::f32) {
      const float* f = static_cast<const float*>(p) + i;
      return C == 4 ? _mm_loadu_ps(f) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(f)));
    } else {
      const uint16_t* h = static_cast<const uint16_t*>(p) + i;
      const __m128i v = C == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)) : _mm_loadu_si32(h);
      if constexpr (DT == Dtype::f16) return _mm_cvtph_ps(v);
      return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(v), 16));
    }
  }
  float d[4] = {};
  for (int l = 0; l < cn; ++l) d[l] = q8_scale<DT>(p, s0 + (c + l) / cpg);
  return _mm_setr_ps(d[0], d[1], d[2], d[3]);
}

// One 4-bit step of q8_tile: chunks c .. c + cn (cn = S::C4 unless TAIL; a 128-bit lane per chunk) of MB
// rows against NB weight rows. The codes' low nibbles (even-indexed values) and high nibbles (odd) are
// dotted with x's even and odd values and summed exactly in int32, then scaled by d * dx per lane.
template <class S, Dtype DT, int NB, int MB, bool TAIL>
__attribute__((always_inline)) inline void q8_step4(const QmmArgs& a, const uint8_t* w, int64_t row_bytes,
                                                    int64_t groups, int n, int c, int cn, int cpg,
                                                    const int8_t* xq, const float* xd, int chunks,
                                                    typename S::F (&acc)[MB][NB]) {
  using I = typename S::I;
  using F = typename S::F;
  I xe[MB], xo[MB];
  F dxv[MB];
  MLX_INFER_Q8_UNROLL
  for (int m = 0; m < MB; ++m) {
    const int8_t* xm = xq + int64_t(m) * a.K + c * kQ8Chunk;
    xe[m] = S::template load_x16<TAIL>(xm, cn);
    xo[m] = S::template load_x16<TAIL>(xm + cn * 16, cn);
    dxv[m] = S::template load_dx<TAIL>(xd + (int64_t(m) * chunks + c) * 4, cn);
  }
  MLX_INFER_Q8_UNROLL
  for (int j = 0; j < NB; ++j) {
    const uint8_t* wc = w + j * row_bytes + int64_t(c) * 16;
    q8_prefetch(wc);
    I lo, hi;
    S::template codes4<TAIL>(wc, cn, lo, hi);
    const F dv = S::lane_scales(q8_scales4<DT, S::C4, TAIL>(a.scales, (n + j) * groups, c, cpg, cn));
    MLX_INFER_Q8_UNROLL
    for (int m = 0; m < MB; ++m) {
      acc[m][j] = S::fma(S::cvt(S::dot2(lo, xe[m], hi, xo[m])), S::mul(dv, dxv[m]), acc[m][j]);
    }
  }
}

// One 8-bit step of q8_tile (instruction sets with S::bits8): chunks c, c + 1 (ONE: c only), one per
// 256-bit half, x in its own order.
template <class S, Dtype DT, int NB, int MB, bool ONE>
__attribute__((always_inline)) inline void q8_step8(const QmmArgs& a, const uint8_t* w, int64_t row_bytes,
                                                    int64_t groups, int n, int c, int cpg, const int8_t* xq,
                                                    const float* xd, int chunks, typename S::F (&acc)[MB][NB]) {
  using I = typename S::I;
  using F = typename S::F;
  I xv[MB];
  F dxv[MB];
  MLX_INFER_Q8_UNROLL
  for (int m = 0; m < MB; ++m) {
    xv[m] = S::template load_x8<ONE>(xq + int64_t(m) * a.K + c * kQ8Chunk);
    dxv[m] = S::template load_dx8<ONE>(xd + (int64_t(m) * chunks + c) * 4);
  }
  MLX_INFER_Q8_UNROLL
  for (int j = 0; j < NB; ++j) {
    const uint8_t* wc = w + j * row_bytes + int64_t(c) * kQ8Chunk;
    q8_prefetch(wc);
    const I q = S::template codes8<ONE>(wc);
    const int64_t s0 = (n + j) * groups;
    const float d0 = q8_scale<DT>(a.scales, s0 + c / cpg);
    const F dv = S::pair(d0, ONE ? d0 : q8_scale<DT>(a.scales, s0 + (c + 1) / cpg));
    MLX_INFER_Q8_UNROLL
    for (int m = 0; m < MB; ++m) {
      acc[m][j] = S::fma(S::cvt(S::dot(q, xv[m])), S::mul(dv, dxv[m]), acc[m][j]);
    }
  }
}

// Rows m0..m0+MB of y for weight rows n..n+NB: steps of several chunks of 32 (the tail one by one, through
// S's single-chunk loads); per weight row the codes are unpacked once per step and dotted with each row's
// int8 chunks, then scaled by d * dx; the bias part is added once per output.
template <class S, int BITS, Dtype DT, int NB, int MB>
inline void q8_tile(const QmmArgs& a, int m0, int n) {
  using F = typename S::F;
  const int K = a.K, chunks = K / kQ8Chunk, cpg = a.group_size / kQ8Chunk;
  const int64_t groups = K / a.group_size;
  const int64_t row_bytes = int64_t(K) * BITS / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + int64_t(n) * row_bytes;
  const int8_t* xq = a.xq + int64_t(m0) * K;
  const float* xd = a.xd + int64_t(m0) * chunks * 4;
  F acc[MB][NB];
  MLX_INFER_Q8_UNROLL
  for (int m = 0; m < MB; ++m) {
    MLX_INFER_Q8_UNROLL
    for (int j = 0; j < NB; ++j) acc[m][j] = S::fzero();
  }
  int c = 0;
  if constexpr (BITS == 4) {
    for (; c + S::C4 <= chunks; c += S::C4) {
      q8_step4<S, DT, NB, MB, false>(a, w, row_bytes, groups, n, c, S::C4, cpg, xq, xd, chunks, acc);
    }
    if (c < chunks) {
      q8_step4<S, DT, NB, MB, true>(a, w, row_bytes, groups, n, c, chunks - c, cpg, xq, xd, chunks, acc);
    }
  } else {
    for (; c + 2 <= chunks; c += 2) {
      q8_step8<S, DT, NB, MB, false>(a, w, row_bytes, groups, n, c, cpg, xq, xd, chunks, acc);
    }
    for (; c < chunks; ++c) q8_step8<S, DT, NB, MB, true>(a, w, row_bytes, groups, n, c, cpg, xq, xd, chunks, acc);
  }
  MLX_INFER_Q8_UNROLL
  for (int m = 0; m < MB; ++m) {
    const float* xs = a.xs + int64_t(m0 + m) * groups;
    MLX_INFER_Q8_UNROLL
    for (int j = 0; j < NB; ++j) {
      // the bias part, sum_g b[g] * xs[g], joins the accumulator before its one horizontal sum
      const float y = S::hsum(S::template bias_acc<DT>(a.biases, (n + j) * groups, xs, int(groups), acc[m][j]));
      const int64_t i = int64_t(m0 + m) * a.ldy + n + j;
      switch (a.y_dtype) {
        case Dtype::f32:
          static_cast<float*>(a.y)[i] = y;
          break;
        case Dtype::f16:
          static_cast<uint16_t*>(a.y)[i] = _cvtss_sh(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          break;
        default: {
          uint32_t u;
          std::memcpy(&u, &y, sizeof u);
          if ((u & 0x7fffffffu) > 0x7f800000u) {
            u = (u >> 16) | 0x40u;
          } else {
            u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
          }
          static_cast<uint16_t*>(a.y)[i] = uint16_t(u);
        }
      }
    }
  }
}

// All M rows for weight rows n..n+NB: register tiles of S::MB rows, then one shorter tile.
template <class S, int BITS, Dtype DT, int NB>
inline void q8_block(const QmmArgs& a, int n) {
  int m0 = 0;
  for (; m0 + S::MB <= a.M; m0 += S::MB) q8_tile<S, BITS, DT, NB, S::MB>(a, m0, n);
  switch (a.M - m0) {
    case 1:
      q8_tile<S, BITS, DT, NB, 1>(a, m0, n);
      break;
    case 2:
      if constexpr (S::MB > 2) q8_tile<S, BITS, DT, NB, 2>(a, m0, n);
      break;
    case 3:
      if constexpr (S::MB > 3) q8_tile<S, BITS, DT, NB, 3>(a, m0, n);
      break;
    default:
      break;
  }
}

template <class S, int BITS, Dtype DT>
void q8_rows_typed(const QmmArgs& a, int n0, int n1) {
  constexpr int NB = 4;
  int n = n0;
  for (; n + NB <= n1; n += NB) q8_block<S, BITS, DT, NB>(a, n);
  for (; n < n1; ++n) q8_block<S, BITS, DT, 1>(a, n);
}

template <class S, int BITS>
void q8_rows_bits(const QmmArgs& a, int n0, int n1) {
  switch (a.sb_dtype) {
    case Dtype::f32:
      q8_rows_typed<S, BITS, Dtype::f32>(a, n0, n1);
      break;
    case Dtype::f16:
      q8_rows_typed<S, BITS, Dtype::f16>(a, n0, n1);
      break;
    default:
      q8_rows_typed<S, BITS, Dtype::bf16>(a, n0, n1);
  }
}

template <class S>
void q8_rows(const QmmArgs& a, int n0, int n1) {
  if (a.bits == 4) {
    q8_rows_bits<S, 4>(a, n0, n1);
  } else if constexpr (S::bits8) {
    q8_rows_bits<S, 8>(a, n0, n1);
  }
}

}  // namespace
}  // namespace mlx_infer_kernels
