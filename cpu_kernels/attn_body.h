// Attention over a quantized KV cache and over a paged KV pool (float or quantized blocks), written once over the SIMD trait S
// of qmm_body.h (included after it, by one translation unit per instruction set, inside an anonymous
// namespace).
//
// Per tile of kAttnTile keys (attend_rows): get the tile's K rows from a source (QuantRows dequantizes
// packed rows into an L1 scratch; PagedRows points at the pool's rows through the token table's index,
// converting float16 / bfloat16 ones into the scratch; PagedQuantRows dequantizes the packed pool rows it
// points at into the scratch), read once for all R query rows (the heads of a GQA
// group and the verify positions), score every row against them, get the V rows and fold the tile into
// each row's online softmax (running max m, sum l, unnormalized acc). The caller merges the partials of a
// head's key ranges (flash-decoding).
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

// Packed row `row` of `rows` (bits 4 or 8) as rows.K floats in natural order into out.
template <class S>
inline void dequant_row_at(const QmmArgs& rows, int bits, int row, float* out) {
  if (bits == 4) {
    dequant_row<S, 4, true>(rows, row, out);
  } else {
    dequant_row<S, 8, true>(rows, row, out);
  }
}

// Packed rows [t0, t0 + n) as float rows out [n, rows.K].
template <class S>
inline void dequant_tile(const QmmArgs& rows, int bits, int t0, int n, float* out) {
  for (int j = 0; j < n; ++j) dequant_row_at<S>(rows, bits, t0 + j, out + int64_t(j) * rows.K);
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

// The score s of a key, or -inf when the query does not see it (mask -inf; mask 0 when it does).
inline float masked(float mask, float s) {
  return mask == -std::numeric_limits<float>::infinity() ? mask : s;
}

// out[j] = scale * (q . rows[j]) for j < n where bias[j] is 0, -inf where it is -inf; q and the rows [D]
// floats, `rows` holding n rounded up to S::L pointers (those past n at a row of zeros). Keys go S::L at a
// time, one accumulator each (q loaded once per vector for all of them), and the S::L sums are taken
// together (S::hsum_each) instead of one horizontal sum per key; a key's score does not depend on the
// other keys of its group.
template <class S>
inline void score_tile(const float* q, const float* const* rows, int n, int D, float scale, const float* bias,
                       float* out) {
  using V = typename S::V;
  constexpr int L = S::L;
  alignas(64) float sums[L];
  for (int j0 = 0; j0 < n; j0 += L) {
    const float* const* r = rows + j0;
    V acc[L];
    MLX_INFER_UNROLL
    for (int k = 0; k < L; ++k) acc[k] = S::zero();
    for (int d = 0; d < D; d += L) {
      const V x = S::load(q + d);
      MLX_INFER_UNROLL
      for (int k = 0; k < L; ++k) acc[k] = S::fma(x, S::load(r[k] + d), acc[k]);
    }
    S::store(sums, S::hsum_each(acc));
    const int m = std::min(L, n - j0);
    for (int k = 0; k < m; ++k) out[j0 + k] = masked(bias[j0 + k], scale * sums[k]);
  }
}

// For each of RB rows b: acc[b][d0:Dv] = alpha[b] * acc[b] + sum_j p[b][j] * rows[j][d0:Dv] over j < n, the keys
// added in order into one accumulator per row and vector of Dv. CB vectors of Dv at a time: each key's CB
// V vectors are loaded once for the RB rows and each probability is broadcast once for the CB vectors (RB x
// CB independent FMA chains). A row's sums do not depend on RB, on the rows folded with it or on n (a key
// the row does not see, p = 0, adds exact zeros).
template <class S, int RB, int CB>
inline void fold_rows(float* const* acc, const float* alpha, const float* const* p, const float* const* rows, int n,
                      int d0, int Dv) {
  using V = typename S::V;
  constexpr int L = S::L;
  int d = d0;
  for (; d + CB * L <= Dv; d += CB * L) {
    V o[RB][CB];
    MLX_INFER_UNROLL
    for (int b = 0; b < RB; ++b) {
      const V a = S::set1(alpha[b]);
      MLX_INFER_UNROLL
      for (int c = 0; c < CB; ++c) o[b][c] = S::mul(S::load(acc[b] + d + c * L), a);
    }
    for (int j = 0; j < n; ++j) {
      V v[CB];
      MLX_INFER_UNROLL
      for (int c = 0; c < CB; ++c) v[c] = S::load(rows[j] + d + c * L);
      MLX_INFER_UNROLL
      for (int b = 0; b < RB; ++b) {
        const V pb = S::set1(p[b][j]);
        MLX_INFER_UNROLL
        for (int c = 0; c < CB; ++c) o[b][c] = S::fma(pb, v[c], o[b][c]);
      }
    }
    MLX_INFER_UNROLL
    for (int b = 0; b < RB; ++b) {
      MLX_INFER_UNROLL
      for (int c = 0; c < CB; ++c) S::store(acc[b] + d + c * L, o[b][c]);
    }
  }
  if constexpr (CB > 1) {
    if (d < Dv) fold_rows<S, RB, 1>(acc, alpha, p, rows, n, d, Dv);  // the vectors left over
  }
}

// Rows and vectors of Dv folded together by fold_rows: what the vector registers hold (RB x CB accumulators
// besides CB V vectors and a broadcast).
template <class S>
constexpr int kFoldRows = S::L >= 16 ? 4 : 2;
template <class S>
constexpr int kFoldVectors = S::L >= 16 ? 4 : 2;

// fold_rows of the last b < RB rows gathered (b rows folded together: one pass over the tile's V rows).
template <class S, int B>
inline void fold_rest(int b, float* const* acc, const float* alpha, const float* const* p, const float* const* rows,
                      int n, int Dv) {
  if constexpr (B > 0) {
    if (b == B) {
      fold_rows<S, B, kFoldVectors<S>>(acc, alpha, p, rows, n, 0, Dv);
    } else {
      fold_rest<S, B - 1>(b, acc, alpha, p, rows, n, Dv);
    }
  }
}

// Points rows[j] at the j-th of n rows of `tile` ([n, dim] floats).
inline void tile_rows(float* tile, int dim, int n, const float** rows) {
  for (int j = 0; j < n; ++j) rows[j] = tile + int64_t(j) * dim;
}

// The tiles of one KV head of a quantized cache: K and V rows dequantized into the tile scratch; query
// row r sees keys t <= S - P + r % P (causal over the last P tokens).
template <class S>
struct QuantRows {
  const AttnArgs& a;
  int h;
  QmmArgs krows, vrows;

  QuantRows(const AttnArgs& args, int head)
      : a(args), h(head),
        krows(args.channel_keys ? QmmArgs{}
              : head_rows(args.k, args.k_scales, args.k_biases, args.k_dtype, head, args.C, args.D,
                          args.group_size, args.k_bits)),
        vrows(head_rows(args.v, args.v_scales, args.v_biases, args.v_dtype, head, args.Cv, args.Dv,
                        args.group_size, args.v_bits)) {}

  void keys(int t0, int n, float* tile, const float** rows) const {
    if (a.channel_keys) {
      dequant_channel_tile<S>(a, h, t0, n, tile);
    } else {
      dequant_tile<S>(krows, a.k_bits, t0, n, tile);
    }
    tile_rows(tile, a.D, n, rows);
  }
  void values(int t0, int n, float* tile, const float** rows) const {
    dequant_tile<S>(vrows, a.v_bits, t0, n, tile);
    tile_rows(tile, a.Dv, n, rows);
  }
  // Rows r and r + period() see the same keys (the same query position).
  int period() const { return a.P; }
  // bias[j] = 0 when row r sees key t0 + j, else -inf (j < n); returns whether it sees any.
  bool mask(int r, int t0, int n, float* bias) const {
    const int last = a.S - a.P + r % a.P;
    for (int j = 0; j < n; ++j) bias[j] = t0 + j <= last ? 0.0f : -std::numeric_limits<float>::infinity();
    return t0 <= last;
  }
};

// rows[j] = the float32 row index[j] (j < n) of a paged pool layer of pool_rows rows: load(row, tile + j * dim)
// gives it (a pointer to dim floats: the pool's own row, or its conversion in the tile scratch); `zeros` for
// an index outside the pool.
template <class Load>
inline void index_rows(const int32_t* index, int n, int64_t pool_rows, int dim, const float* zeros, float* tile,
                       const float** rows, Load load) {
  for (int j = 0; j < n; ++j) {
    const int64_t row = index[j];
    rows[j] = row < 0 || row >= pool_rows ? zeros : load(row, tile + int64_t(j) * dim);
  }
}

// Row `row` of a float pool layer ([rows, dim], dtype dt) as float32: the row itself for float32, else its
// conversion in out.
template <class S>
inline const float* float_row(const void* pool, Dtype dt, int dim, int64_t row, float* out) {
  if (dt == Dtype::f32) return static_cast<const float*>(pool) + row * dim;
  const uint16_t* src = static_cast<const uint16_t*>(pool) + row * dim;
  for (int d = 0; d < dim; ++d) out[d] = load_param<S>(src, d, dt);
  return out;
}

// The tiles of one (request, KV head) of a float paged pool, read through its row index.
template <class S>
struct PagedRows {
  const PagedAttnArgs& a;
  const int32_t* index;  // [S] this request's and head's pool rows
  const int32_t* kpos;   // [S]
  const int32_t* qpos;   // [L]
  const float* zeros;    // max(D, Dv) zeros

  void keys(int t0, int n, float* tile, const float** rows) const {
    index_rows(index + t0, n, a.rows, a.D, zeros, tile, rows,
               [&](int64_t row, float* out) { return float_row<S>(a.k, a.kv_dtype, a.D, row, out); });
  }
  void values(int t0, int n, float* tile, const float** rows) const {
    index_rows(index + t0, n, a.rows, a.Dv, zeros, tile, rows,
               [&](int64_t row, float* out) { return float_row<S>(a.v, a.kv_dtype, a.Dv, row, out); });
  }
  // Rows r and r + period() see the same keys (the same query position).
  int period() const { return a.L; }
  // bias[j] = 0 when row r sees key t0 + j, else -inf (j < n); returns whether it sees any.
  bool mask(int r, int t0, int n, float* bias) const {
    const int64_t q = qpos[r % a.L];
    const int64_t oldest = a.window > 0 ? q - a.window : std::numeric_limits<int64_t>::min();
    bool any = false;
    for (int j = 0; j < n; ++j) {
      const int64_t k = kpos[t0 + j], row = index[t0 + j];
      const bool seen = row >= 0 && row < a.rows && k <= q && k > oldest;
      bias[j] = seen ? 0.0f : -std::numeric_limits<float>::infinity();
      any |= seen;
    }
    return any;
  }
};

// The tiles of one (request, KV head) of a paged pool of quantized blocks: PagedRows' index and mask, each
// row dequantized (QuantRows' row dequantizer) into the tile scratch as it is read, through the index.
template <class S>
struct PagedQuantRows : PagedRows<S> {
  QmmArgs krows, vrows;  // every row of the pool layer's K / V codes

  void keys(int t0, int n, float* tile, const float** rows) const {
    index_rows(this->index + t0, n, this->a.rows, this->a.D, this->zeros, tile, rows, [&](int64_t row, float* out) {
      dequant_row_at<S>(krows, this->a.k_bits, int(row), out);
      return static_cast<const float*>(out);
    });
  }
  void values(int t0, int n, float* tile, const float** rows) const {
    index_rows(this->index + t0, n, this->a.rows, this->a.Dv, this->zeros, tile, rows, [&](int64_t row, float* out) {
      dequant_row_at<S>(vrows, this->a.v_bits, int(row), out);
      return static_cast<const float*>(out);
    });
  }
};

// y[j] = e^(scale * x[j] - shift) for j < n (y may be x); returns their sum. A tail shorter than a vector
// is padded with -inf (whose e^ is 0), so every value goes through the same vector e^x.
template <class S>
inline float exp_shifted(const float* x, float* y, int n, float scale, float shift) {
  using V = typename S::V;
  const V vs = S::set1(scale), vm = S::set1(-shift);
  V sum = S::zero();
  int j = 0;
  for (; j + S::L <= n; j += S::L) {
    const V e = S::exp(S::fma(S::load(x + j), vs, vm));
    S::store(y + j, e);
    sum = S::fma(e, S::set1(1.0f), sum);
  }
  if (j < n) {
    alignas(64) float tail[S::L];
    std::fill(tail, tail + S::L, -std::numeric_limits<float>::infinity());
    std::copy(x + j, x + n, tail);
    const V e = S::exp(S::fma(S::load(tail), vs, vm));
    S::store(tail, e);
    sum = S::fma(e, S::set1(1.0f), sum);
    std::copy(tail, tail + (n - j), y + j);
  }
  return S::hsum(sum);
}

// The largest of x[0:n] (n >= 1).
template <class S>
inline float row_max(const float* x, int n) {
  using V = typename S::V;
  float m = -std::numeric_limits<float>::infinity();
  int j = 0;
  if (n >= S::L) {
    V vm = S::load(x);
    for (j = S::L; j + S::L <= n; j += S::L) vm = S::max(vm, S::load(x + j));
    m = S::hmax(vm);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// The causal softmax of prefill score rows [r0, r1) (see SoftmaxArgs in qmm_kernel.h).
template <class S>
void softmax_rows(const SoftmaxArgs& a, int64_t r0, int64_t r1) {
  for (int64_t i = r0; i < r1; ++i) {
    const float* x = a.x + i * a.S;
    float* y = a.y + i * a.S;
    const int64_t pos = int64_t(a.q0) + (i % a.R) % a.period;
    const int hi = int(std::min<int64_t>(a.S - 1, pos));
    const int lo = a.window > 0 ? int(std::max<int64_t>(0, pos - a.window + 1)) : 0;
    if (hi < lo) {
      std::fill(y, y + a.S, 0.0f);
      continue;
    }
    const int n = hi - lo + 1;
    const float m = a.scale * row_max<S>(x + lo, n);  // scale > 0
    const float inv = 1.0f / exp_shifted<S>(x + lo, y + lo, n, a.scale, m);
    using V = typename S::V;
    const V vi = S::set1(inv);
    int j = lo;
    for (; j + S::L <= hi + 1; j += S::L) S::store(y + j, S::fma(S::load(y + j), vi, S::zero()));
    for (; j <= hi; ++j) y[j] *= inv;
    std::fill(y, y + lo, 0.0f);
    std::fill(y + hi + 1, y + a.S, 0.0f);
  }
}

// attend_rows' scratch: the K and V tiles (a source that converts or dequantizes rows writes them there),
// the rows' scores (then probabilities) and the masks of the distinct query positions, and a row of zeros.
struct AttnScratch {
  float* kt;     // [T, D]
  float* vt;     // [T, Dv]
  float* sc;     // [R, T]
  float* bias;   // [min(period, R), T]
  float* zeros;  // [max(D, Dv)]

  AttnScratch(float* scratch, int D, int Dv, int R)
      : kt(scratch), vt(kt + int64_t(kAttnTile) * D), sc(vt + int64_t(kAttnTile) * Dv),
        bias(sc + int64_t(kAttnTile) * R), zeros(bias + int64_t(kAttnTile) * R) {
    std::fill(zeros, zeros + std::max(D, Dv), 0.0f);
  }
};

// The online softmax of R query rows q [R, D] over keys [s0, s1) of one source (QuantRows / PagedRows),
// tile by tile: the mask of each distinct query position is computed once, the K rows of a tile are read
// once for all rows and every row scores them (score_tile), then the V rows are folded into each row's
// running max m, sum l and unnormalized acc. Every row's arithmetic is its own, in a fixed order: its
// result does not depend on R, on the other rows or on where the tile ends.
template <class S, class Rows>
void attend_rows(const Rows& src, const float* q, int R, int D, int Dv, float scale, int s0, int s1,
                 AttnPartial out, const AttnScratch& w) {
  constexpr int T = kAttnTile;
  static_assert(T % S::L == 0, "a tile holds whole groups of keys");
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int positions = std::min(src.period(), R);
  const float* krow[T];
  const float* vrow[T];
  for (int r = 0; r < R; ++r) {
    out.m[r] = neg_inf;
    out.l[r] = 0.0f;
    for (int d = 0; d < Dv; ++d) out.acc[int64_t(r) * Dv + d] = 0.0f;
  }
  for (int t0 = s0; t0 < s1; t0 += T) {
    const int n = std::min(T, s1 - t0);
    bool any = false;
    for (int p = 0; p < positions; ++p) any |= src.mask(p, t0, n, w.bias + p * T);
    if (!any) continue;  // no row sees a key of this tile: neither K nor V is read
    src.keys(t0, n, w.kt, krow);
    const int padded = (n + S::L - 1) / S::L * S::L;
    for (int j = n; j < padded; ++j) krow[j] = w.zeros;
    for (int r = 0; r < R; ++r) {
      score_tile<S>(q + int64_t(r) * D, krow, n, D, scale, w.bias + (r % src.period()) * T, w.sc + r * T);
    }
    src.values(t0, n, w.vt, vrow);
    constexpr int RB = kFoldRows<S>;
    float* acc[RB];
    float alpha[RB];
    const float* prob[RB];
    int b = 0;  // rows gathered for the next fold
    for (int r = 0; r < R; ++r) {
      float* p = w.sc + r * T;
      const float tile_max = row_max<S>(p, n);
      if (tile_max == neg_inf) continue;  // this row sees no key of the tile
      const float m_new = std::max(out.m[r], tile_max);
      alpha[b] = std::exp(out.m[r] - m_new);  // 0 for the first tile (m = -inf)
      const float sum = exp_shifted<S>(p, p, n, 1.0f, m_new);
      out.l[r] = out.l[r] * alpha[b] + sum;
      out.m[r] = m_new;
      acc[b] = out.acc + int64_t(r) * Dv;
      prob[b] = p;
      if (++b == RB) {
        fold_rows<S, RB, kFoldVectors<S>>(acc, alpha, prob, vrow, n, 0, Dv);
        b = 0;
      }
    }
    fold_rest<S, RB - 1>(b, acc, alpha, prob, vrow, n, Dv);
  }
}

template <class S>
void attend(const AttnArgs& a, int h, int s0, int s1, AttnPartial out, float* scratch) {
  attend_rows<S>(QuantRows<S>(a, h), a.q + int64_t(h) * a.R * a.D, a.R, a.D, a.Dv, a.scale, s0, s1, out,
                 AttnScratch(scratch, a.D, a.Dv, a.R));
}

template <class S>
void paged_attend(const PagedAttnArgs& a, int bh, int s0, int s1, AttnPartial out, float* scratch) {
  const int b = bh / a.n_kv;
  const AttnScratch w(scratch, a.D, a.Dv, a.R);
  const PagedRows<S> src{a, a.index + int64_t(bh) * a.S, a.k_pos + int64_t(b) * a.S, a.q_pos + int64_t(b) * a.L,
                         w.zeros};
  const float* q = a.q + int64_t(bh) * a.R * a.D;
  if (a.k_bits == 0) {
    attend_rows<S>(src, q, a.R, a.D, a.Dv, a.scale, s0, s1, out, w);
    return;
  }
  // the whole pool layer as the rows of one head (head_rows of head 0 over `rows` token rows)
  const PagedQuantRows<S> packed{
      src,
      head_rows(static_cast<const uint32_t*>(a.k), a.k_scales, a.k_biases, a.sb_dtype, 0, int(a.rows), a.D,
                a.group_size, a.k_bits),
      head_rows(static_cast<const uint32_t*>(a.v), a.v_scales, a.v_biases, a.sb_dtype, 0, int(a.rows), a.Dv,
                a.group_size, a.v_bits)};
  attend_rows<S>(packed, q, a.R, a.D, a.Dv, a.scale, s0, s1, out, w);
}

}  // namespace
}  // namespace mlx_infer_kernels
