// Reduced quantized skinny matmul (RMM, arXiv 2608.13426): the body of `mx.fast.metal_kernel` (MLX writes the
// signature around it), and, through cuda_kernels/metal_prelude.cuh, of its CUDA twin `mx.fast.cuda_kernel`.
// The GPU twin of mlx_infer.kernels.rmm.rmm_qmm (oracle: reference_rmm_qmm):
//
//   s[m, g]  = sum_{j in group g} |x[m, j]|                  (float32, j ascending)
//   g beats h in row m  iff  s[m, g] > s[m, h], or s[m, g] == s[m, h] and g < h
//   kept[m, g] = (number of groups that beat g in row m) < KEEP
//   y[m, n]  = sum over kept g of sum_{j in g} x[m, j] * dequantize(w)[n, j]
//
// Inputs (row-contiguous): x [M, K] T; w [N, K * BITS / 32] uint32 (MLX's affine layout, value j of a word
// in bits [BITS*j, BITS*j + BITS)); scales, biases [N, K / GS] T. Output: y [M, N] T. Accumulation in float32.
// Template constants (written by MLX): T, M (1..16 rows), BITS (4 | 8), GS (32 | 64 | 128), K, N,
// NSG (SIMD groups per threadgroup), COLS (output columns per SIMD group), KEEP (1..K / GS).
// Limit: K / GS <= 256 groups (the scores live in the x staging array): K <= 8192 at GS 32, 16384 at GS 64,
// 32768 at GS 128 (checked here by static_assert and by mlx_infer.kernels.gpu_rmm.rmm_launch).
//
// Every threadgroup first derives the selection itself, from x alone (no host round trip):
//   1. scores s[m, g] into threadgroup memory (one thread per (row, group), summing j in ascending order,
//      as the CPU kernel does; the reference's float32 sum may round differently only for groups whose
//      scores differ by float32 rounding);
//   2. per (row, group), the number of groups that beat it (O(G) per pair, stopping once KEEP is reached)
//      gives kept[m, g];
//   3. used[g] = kept by some row; then the used groups, ascending, form a compact list of U groups.
// Then it runs the skinny qmm loop (metal_kernels/qmm.metal) over the U * GS values of the used groups only,
// in blocks of KB = 256: a group no row keeps has none of its packed words, scales or biases read, and row m
// multiplies x[m, j] where it keeps j's group and 0 where it does not. Per block the threadgroup stages the
// block of (compacted, masked) x once in threadgroup memory as float32, lane-major, plus the per-lane sums of
// x; lane l of every SIMD group owns the block's values [8l, 8l + 8), which lie in one group (CH = 8 divides
// GS) and so are 8 consecutive columns of w, reads each packed word of its COLS columns ONCE and applies it
// to all M rows, using sum_k (s q_k + b) x_k = s sum_k q_k x_k + b sum_k x_k. Each SIMD group finally
// reduces its lanes' partial sums with simd_sum.
//
// Metal words the body uses (cuda_kernels/metal_prelude.cuh maps them to CUDA, metal_kernels/host/metal_shim.h
// to host C++): threadgroup (only to declare arrays at kernel scope), uint, uchar, the thread attributes
// thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup and
// threadgroup_position_in_grid, metal::threadgroup_barrier, metal::mem_flags, metal::simd_sum, metal::abs.
// No `device` / `constant` (only MLX's Metal signature has them) and no other attribute.

constexpr int VPW = 32 / BITS;        // values per packed uint32 word
constexpr uint MASK = (1u << BITS) - 1u;
constexpr int CH = 8;                 // values per lane per block: one word at 4 bits, two at 8
constexpr int WPL = CH / VPW;         // packed words per lane per block
constexpr int KB = 32 * CH;           // values per block
constexpr int KW = K / VPW;           // packed words per weight row
constexpr int KG = K / GS;            // quantization groups per weight row
constexpr int TPG = 32 * NSG;         // threads per threadgroup
constexpr int NCOL = NSG * COLS;      // output columns per threadgroup
static_assert(KG <= KB, "rmm_qmm: at most 256 groups per row (the scores live in xt)");
static_assert(KEEP >= 1 && KEEP <= KG, "rmm_qmm: KEEP must be in [1, K / GS]");

threadgroup float xt[M * KB];         // first the scores (row m, group g at m * KB + g), then the x blocks:
                                      // value p of row m at m * KB + (p % CH) * 32 + p / CH
threadgroup float xs[M * 32];         // sum over each lane's CH values of x, row m at m * 32 + lane
threadgroup uchar kept[M * KG];       // kept[m * KG + g]: row m keeps group g
threadgroup uchar used[KG];           // some row keeps group g
threadgroup int ulist[KG];            // the used groups, ascending (the first nused[0] entries)
threadgroup int nused[1];

const int tid = int(thread_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int col0 = int(threadgroup_position_in_grid.x) * NCOL + int(simdgroup_index_in_threadgroup) * COLS;

// 1. Scores.
for (int i = tid; i < M * KG; i += TPG) {
  const int m = i / KG;
  const int g = i % KG;
  float s = 0.0f;
  for (int j = 0; j < GS; ++j) {
    s += metal::abs(float(x[m * K + g * GS + j]));
  }
  xt[m * KB + g] = s;
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

// 2. Selection: row m keeps g when fewer than KEEP groups beat it.
for (int i = tid; i < M * KG; i += TPG) {
  const int m = i / KG;
  const int g = i % KG;
  bool keep = true;
  if (KEEP < KG) {
    const float s = xt[m * KB + g];
    int beaten = 0;
    for (int h = 0; h < KG && beaten < KEEP; ++h) {
      const float t = xt[m * KB + h];
      beaten += (t > s || (t == s && h < g)) ? 1 : 0;
    }
    keep = beaten < KEEP;
  }
  kept[i] = keep ? uchar(1) : uchar(0);
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

// 3. The union over rows, then its compact ascending list (one thread: at most 256 steps).
for (int g = tid; g < KG; g += TPG) {
  uchar u = 0;
  for (int m = 0; m < M; ++m) {
    u |= kept[m * KG + g];
  }
  used[g] = u;
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
if (tid == 0) {
  int count = 0;
  for (int g = 0; g < KG; ++g) {
    if (used[g] != 0) {
      ulist[count] = g;
      ++count;
    }
  }
  nused[0] = count;
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
const int UK = nused[0] * GS;         // values of the used groups

float acc[COLS][M];                   // this lane's partial y[m, col0 + c]
#pragma unroll
for (int c = 0; c < COLS; ++c) {
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[c][m] = 0.0f;
  }
}

for (int v0 = 0; v0 < UK; v0 += KB) {
  // Stage the compacted block: value v of the used groups is column ulist[v / GS] * GS + v % GS of x, zero
  // in the rows that do not keep that group (and past the used values).
  for (int i = tid; i < M * KB; i += TPG) {
    const int m = i / KB;
    const int p = i % KB;
    const int v = v0 + p;
    float value = 0.0f;
    if (v < UK) {
      const int g = ulist[v / GS];
      if (kept[m * KG + g] != 0) {
        value = float(x[m * K + g * GS + v % GS]);
      }
    }
    xt[m * KB + (p % CH) * 32 + p / CH] = value;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
  for (int i = tid; i < M * 32; i += TPG) {
    const int m = i / 32;
    const int l = i % 32;
    float sum = 0.0f;
    #pragma unroll
    for (int j = 0; j < CH; ++j) {
      sum += xt[m * KB + j * 32 + l];
    }
    xs[i] = sum;
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

  const int v = v0 + lane * CH;
  if (v < UK) {
    const int g = ulist[v / GS];
    const int k = g * GS + v % GS;    // the lane's first column of w
    uint wd[COLS][WPL];
    float sc[COLS];
    float bi[COLS];
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
      const int n = col0 + c;
      const bool live = n < N;
      sc[c] = live ? float(scales[n * KG + g]) : 0.0f;
      bi[c] = live ? float(biases[n * KG + g]) : 0.0f;
      #pragma unroll
      for (int q = 0; q < WPL; ++q) {
        wd[c][q] = live ? uint(w[n * KW + k / VPW + q]) : 0u;
      }
    }
    #pragma unroll
    for (int m = 0; m < M; ++m) {
      const float xsum = xs[m * 32 + lane];
      #pragma unroll
      for (int c = 0; c < COLS; ++c) {
        acc[c][m] += bi[c] * xsum;
      }
    }
    #pragma unroll
    for (int e = 0; e < CH; ++e) {
      float xv[M];
      #pragma unroll
      for (int m = 0; m < M; ++m) {
        xv[m] = xt[m * KB + e * 32 + lane];
      }
      #pragma unroll
      for (int c = 0; c < COLS; ++c) {
        const float sq = sc[c] * float((wd[c][e / VPW] >> (BITS * (e % VPW))) & MASK);
        #pragma unroll
        for (int m = 0; m < M; ++m) {
          acc[c][m] += sq * xv[m];
        }
      }
    }
  }
  // Every lane is done with this block before the next one overwrites xt and xs.
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}

#pragma unroll
for (int c = 0; c < COLS; ++c) {
  const int n = col0 + c;
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    const float total = metal::simd_sum(acc[c][m]);
    if (lane == 0 && n < N) {
      y[m * N + n] = T(total);
    }
  }
}
