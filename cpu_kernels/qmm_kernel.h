// The ISA-specific half of the quantized skinny matmul: plain C++ over raw pointers, no MLX headers,
// so that the AVX-512 / AVX2 translation units share no inline code with the rest of the library
// (an inline function compiled for AVX-512 and picked by the linker would crash an AVX2-only CPU).
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlx_infer_kernels {

// GELU's tanh approximation as a sigmoid: 0.5 * (1 + tanh(t)) = sigmoid(2t), t = c * (g + 0.044715 g^3),
// c = sqrt(2 / pi), so gelu_approx(g) = g * sigmoid(g * (kGeluA + kGeluB * g^2)) (GeGLU's gate, swiglu.h).
constexpr float kGeluA = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
constexpr float kGeluB = 0.0713548162726009f;  // 2 * sqrt(2 / pi) * 0.044715

// Element type of scales / biases and of y.
enum class Dtype : int { f32 = 0, f16 = 1, bf16 = 2 };

// One product y = x @ dequantize(w, scales, biases).T in MLX's affine layout.
struct QmmArgs {
  const float* x;         // [M, K] float32, row-contiguous
  const uint32_t* w;      // [N, K * bits / 32]: value j of a word in bits [bits*j, bits*(j+1))
  const void* scales;     // [N, K / group_size], sb_dtype
  const void* biases;     // [N, K / group_size], sb_dtype
  void* y;                // [M, N], y_dtype; row stride ldy elements
  int64_t ldy;
  int M, N, K, group_size, bits;
  Dtype sb_dtype;
  Dtype y_dtype;
  // The weight groups read (RMM's gathered product): nullptr for all K / group_size groups in order, else
  // G ascending group indices. x then holds only those groups: [M, G * group_size], row-contiguous.
  const int32_t* groups;
  int G;
  // The int8-activation path only (QmmQ8Kernel, qmm_q8_body.h): x quantized in chunks of 32, xq [M, K]
  // int8, xd [M, K / 32, 4] float32 (each chunk's scale 4 times), xs [M, K / group_size] float32 (x
  // summed over each group).
  const int8_t* xq;
  const float* xd;
  const float* xs;
};

// Weight group read at position gi of the product (identity when every group is read).
inline int64_t read_group(const QmmArgs& a, int64_t gi) {
  return a.groups ? a.groups[gi] : gi;
}

// Length of x's rows (and of the dequantized scratch rows): the groups read times their size.
inline int x_len(const QmmArgs& a) {
  return a.G * a.group_size;
}

// Attention of R query rows over keys [s0, s1) of one KV head of a quantized cache (MLX's affine
// layout, one row per token, groups along head_dim): the flash-decoding partial of that key range.
struct AttnArgs {
  const float* q;         // [H, R, D] float32, row-contiguous
  const uint32_t* k;      // [H, C, D * k_bits / 32]; channel keys: [H, D, C * k_bits / 32]
  const void* k_scales;   // [H, C, D / group_size], k_dtype; channel keys: [H, D, C / group_size]
  const void* k_biases;
  const uint32_t* v;      // [H, C, Dv * v_bits / 32]
  const void* v_scales;   // [H, C, Dv / group_size], v_dtype
  const void* v_biases;
  int H, R, P, S, C, Cv, D, Dv, group_size, k_bits, v_bits;  // C, Cv: K and V capacity rows (tokens)
  Dtype k_dtype, v_dtype;
  float scale;
  bool channel_keys;      // KIVI's keys: each channel quantized along tokens (groups of group_size tokens)
};

// Attention of R query rows of one (request b, KV head h) over a paged KV pool, read through the
// token table's row index (no gather): the flash-decoding partial of keys [s0, s1) of that request's live
// tokens. Query row r is position r % L of the n_rep heads sharing KV head h (R = n_rep * L); it sees key t
// iff index[b, h, t] is a row of the pool, k_pos[b, t] <= q_pos[b, r % L] and, with window > 0,
// q_pos[b, r % L] - k_pos[b, t] < window.
// With quantized blocks (k_bits > 0) each pool row is packed in MLX's affine layout (groups along head_dim).
struct PagedAttnArgs {
  const float* q;          // [B * n_kv, R, D] float32, row-contiguous
  const void* k;           // [rows, D], kv_dtype: one layer of the pool (row = head * slots + slot);
                           // quantized: uint32 codes [rows, D * k_bits / 32]
  const void* v;           // [rows, Dv], kv_dtype; quantized: uint32 codes [rows, Dv * v_bits / 32]
  const int32_t* index;    // [B, n_kv, S] pool rows of each request's live tokens, right-padded
  const int32_t* q_pos;    // [B, L] original positions of the queries
  const int32_t* k_pos;    // [B, S] original positions of the keys
  int64_t rows;
  int n_kv, L, R, S, D, Dv, window;
  Dtype kv_dtype;
  float scale;
  // Quantized blocks only (k_bits 0: float blocks): scales / biases [rows, dim / group_size], sb_dtype.
  const void* k_scales;
  const void* k_biases;
  const void* v_scales;
  const void* v_biases;
  int group_size, k_bits, v_bits;
  Dtype sb_dtype;
};

// Per-row partial softmax state of one key range: running max m[R], sum l[R], unnormalized acc[R, Dv].
struct AttnPartial {
  float* m;
  float* l;
  float* acc;
};

// Softmax over rows of attention scores x [rows, S] (float32, row-contiguous) into y (may be x), causal
// for a prefill tile: row i is query position q0 + (i % R) % period, which sees key j iff j <= that position
// and, with window > 0, j > position - window. y[i, j] = exp(scale * x[i, j] - max) / sum over the keys the
// row sees, 0 for the others (and for every key of a row that sees none).
struct SoftmaxArgs {
  const float* x;
  float* y;
  int64_t R;  // rows per matrix (the leading axes are matrices)
  int S, period, q0, window;
  float scale;
};

// The vector e^x of the SIMD traits: x = n ln2 + r (ln2 split in two for exactness), Cephes' expf
// polynomial for e^r, 2^n from the exponent; below kExpLo (e.g. a masked -inf) the result is 0.
constexpr float kExpLo = -87.33654f;
constexpr float kExpHi = 88.72283f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// Keys per tile of the attention loop (dequantized K and V tiles stay in L1).
constexpr int kAttnTile = 32;

// Floats of per-thread scratch the attention kernels take for R query rows of head dims D / Dv: the K
// and V tiles, the rows' scores, the masks of up to R query positions and a row of zeros (AttnScratch).
inline size_t attn_scratch_floats(int D, int Dv, int R) {
  return size_t(kAttnTile) * size_t(D + Dv + 2 * R) + size_t(D > Dv ? D : Dv);
}

// The int8-activation product of a variant (qmm_q8_body.h), used for every product of the bit widths it
// takes: y = x @ dequantize(w).T with x rounded to int8 in chunks of 32 (one scale per chunk).
struct QmmQ8Kernel {
  bool bits8;  // takes 8-bit weights as well as 4-bit ones
  // x [M, K] float32, natural order -> the xq / xd / xs operands (see QmmArgs).
  void (*prepare)(const float* x, int M, int K, int group_size, int bits, int8_t* xq, float* xd, float* xs);
  // y[:, n0:n1] from xq / xd / xs; every group read (a.groups is nullptr).
  void (*rows)(const QmmArgs& a, int n0, int n1);
};

// A kernel variant: its vector width and its row loop.
struct QmmKernel {
  const char* name;  // "avx512", "avx2", "generic"
  int lanes;         // floats per vector register
  int rows_per_block;  // weight rows dequantized together (chunks of N are multiples of it)
  // x rows that `rows` keeps in registers with x row-major (M <= register_rows, `fused`) and with x blocked
  // (register_rows < M <= wide_rows, `fused_wide`: see x_block); more rows go through the L1 scratch.
  int register_rows, wide_rows;
  // Computes y[:, n0:n1]. scratch: rows_per_block * K floats, private to the calling thread.
  void (*rows)(const QmmArgs& a, int n0, int n1, float* scratch);
  // The partial of head h over keys [s0, s1) (query row r sees keys s <= S - P + r % P). scratch:
  // attn_scratch_floats(D, Dv, R) floats, private to the calling thread.
  void (*attend)(const AttnArgs& a, int h, int s0, int s1, AttnPartial out, float* scratch);
  // The partial of (request, KV head) bh = b * n_kv + h over its live keys [s0, s1). scratch:
  // attn_scratch_floats(D, Dv, R) floats, private to the calling thread.
  void (*paged_attend)(const PagedAttnArgs& a, int bh, int s0, int s1, AttnPartial out, float* scratch);
  // The causal softmax of rows [r0, r1) (see SoftmaxArgs).
  void (*softmax_rows)(const SoftmaxArgs& a, int64_t r0, int64_t r1);
  // y[i] = g[i] * sigmoid(g[i]) * u[i] for i < n (float32).
  void (*swiglu)(const float* g, const float* u, float* y, int64_t n);
  // y[i] = gelu_approx(g[i]) * u[i] for i < n (float32; GELU's tanh approximation, as a sigmoid).
  void (*geglu)(const float* g, const float* u, float* y, int64_t n);
  // The int8-activation product, where the variant has one (nullptr: every product in float32).
  const QmmQ8Kernel* q8 = nullptr;
};

// The layout `k.rows` reads x [M, K] in for a product of M rows of `bits`-bit weights (QmmArgs.x, load_x):
// 0 for row-major; for the rows of fused_wide, the width B of the blocks of x's columns it unpacks per
// step (2 * lanes codes at 4 bits, lanes at 8), x then stored block by block with the M rows of each
// together, element (m, k) at (k / B) * M * B + m * B + k % B, so that one pointer reaches every row.
inline int x_block(const QmmKernel& k, int M, int bits) {
  return M > k.register_rows && M <= k.wide_rows ? (bits == 4 ? 2 : 1) * k.lanes : 0;
}

const QmmKernel& kernel_avx512();
const QmmKernel& kernel_avx2();
const QmmKernel& kernel_generic();
// The AVX-512 / AVX2 variants with their int8-activation products (qmm.cpp; the CPU must have AVX-512
// VNNI / AVX2).
const QmmKernel& kernel_avx512_vnni();
const QmmKernel& kernel_avx2_int8();
const QmmQ8Kernel& q8_avx2();
const QmmQ8Kernel& q8_avx512_vnni();

}  // namespace mlx_infer_kernels
