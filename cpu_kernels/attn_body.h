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

// out[j] = scale * (q . rows[j]) for j < n where out[j] (the mask) is 0, -inf where it is -inf; q and the rows
// [D] floats: four rows at a time, each with its own accumulator (four independent FMA chains, and q loaded
// once for them).
template <class S>
inline void score_rows(const float* q, const float* const* rows, int n, int D, float scale, float* out) {
  using V = typename S::V;
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    V a0 = S::zero(), a1 = S::zero(), a2 = S::zero(), a3 = S::zero();
    for (int i = 0; i < D; i += S::L) {
      const V x = S::load(q + i);
      a0 = S::fma(x, S::load(rows[j] + i), a0);
      a1 = S::fma(x, S::load(rows[j + 1] + i), a1);
      a2 = S::fma(x, S::load(rows[j + 2] + i), a2);
      a3 = S::fma(x, S::load(rows[j + 3] + i), a3);
    }
    out[j] = masked(out[j], scale * S::hsum(a0));
    out[j + 1] = masked(out[j + 1], scale * S::hsum(a1));
    out[j + 2] = masked(out[j + 2], scale * S::hsum(a2));
    out[j + 3] = masked(out[j + 3], scale * S::hsum(a3));
  }
  for (; j < n; ++j) {
    V a = S::zero();
    for (int i = 0; i < D; i += S::L) a = S::fma(S::load(q + i), S::load(rows[j] + i), a);
    out[j] = masked(out[j], scale * S::hsum(a));
  }
}

// acc[0:Dv] = alpha * acc + sum_j p[j] * rows[j][0:Dv] over j < n: four accumulators, key j always in
// accumulator j % 4 (four independent FMA chains; and a key's place in the sums does not depend on n, so a
// tile holding keys a row does not see, p = 0, gives that row the same sums as the tile without them).
template <class S>
inline void fold_rows(float* acc, float alpha, const float* p, const float* const* rows, int n, int Dv) {
  using V = typename S::V;
  const V one = S::set1(1.0f);
  for (int d = 0; d < Dv; d += S::L) {
    V o[4] = {S::fma(S::load(acc + d), S::set1(alpha), S::zero()), S::zero(), S::zero(), S::zero()};
    int j = 0;
    for (; j + 4 <= n; j += 4) {
      o[0] = S::fma(S::set1(p[j]), S::load(rows[j] + d), o[0]);
      o[1] = S::fma(S::set1(p[j + 1]), S::load(rows[j + 1] + d), o[1]);
      o[2] = S::fma(S::set1(p[j + 2]), S::load(rows[j + 2] + d), o[2]);
      o[3] = S::fma(S::set1(p[j + 3]), S::load(rows[j + 3] + d), o[3]);
    }
    for (; j < n; ++j) o[j & 3] = S::fma(S::set1(p[j]), S::load(rows[j] + d), o[j & 3]);
    S::store(acc + d, S::fma(S::fma(o[3], one, o[2]), one, S::fma(o[1], one, o[0])));
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

// The online softmax of R query rows q [R, D] over keys [s0, s1) of one source (QuantRows / PagedRows),
// tile by tile: the K rows of a tile are read once for all rows, each row scores them, then the V rows
// are folded into each row's running max m, sum l and unnormalized acc. scratch: kAttnTile * (D + Dv + R)
// floats.
template <class S, class Rows>
void attend_rows(const Rows& src, const float* q, int R, int D, int Dv, float scale, int s0, int s1,
                 AttnPartial out, float* scratch) {
  constexpr int T = kAttnTile;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* kt = scratch;                // [T, D]
  float* vt = kt + int64_t(T) * D;    // [T, Dv]
  float* sc = vt + int64_t(T) * Dv;   // [R, T] scores, then probabilities
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
    for (int r = 0; r < R; ++r) any |= src.mask(r, t0, n, sc + r * T);
    if (!any) continue;  // no row sees a key of this tile: neither K nor V is read
    src.keys(t0, n, kt, krow);
    for (int r = 0; r < R; ++r) score_rows<S>(q + int64_t(r) * D, krow, n, D, scale, sc + r * T);
    src.values(t0, n, vt, vrow);
    for (int r = 0; r < R; ++r) {
      float* p = sc + r * T;
      float tile_max = neg_inf;
      for (int j = 0; j < n; ++j) tile_max = std::max(tile_max, p[j]);
      if (tile_max == neg_inf) continue;  // this row sees no key of the tile
      const float m_new = std::max(out.m[r], tile_max);
      const float alpha = std::exp(out.m[r] - m_new);  // 0 for the first tile (m = -inf)
      const float sum = exp_shifted<S>(p, p, n, 1.0f, m_new);
      out.l[r] = out.l[r] * alpha + sum;
      out.m[r] = m_new;
      fold_rows<S>(out.acc + int64_t(r) * Dv, alpha, p, vrow, n, Dv);
    }
  }
}

template <class S>
void attend(const AttnArgs& a, int h, int s0, int s1, AttnPartial out, float* scratch) {
  attend_rows<S>(QuantRows<S>(a, h), a.q + int64_t(h) * a.R * a.D, a.R, a.D, a.Dv, a.scale, s0, s1, out, scratch);
}

template <class S>
void paged_attend(const PagedAttnArgs& a, int bh, int s0, int s1, AttnPartial out, float* scratch) {
  const int b = bh / a.n_kv;
  float* zeros = scratch + int64_t(kAttnTile) * (a.D + a.Dv + a.R);  // [max(D, Dv)]
  std::fill(zeros, zeros + std::max(a.D, a.Dv), 0.0f);
  const PagedRows<S> src{a, a.index + int64_t(bh) * a.S, a.k_pos + int64_t(b) * a.S, a.q_pos + int64_t(b) * a.L,
                         zeros};
  const float* q = a.q + int64_t(bh) * a.R * a.D;
  if (a.k_bits == 0) {
    attend_rows<S>(src, q, a.R, a.D, a.Dv, a.scale, s0, s1, out, scratch);
    return;
  }
  // the whole pool layer as the rows of one head (head_rows of head 0 over `rows` token rows)
  const PagedQuantRows<S> packed{
      src,
      head_rows(static_cast<const uint32_t*>(a.k), a.k_scales, a.k_biases, a.sb_dtype, 0, int(a.rows), a.D,
                a.group_size, a.k_bits),
      head_rows(static_cast<const uint32_t*>(a.v), a.v_scales, a.v_biases, a.sb_dtype, 0, int(a.rows), a.Dv,
                a.group_size, a.v_bits)};
  attend_rows<S>(packed, q, a.R, a.D, a.Dv, a.scale, s0, s1, out, scratch);
}

}  // namespace
}  // namespace mlx_infer_kernels
