// Quantized skinny matmul: the body of `mx.fast.metal_kernel` (MLX writes the signature around it),
// and, through cuda_kernels/metal_prelude.cuh, of its CUDA twin `mx.fast.cuda_kernel`.
//
//   y[M, N] = x[M, K] @ dequantize(w, scales, biases)[N, K]^T      (MLX's affine layout, transpose=True)
//
// Inputs (row-contiguous): x [M, K] T; w [N, K * BITS / 32] uint32, value j of a word in bits
// [BITS*j, BITS*j + BITS); scales, biases [N, K / GS] T. Output: y [M, N] T. Accumulation in float32.
// Template constants (written by MLX): T, M (1..16 rows), BITS (4 | 8), GS (32 | 64 | 128), K, N,
// NSG (SIMD groups per threadgroup), COLS (output columns per SIMD group).
//
// One threadgroup owns NSG * COLS output columns; its threads walk K in blocks of KB = 256 values.
// Per block the threadgroup stages x[:, block] once in threadgroup memory as float32 (lane-major, so the
// reads below are free of bank conflicts), plus the per-lane sums of x; lane l of every SIMD group then
// owns the block's values [8l, 8l + 8), which lie in one quantization group, reads each packed word of
// its COLS columns ONCE and applies it to all M rows, using
//   sum_k (s q_k + b) x_k = s sum_k q_k x_k + b sum_k x_k.
// Each SIMD group finally reduces its lanes' partial sums with simd_sum. The loops over columns, rows and a
// lane's values have constant trip counts and are unrolled (`#pragma unroll`, which Metal's and CUDA's
// compilers both take), so the accumulators live in registers.
//
// Metal words the body uses (cuda_kernels/metal_prelude.cuh maps them to CUDA, metal_kernels/host/metal_shim.h
// to host C++): threadgroup (only to declare arrays at kernel scope), uint, the thread attributes
// thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup and
// threadgroup_position_in_grid, metal::threadgroup_barrier, metal::mem_flags, metal::simd_sum. No `device` /
// `constant` (only MLX's Metal signature has them) and no other attribute.

constexpr int VPW = 32 / BITS;        // values per packed uint32 word
constexpr uint MASK = (1u << BITS) - 1u;
constexpr int CH = 8;                 // values per lane per K block: one word at 4 bits, two at 8
constexpr int WPL = CH / VPW;         // packed words per lane per K block
constexpr int KB = 32 * CH;           // K values per block
constexpr int KW = K / VPW;           // packed words per weight row
constexpr int KG = K / GS;            // quantization groups per weight row
constexpr int TPG = 32 * NSG;         // threads per threadgroup
constexpr int NCOL = NSG * COLS;      // output columns per threadgroup

threadgroup float xt[M * KB];         // x block: value p of row m at m * KB + (p % CH) * 32 + p / CH
threadgroup float xs[M * 32];         // sum over each lane's CH values of x, row m at m * 32 + lane

const int tid = int(thread_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int col0 = int(threadgroup_position_in_grid.x) * NCOL + int(simdgroup_index_in_threadgroup) * COLS;

float acc[COLS][M];                   // this lane's partial y[m, col0 + c]
#pragma unroll
for (int c = 0; c < COLS; ++c) {
  #pragma unroll
  for (int m = 0; m < M; ++m) {
    acc[c][m] = 0.0f;
  }
}

for (int k0 = 0; k0 < K; k0 += KB) {
  // Stage x[:, k0:k0 + KB] (zeros past K), coalesced reads from device memory.
  for (int i = tid; i < M * KB; i += TPG) {
    const int m = i / KB;
    const int p = i % KB;
    const int k = k0 + p;
    xt[m * KB + (p % CH) * 32 + p / CH] = k < K ? float(x[m * K + k]) : 0.0f;
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

  const int k = k0 + lane * CH;
  if (k < K) {
    const int g = k / GS;
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
      for (int v = 0; v < WPL; ++v) {
        wd[c][v] = live ? uint(w[n * KW + k / VPW + v]) : 0u;
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
