// Attention over a quantized KV cache, written once over the SIMD trait S of qmm_body.h (included after
// it, by one translation unit per instruction set, inside an anonymous namespace).
//
// Per tile of kAttnTile keys: dequantize the tile's K rows into an L1 scratch (the packed rows are read
// once for all R query rows: the heads of a GQA group and the verify positions), score every row
// against them, dequantize the V rows and fold the tile into each row's online softmax (running max m,
// sum l, unnormalized acc). The caller merges the partials of a head's key ranges (flash-decoding).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "qmm_kernel.h"

namespace mlx_infer_kernels {
namespace {

inline int64_t dtype_bytes(Dtype dt) {
  return dt == Dtype::f32 ? 4 : 2;
}

// The QmmArgs whose rows are head h's token rows of one packed cache (w [H, C, dim * bits / 32]).
inline QmmArgs head_rows(const uint32_t* w, const void* scales, const void* biases, Dtype dt, int h, int C,
                         int dim, int group_size, int bits) {
  QmmArgs r{};
  const int64_t groups = dim / group_size;
  const int64_t offset = int64_t(h) * C * groups * dtype_bytes(dt);
  r.w = w + int64_t(h) * C * dim * bits / 32;
  r.scales = static_cast<const uint8_t*>(scales) + offset;
  r.biases = static_cast<const uint8_t*>(biases) + offset;
  r.K = dim;
  r.G = dim / group_size;
  r.group_size = group_size;
  r.bits = bits;
  r.sb_dtype = dt;
  return r;
}

template <class S>
inline void dequant_tile(const QmmArgs& rows, int bits, int t0, int n, float* out) {
  for (int j = 0; j < n; ++j) {
    if (bits == 4) {
      dequant_row<S, 4, true>(rows, t0 + j, out + int64_t(j) * rows.K);
    } else {
      dequant_row<S, 8, true>(rows, t0 + j, out + int64_t(j) * rows.K);
    }
  }
}

// Channel keys (KIVI): tokens [t0, t0 + n) of head h as float rows out [n, D]; the tokens lie in one
// group of group_size tokens (t0 a multiple of kAttnTile, group_size a multiple of it).
template <class S>
inline void dequant_channel_tile(const AttnArgs& a, int h, int t0, int n, float* out) {
  const int64_t words = int64_t(a.C) * a.k_bits / 32;  // packed words per channel row
  const int64_t groups = a.C / a.group_size;
  const int64_t g = t0 / a.group_size;
  const uint32_t mask = (1u << a.k_bits) - 1u;
  const int per_word = 32 / a.k_bits;
  for (int d = 0; d < a.D; ++d) {
    const int64_t row = int64_t(h) * a.D + d;
    const float s = load_param<S>(a.k_scales, row * groups + g, a.k_dtype);
    const float b = load_param<S>(a.k_biases, row * groups + g, a.k_dtype);
    const uint32_t* w = a.k + row * words;
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      const uint32_t code = (w[t / per_word] >> (a.k_bits * (t % per_word))) & mask;
      out[int64_t(j) * a.D + d] = s * float(code) + b;
    }
  }
}

template <class S>
inline float dot(const float* a, const float* b, int n) {
  using V = typename S::V;
  V acc = S::zero();
  for (int i = 0; i < n; i += S::L) {
    acc = S::fma(S::load(a + i), S::load(b + i), acc);
  }
  return S::hsum(acc);
}

template <class S>
void attend(const AttnArgs& a, int h, int s0, int s1, AttnPartial out, float* scratch) {
  using V = typename S::V;
  constexpr int T = kAttnTile;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* kt = scratch;                  // [T, D]
  float* vt = kt + int64_t(T) * a.D;    // [T, Dv]
  float* sc = vt + int64_t(T) * a.Dv;   // [R, T] scores, then probabilities
  const QmmArgs krows = a.channel_keys ? QmmArgs{}
      : head_rows(a.k, a.k_scales, a.k_biases, a.k_dtype, h, a.C, a.D, a.group_size, a.k_bits);
  const QmmArgs vrows = head_rows(a.v, a.v_scales, a.v_biases, a.v_dtype, h, a.Cv, a.Dv, a.group_size, a.v_bits);
  const float* q = a.q + int64_t(h) * a.R * a.D;
  for (int r = 0; r < a.R; ++r) {
    out.m[r] = neg_inf;
    out.l[r] = 0.0f;
    for (int d = 0; d < a.Dv; ++d) out.acc[int64_t(r) * a.Dv + d] = 0.0f;
  }
  for (int t0 = s0; t0 < s1; t0 += T) {
    const int n = std::min(T, s1 - t0);
    if (a.channel_keys) {
      dequant_channel_tile<S>(a, h, t0, n, kt);
    } else {
      dequant_tile<S>(krows, a.k_bits, t0, n, kt);
    }
    for (int r = 0; r < a.R; ++r) {
      const int last = a.S - a.P + r % a.P;  // the last key row r sees
      const float* qr = q + int64_t(r) * a.D;
      for (int j = 0; j < n; ++j) {
        sc[r * T + j] = t0 + j <= last ? a.scale * dot<S>(qr, kt + int64_t(j) * a.D, a.D) : neg_inf;
      }
    }
    dequant_tile<S>(vrows, a.v_bits, t0, n, vt);
    for (int r = 0; r < a.R; ++r) {
      float* p = sc + r * T;
      float tile_max = neg_inf;
      for (int j = 0; j < n; ++j) tile_max = std::max(tile_max, p[j]);
      if (tile_max == neg_inf) continue;  // every key of the tile is after this row's position
      const float m_new = std::max(out.m[r], tile_max);
      const float alpha = std::exp(out.m[r] - m_new);  // 0 for the first tile (m = -inf)
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - m_new);
        sum += p[j];
      }
      out.l[r] = out.l[r] * alpha + sum;
      out.m[r] = m_new;
      float* acc = out.acc + int64_t(r) * a.Dv;
      const V va = S::set1(alpha);
      for (int d = 0; d < a.Dv; d += S::L) {
        V o = S::fma(S::load(acc + d), va, S::zero());
        for (int j = 0; j < n; ++j) {
          o = S::fma(S::set1(p[j]), S::load(vt + int64_t(j) * a.Dv + d), o);
        }
        S::store(acc + d, o);
      }
    }
  }
}

}  // namespace
}  // namespace mlx_infer_kernels
