// The kernel body, written once over a small SIMD trait S (vector type V of S::L floats, load, store,
// fma, horizontal sum, and the unpacking of 4-bit / 8-bit codes). Included by one translation unit
// per instruction set, inside an anonymous namespace: every function here has internal linkage.
//
// Algorithm (per block of NB weight rows): dequantize each value once (w = scale * q + bias, one fma)
// and multiply it with all M rows of x. For M <= MB the dequantized values stay in registers
// (fused); for more rows they go to a float32 scratch of NB rows that stays in L1 and is
// multiplied in register tiles of TB x NB accumulators (tile). Each weight group is read from memory
// once for all M rows; the accumulation is in float32. Where the variant sets S::MW, M in (S::MB, S::MW]
// stays in registers too (fused_wide: x blocked, read from L1 at each use). Every
// path adds the same products in the same order per output, so a row's result does not depend on M.
// For bits 4 the codes are unpacked as low nibbles then high nibbles (2 operations per vector instead
// of an interleave), so x is reordered once per call to match.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qmm_kernel.h"

// Fully unrolls a loop over register tiles (GCC otherwise leaves some tile heights rolled, with the
// accumulators in memory).
#if defined(__clang__)
#define MLX_INFER_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define MLX_INFER_UNROLL _Pragma("GCC unroll 16")
#else
#define MLX_INFER_UNROLL
#endif

namespace mlx_infer_kernels {
namespace {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as MLX's bfloat16 conversion; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return uint16_t((u >> 16) | 0x40u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

template <class S>
inline float load_param(const void* p, int64_t i, Dtype dt) {
  switch (dt) {
    case Dtype::f32:
      return static_cast<const float*>(p)[i];
    case Dtype::f16:
      return S::h2f(static_cast<const uint16_t*>(p)[i]);
    default:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

template <class S>
inline void store_y(const QmmArgs& a, int m, int n, float v) {
  int64_t i = int64_t(m) * a.ldy + n;
  switch (a.y_dtype) {
    case Dtype::f32:
      static_cast<float*>(a.y)[i] = v;
      break;
    case Dtype::f16:
      static_cast<uint16_t*>(a.y)[i] = S::f2h(v);
      break;
    default:
      static_cast<uint16_t*>(a.y)[i] = float_to_bf16(v);
  }
}

// Sets a tile of MB x NB accumulators to zero.
template <class S, int MB, int NB>
inline void zero_tile(typename S::V (&acc)[MB][NB]) {
  MLX_INFER_UNROLL
  for (int m = 0; m < MB; ++m) {
    MLX_INFER_UNROLL
    for (int j = 0; j < NB; ++j) {
      acc[m][j] = S::zero();
    }
  }
}

// y[m0 + m, n + j] = the sum of acc[m][j]'s lanes, for a tile of MB x NB accumulators.
template <class S, int MB, int NB>
inline void store_tile(const QmmArgs& a, int m0, int n, const typename S::V (&acc)[MB][NB]) {
  MLX_INFER_UNROLL
  for (int m = 0; m < MB; ++m) {
    MLX_INFER_UNROLL
    for (int j = 0; j < NB; ++j) {
      store_y<S>(a, m0 + m, n + j, S::hsum(acc[m][j]));
    }
  }
}

// How far ahead of the group being unpacked the weight stream is prefetched (bytes). Rows are
// contiguous, so this reaches into the row blocks that follow; the hardware prefetcher alone keeps up
// poorly when other programs load the memory bus (measured: 4x slower on the 8-bit lm_head).
constexpr int64_t kPrefetchBytes = 16384;

// Codes per unpacking step: S::L bytes hold 2L 4-bit codes or L 8-bit codes.
template <class S, int BITS>
constexpr int kStep = BITS == 4 ? 2 * S::L : S::L;

// Weight row n as float32 into out[0:x_len(a)] (the groups read, in order). Kernel order (NATURAL
// false): for bits 4 each block of 2L values holds the even-indexed ones first, then the odd ones (x is
// reordered the same way, see load_x in common.h); natural order (NATURAL true) is the weight's own, for
// the attention kernels' quantized rows. GS as in `fused` (row_block runs group size 32 with GS = 32: on
// the Zen 5 VM the 576 x 3072 product at 12 / 16 / 32 / 64 rows, through the scratch, took 0.94-0.95x /
// 0.95x / 0.98x / 0.99x the time of the runtime-size form, 2 threads).
template <class S, int BITS, bool NATURAL, int GS = 0>
inline void dequant_row(const QmmArgs& a, int n, float* out) {
  using V = typename S::V;
  constexpr int L = S::L;
  const int gs = GS ? GS : a.group_size;
  const int64_t groups = a.K / gs;
  const uint8_t* row = reinterpret_cast<const uint8_t*>(a.w) + int64_t(n) * a.K * BITS / 8;
  for (int64_t gi = 0; gi < a.G; ++gi) {
    const int64_t g = read_group(a, gi);
    const V s = S::set1(load_param<S>(a.scales, n * groups + g, a.sb_dtype));
    const V b = S::set1(load_param<S>(a.biases, n * groups + g, a.sb_dtype));
    float* o = out + gi * gs;
    const uint8_t* q = row + g * gs * BITS / 8;
    __builtin_prefetch(q + kPrefetchBytes, 0, 0);
    for (int k = 0; k < gs; k += kStep<S, BITS>) {
      V v[2];
      if constexpr (BITS == 8) {
        S::codes8(q + k, v);
      } else if constexpr (NATURAL) {
        S::codes4_natural(q + k / 2, v);
      } else {
        S::codes4(q + k / 2, v);
      }
      S::store(o + k, S::fma(v[0], s, b));
      if constexpr (BITS == 4) {
        S::store(o + k + L, S::fma(v[1], s, b));
      }
    }
  }
}

// Scale or bias i of a row (dtype DT) broadcast to every lane.
template <class S, Dtype DT>
inline typename S::V param(const void* p, int64_t i) {
  if constexpr (DT == Dtype::f32) {
    return S::set1(static_cast<const float*>(p)[i]);
  } else if constexpr (DT == Dtype::f16) {
    return S::bcast_f16(static_cast<const uint16_t*>(p) + i);
  } else {
    return S::bcast_bf16(static_cast<const uint16_t*>(p) + i);
  }
}

// Rows 0..MB of y for weight rows n..n+NB (scales / biases of dtype DT), dequantizing each group into
// registers (no scratch): the path for M <= S::MB. Each step unpacks and dequantizes the NB rows' codes,
// then every row of x is loaded once and multiplied with all of them. The scales and biases are
// broadcast once per group, and the weight stream is prefetched one block line per line consumed.
// (Measured on Zen 4 against the previous form, which broadcast them through scalar conversions and
// loaded x for every weight row: 0.97x the time at 1-2 rows, 0.90x at 3, 0.85x at 4.) GS: the group
// size when known at compile time, else 0 (fused_block runs group size 32, the GGUF-loaded weights',
// with GS = 32: on the Zen 5 VM the default model's 576 x 3072 product at 1 / 2 / 3 / 4 rows took 0.91x /
// 0.85x / 0.76x / 0.69x the time of the runtime-size form built beside it, 2 threads; against the build
// before, where the same runtime-size form ran faster, 4 rows took 0.82-0.90x and 1-3 rows the same).
template <class S, int BITS, Dtype DT, int NB, int MB, int GS>
inline void fused(const QmmArgs& a, int n) {
  using V = typename S::V;
  constexpr int L = S::L;
  constexpr int step = kStep<S, BITS>;
  constexpr int halves = BITS == 4 ? 2 : 1;  // vectors per unpacking step
  const int K = x_len(a);
  const int gs = GS ? GS : a.group_size;
  const int64_t groups = a.K / gs;
  const int64_t row_bytes = int64_t(a.K) * BITS / 8;
  const int64_t group_bytes = int64_t(gs) * BITS / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
  const int64_t sb = int64_t(n) * groups;  // this block's first scale / bias
  V acc[MB][NB];
  zero_tile<S>(acc);
  for (int64_t gi = 0; gi < a.G; ++gi) {
    const int64_t g = read_group(a, gi);
    if (a.groups) {  // gathered groups (RMM): each row's stream jumps
      MLX_INFER_UNROLL
      for (int j = 0; j < NB; ++j) __builtin_prefetch(w + j * row_bytes + g * group_bytes + kPrefetchBytes, 0, 0);
    } else {  // the NB rows are contiguous: prefetch as many lines as a group step consumes
      for (int64_t o = 0; o < NB * group_bytes; o += 64) {
        __builtin_prefetch(w + gi * NB * group_bytes + o + kPrefetchBytes, 0, 0);
      }
    }
    V s[NB], b[NB];
    MLX_INFER_UNROLL
    for (int j = 0; j < NB; ++j) {
      s[j] = param<S, DT>(a.scales, sb + j * groups + g);
      b[j] = param<S, DT>(a.biases, sb + j * groups + g);
    }
    const uint8_t* wg = w + g * group_bytes;
    const float* xg = a.x + gi * gs;
    for (int kk = 0; kk < gs; kk += step) {
      V q[NB][2];
      MLX_INFER_UNROLL
      for (int j = 0; j < NB; ++j) {
        if constexpr (BITS == 4) {
          S::codes4(wg + j * row_bytes + kk / 2, q[j]);
        } else {
          S::codes8(wg + j * row_bytes + kk, q[j]);
        }
        MLX_INFER_UNROLL
        for (int h = 0; h < halves; ++h) q[j][h] = S::fma(q[j][h], s[j], b[j]);
      }
      MLX_INFER_UNROLL
      for (int m = 0; m < MB; ++m) {
        MLX_INFER_UNROLL
        for (int h = 0; h < halves; ++h) {
          const V xv = S::load(xg + int64_t(m) * K + kk + h * L);
          MLX_INFER_UNROLL
          for (int j = 0; j < NB; ++j) acc[m][j] = S::fma(q[j][h], xv, acc[m][j]);
        }
      }
    }
  }
  store_tile<S>(a, 0, n, acc);
}

// fused<..., NB, M> for the row count M (<= S::MB) of this product.
template <class S, int BITS, Dtype DT, int NB, int GS>
inline void fused_rows(const QmmArgs& a, int n) {
  switch (a.M) {
    case 1:
      fused<S, BITS, DT, NB, 1, GS>(a, n);
      break;
    case 2:
      if constexpr (S::MB >= 2) fused<S, BITS, DT, NB, 2, GS>(a, n);
      break;
    case 3:
      if constexpr (S::MB >= 3) fused<S, BITS, DT, NB, 3, GS>(a, n);
      break;
    default:
      if constexpr (S::MB >= 4) fused<S, BITS, DT, NB, 4, GS>(a, n);
      break;
  }
}

// Rows 0..MB of y for weight rows n..n+NB, dequantizing each group into registers as `fused` does, for
// S::MB < M <= S::MW rows (NB of S::wide_rows_per_call(M)), where the scratch path would store and
// reload every dequantized value. x comes blocked (x_block in qmm_kernel.h): each step's x vectors of
// all MB rows lie together, at fixed offsets from one pointer. GS as in `fused` (the compiler then
// unrolls the group's steps and keeps fewer values live: with x blocked and four weight rows per call,
// the runtime group size left the 8-row 576 x 3072 product at 0.75x the speed, one thread, Zen 5 VM).
template <class S, int BITS, Dtype DT, int NB, int MB, int GS>
inline void fused_wide(const QmmArgs& a, int n) {
  using V = typename S::V;
  constexpr int L = S::L;
  constexpr int step = kStep<S, BITS>;
  constexpr int halves = BITS == 4 ? 2 : 1;  // vectors per unpacking step
  const int gs = GS ? GS : a.group_size;
  const int64_t groups = a.K / gs;
  const int64_t row_bytes = int64_t(a.K) * BITS / 8;
  const int64_t group_bytes = int64_t(gs) * BITS / 8;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(a.w) + n * row_bytes;
  const int64_t sb = int64_t(n) * groups;  // this block's first scale / bias
  const float* xt = a.x;                   // the step's block of x: [MB, step]
  V acc[MB][NB];
  zero_tile<S>(acc);
  for (int64_t gi = 0; gi < a.G; ++gi) {
    const int64_t g = read_group(a, gi);
    const uint8_t* wg = w + g * group_bytes;
    MLX_INFER_UNROLL
    for (int j = 0; j < NB; ++j) __builtin_prefetch(wg + j * row_bytes + kPrefetchBytes, 0, 0);
    for (int kk = 0; kk < gs; kk += step, xt += MB * step) {
      V q[NB][2];
      MLX_INFER_UNROLL
      for (int j = 0; j < NB; ++j) {
        if constexpr (BITS == 4) {
          S::codes4(wg + j * row_bytes + kk / 2, q[j]);
        } else {
          S::codes8(wg + j * row_bytes + kk, q[j]);
        }
        const V s = param<S, DT>(a.scales, sb + j * groups + g);
        const V b = param<S, DT>(a.biases, sb + j * groups + g);
        MLX_INFER_UNROLL
        for (int h = 0; h < halves; ++h) q[j][h] = S::fma(q[j][h], s, b);
      }
      MLX_INFER_UNROLL
      for (int m = 0; m < MB; ++m) {
        MLX_INFER_UNROLL
        for (int h = 0; h < halves; ++h) {
          const V xv = S::load(xt + m * step + h * L);
          MLX_INFER_UNROLL
          for (int j = 0; j < NB; ++j) acc[m][j] = S::fma(q[j][h], xv, acc[m][j]);
        }
      }
    }
  }
  store_tile<S>(a, 0, n, acc);
}

// fused_wide<..., NB, M, GS> for the row count M of this product (S::MB < M <= S::MW).
template <class S, int BITS, Dtype DT, int NB, int GS>
inline void wide_rows(const QmmArgs& a, int n) {
  switch (a.M) {
#define MLX_INFER_WIDE(R) \
    case R:               \
      if constexpr (S::MW >= R) fused_wide<S, BITS, DT, NB, R, GS>(a, n); \
      break;
    MLX_INFER_WIDE(3)
    MLX_INFER_WIDE(4)
    MLX_INFER_WIDE(5)
    MLX_INFER_WIDE(6)
    MLX_INFER_WIDE(7)
    MLX_INFER_WIDE(8)
    MLX_INFER_WIDE(9)
    MLX_INFER_WIDE(10)
    MLX_INFER_WIDE(11)
    MLX_INFER_WIDE(12)
    MLX_INFER_WIDE(13)
    MLX_INFER_WIDE(14)
    MLX_INFER_WIDE(15)
    MLX_INFER_WIDE(16)
#undef MLX_INFER_WIDE
    default:
      break;
  }
}

// Weight rows [n, n + NB) for all M rows in registers (M <= S::MB: fused; else fused_wide,
// S::wide_rows_per_call(M) weight rows at a time), the group size GS as in `fused`.
template <class S, int BITS, Dtype DT, int NB, int GS>
inline void register_block(const QmmArgs& a, int n) {
  if (a.M <= S::MB) {
    fused_rows<S, BITS, DT, NB, GS>(a, n);
    return;
  }
  const int per_call = std::min(NB, S::wide_rows_per_call(a.M, BITS));
  constexpr int N4 = NB >= 4 ? 4 : 1, N2 = NB >= 2 ? 2 : 1;  // (no 4-row body for a 1-row block)
  if (per_call == 4) {
    for (int j = 0; j < NB; j += 4) wide_rows<S, BITS, DT, N4, GS>(a, n + j);
  } else if (per_call == 2) {
    for (int j = 0; j < NB; j += 2) wide_rows<S, BITS, DT, N2, GS>(a, n + j);
  } else {
    for (int j = 0; j < NB; ++j) wide_rows<S, BITS, DT, 1, GS>(a, n + j);
  }
}

// Weight rows [n, n + NB) for all M rows in registers (M <= S::MB or M <= S::MW); false when M needs the
// scratch.
template <class S, int BITS, Dtype DT, int NB>
inline bool fused_block(const QmmArgs& a, int n) {
  if (a.M > S::MB && a.M > S::MW) {
    return false;
  }
  if (a.group_size == 32) {  // (the GGUF-loaded weights' group size)
    register_block<S, BITS, DT, NB, 32>(a, n);
  } else {
    register_block<S, BITS, DT, NB, 0>(a, n);
  }
  return true;
}

template <class S, int BITS, int NB>
inline bool fused_block(const QmmArgs& a, int n) {
  switch (a.sb_dtype) {
    case Dtype::f32:
      return fused_block<S, BITS, Dtype::f32, NB>(a, n);
    case Dtype::f16:
      return fused_block<S, BITS, Dtype::f16, NB>(a, n);
    default:
      return fused_block<S, BITS, Dtype::bf16, NB>(a, n);
  }
}

// acc[m][j] = x[m0 + m, :] . wq[j, :] for MB rows of x and NB dequantized weight rows (L1 scratch).
template <class S, int NB, int MB>
inline void tile(const QmmArgs& a, int m0, int n, const float* wq) {
  using V = typename S::V;
  constexpr int L = S::L;
  const int K = x_len(a);
  const float* x = a.x + int64_t(m0) * K;
  V acc[MB][NB];
  zero_tile<S>(acc);
  for (int k = 0; k < K; k += L) {
    // the MB x vectors stay in registers and each weight vector is loaded once for them: MB * NB
    // accumulators + MB + 1 registers (AVX2's 3 x 4 tile fills its 16)
    V xv[MB];
    MLX_INFER_UNROLL
    for (int m = 0; m < MB; ++m) {
      xv[m] = S::load(x + int64_t(m) * K + k);
    }
    MLX_INFER_UNROLL
    for (int j = 0; j < NB; ++j) {
      const V wv = S::load(wq + int64_t(j) * K + k);
      MLX_INFER_UNROLL
      for (int m = 0; m < MB; ++m) {
        acc[m][j] = S::fma(wv, xv[m], acc[m][j]);
      }
    }
  }
  store_tile<S>(a, m0, n, acc);
}

template <class S, int NB, int MB>
inline void tile_rows(const QmmArgs& a, int m0, int rows, int n, const float* wq) {
  switch (rows) {
    case 1:
      tile<S, NB, 1>(a, m0, n, wq);
      break;
    case 2:
      if constexpr (MB >= 2) tile<S, NB, 2>(a, m0, n, wq);
      break;
    case 3:
      if constexpr (MB >= 3) tile<S, NB, 3>(a, m0, n, wq);
      break;
    default:
      if constexpr (MB >= 4) tile<S, NB, 4>(a, m0, n, wq);
      break;
  }
}

// All M rows against NB scratch rows: full MB-row register tiles, then one shorter tile for the rest.
// (Measured on AVX-512: a 4-row tile costs about what a 3-row one does, so 9 rows run as 4 + 4 + 1; on
// AVX2, whose 16 registers hold a 3 x 4 tile, as 3 + 3 + 3: 158 us against 186 for 2 + 2 + 2 + 2 + 1 on
// the default model's 576 x 1536 product, bench-style timing on 2 Zen 2 cores.)
template <class S, int NB, int MB>
inline void tiles_over_m(const QmmArgs& a, int n, const float* wq) {
  int m0 = 0;
  for (; m0 + MB <= a.M; m0 += MB) {
    tile<S, NB, MB>(a, m0, n, wq);
  }
  if (m0 < a.M) {
    tile_rows<S, NB, MB>(a, m0, a.M - m0, n, wq);
  }
}

// Weight rows [n, n + nb) for all M rows: in registers for up to S::MW rows, else through the L1 scratch.
template <class S, int BITS, int NB>
inline void row_block(const QmmArgs& a, int n, float* scratch) {
  if (fused_block<S, BITS, NB>(a, n)) {
    return;
  }
  for (int j = 0; j < NB; ++j) {
    if (a.group_size == 32) {
      dequant_row<S, BITS, false, 32>(a, n + j, scratch + int64_t(j) * x_len(a));
    } else {
      dequant_row<S, BITS, false>(a, n + j, scratch + int64_t(j) * x_len(a));
    }
  }
  tiles_over_m<S, NB, S::TB>(a, n, scratch);
}

template <class S, int BITS>
void rows_impl(const QmmArgs& a, int n0, int n1, float* scratch) {
  constexpr int NB = S::NB;
  int n = n0;
  for (; n + NB <= n1; n += NB) {
    row_block<S, BITS, NB>(a, n, scratch);
  }
  for (; n < n1; ++n) {  // the rows left over
    row_block<S, BITS, 1>(a, n, scratch);
  }
}

template <class S>
void rows(const QmmArgs& a, int n0, int n1, float* scratch) {
  if (a.bits == 4) {
    rows_impl<S, 4>(a, n0, n1, scratch);
  } else {
    rows_impl<S, 8>(a, n0, n1, scratch);
  }
}

// y[i] = g[i] * sigmoid(a[i]) * u[i] for i < n, sigmoid(a) = 1 / (1 + e^-a), with a = g (SwiGLU's gate,
// silu(g) * u) or, GELU, a = g * (kGeluA + kGeluB * g^2) (GeGLU's gate with GELU's tanh approximation,
// gelu_approx(g) * u).
template <class S, bool GELU>
void gated_values(const float* g, const float* u, float* y, int64_t n) {
  using V = typename S::V;
  constexpr int L = S::L;
  const V one = S::set1(1.0f);
  const V minus_one = S::set1(-1.0f);
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const V gv = S::load(g + i);
    V arg = gv;
    if constexpr (GELU) {
      arg = S::mul(gv, S::fma(S::mul(gv, gv), S::set1(kGeluB), S::set1(kGeluA)));
    }
    const V sig = S::div(one, S::add(one, S::exp(S::mul(arg, minus_one))));
    S::store(y + i, S::mul(S::mul(gv, sig), S::load(u + i)));
  }
  if (i < n) {  // the tail, through a zero-padded vector
    float gt[L] = {}, ut[L] = {}, yt[L];
    std::memcpy(gt, g + i, sizeof(float) * size_t(n - i));
    std::memcpy(ut, u + i, sizeof(float) * size_t(n - i));
    gated_values<S, GELU>(gt, ut, yt, L);
    std::memcpy(y + i, yt, sizeof(float) * size_t(n - i));
  }
}

template <class S>
void swiglu_values(const float* g, const float* u, float* y, int64_t n) {
  gated_values<S, false>(g, u, y, n);
}

template <class S>
void geglu_values(const float* g, const float* u, float* y, int64_t n) {
  gated_values<S, true>(g, u, y, n);
}

}  // namespace
}  // namespace mlx_infer_kernels
