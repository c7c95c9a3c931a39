// Fused attention over a quantized KV cache, flash-decoding style: the body of `mx.fast.metal_kernel` (MLX
// writes the signature around it), and, through cuda_kernels/metal_prelude.cuh, of its CUDA twin
// `mx.fast.cuda_kernel`. One threadgroup owns one (KV head, split of the sequence) and writes that split's
// partial softmax state; a small merge (mlx_infer/kernels/gpu_attention.py, mx ops) combines the splits:
//
//   out[h, r, :] = softmax_s(scale * q[h, r] . k[h, s]) v[h, s],  s <= S - P + r % P,  s < S
//
// Inputs (row-contiguous): q [n_kv, R, D] T (row r is query position r % P); k [n_kv, C, D * KBITS / 32]
// uint32, k_scales, k_biases [n_kv, C, D / GS] ST (MLX's affine layout along head_dim, one row per token,
// value j of a word in bits [KBITS*j, KBITS*j + KBITS)); v, v_scales, v_biases the same with VBITS and DV;
// lengths int32 [4] = (S valid rows, C capacity rows, split length SL (a multiple of 32), splits NS);
// softmax_scale float32 [1]. S and the scale are data, not template constants, so one compiled kernel
// serves every decode step. Outputs, float32, per (head, split, row): part_m [n_kv, NS, R] the running max
// of the scaled scores (-1e30 where the split holds no visible key), part_l [n_kv, NS, R] the sum of
// exp(score - max), part_acc [n_kv, NS, R, DV] the unnormalized sum of exp(score - max) * v.
// Template constants (written by MLX): T, ST, R (1..16 rows), P (positions, R % P == 0), D, DV (64 | 128 |
// 256), GS (32 | 64 | 128), KBITS, VBITS (4 | 8), NSG (SIMD groups per threadgroup; 4).
// Grid: (NS * 32 * NSG, n_kv, 1) threads, threadgroup (32 * NSG, 1, 1).
//
// q[h] is staged once in threadgroup memory, scaled, in float32 (with the sum of each 8-value chunk, as in
// qmm.metal: sum_d (s k_d + b) q_d = s sum_d k_d q_d + b sum_d q_d). The split is walked in tiles of BK = 32
// keys, three phases per tile, each a barrier apart:
//   1. scores: TPK = 8 consecutive lanes per key, NSG * 4 keys per pass, 32 / (4 * NSG) passes; lane `sub` of
//      a key reads the packed words of its D / 64 chunks of 8 values (chunks sub, sub + 8, ...: the lanes of a
//      SIMD group read 4 whole consecutive K rows) ONCE, dequantizes them in registers and applies them to
//      all R rows; the 8 lanes' partial dots meet in a butterfly of simd_shuffle_xor; masked keys (past the
//      split, or causally hidden from the row) score -1e30. Scores go to sc[R][BK].
//   2. online softmax: SIMD group g owns rows g, g + NSG, ...; lane = key of the tile; simd_max / simd_sum
//      give the tile's max and sum, the running max / sum live in registers; sc becomes exp(score - max) and
//      alpha[r] = exp(old max - new max).
//   3. P.V: lane owns VC = 4 consecutive values of a V row (chunk vc) for ALL R rows and the keys
//      kl, kl + KL, ... of the tile (KL = 4 * 32 * NSG / DV key lanes, consecutive lanes of one SIMD group);
//      each packed V word is read once, dequantized in registers and applied to every row; acc[R][VC] is
//      rescaled by alpha first. At the end the KL key lanes' accumulators meet in a simd_shuffle_xor
//      butterfly.
// The loops over rows, chunks and values have constant trip counts and are unrolled (`#pragma unroll`), so
// the accumulators (R * VC + R floats) live in registers. Threadgroup memory: (R * D * 9 / 8 + 33 R) floats,
// at most 20.6 KB (R = 16, D = 256). No infinities: `inf` is a macro in MLX's CUDA header.
//
// Metal words the body uses (cuda_kernels/metal_prelude.cuh maps them to CUDA, metal_kernels/host/metal_shim.h
// to host C++): threadgroup (only to declare arrays at kernel scope), uint, ushort, the thread attributes
// thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup and
// threadgroup_position_in_grid, metal::threadgroup_barrier, metal::mem_flags, metal::simd_sum, metal::simd_max,
// metal::simd_shuffle_xor, metal::exp, metal::max. No `device` / `constant` (only MLX's Metal signature has
// them) and no other attribute.

constexpr int CH = 8;                 // K values per chunk: one word at 4 bits, two at 8; inside one group
constexpr int TPK = 8;                // lanes per key in the score phase
constexpr int KVPW = 32 / KBITS;      // K values per packed word
constexpr uint KMASK = (1u << KBITS) - 1u;
constexpr int KWPC = CH / KVPW;       // packed K words per chunk
constexpr int KW = D * KBITS / 32;    // packed words per K row
constexpr int KG = D / GS;            // quantization groups per K row
constexpr int DC = D / CH;            // chunks per K row
constexpr int NCK = DC / TPK;         // chunks per lane per key
constexpr int BK = 32;                // keys per tile (= SIMD width: phase 2 reduces a tile's row in one group)
constexpr int TPG = 32 * NSG;         // threads per threadgroup
constexpr int KPP = TPG / TPK;        // keys per score pass
constexpr int NPASS = BK / KPP;       // score passes per tile
constexpr int VC = 4;                 // V values per lane: half a word at 4 bits, one at 8
constexpr int VVPW = 32 / VBITS;      // V values per packed word
constexpr uint VMASK = (1u << VBITS) - 1u;
constexpr int VW = DV * VBITS / 32;   // packed words per V row
constexpr int VG = DV / GS;           // quantization groups per V row
constexpr int NVC = DV / VC;          // V chunks per row
constexpr int KL = TPG / NVC;         // key lanes of the P.V phase
constexpr int RPS = (R + NSG - 1) / NSG;  // softmax rows per SIMD group
constexpr float NEG = -1.0e30f;       // the score of a masked key, and the max of a row with none visible

static_assert(D % (CH * TPK) == 0 && NCK >= 1, "D must be a multiple of 64");
static_assert(BK % KPP == 0 && NPASS >= 1, "NSG must be 1, 2, 4 or 8");
static_assert(TPG % NVC == 0 && KL >= 1 && KL <= 32 && BK % KL == 0, "DV must be 64, 128 or 256 (NSG = 4)");

threadgroup float qs[R * D];          // scale * q[h]: value d of row r at r * D + (d % CH) * DC + d / CH
threadgroup float qsum[R * DC];       // sum of each chunk of qs, row r at r * DC + chunk
threadgroup float sc[R * BK];         // the tile's scores, then exp(score - max); row r at r * BK + key
threadgroup float alpha[R];           // exp(old max - new max) of each row, for this tile

const int tid = int(thread_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int split = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);

const int S = lengths[0];
const int C = lengths[1];
const int SL = lengths[2];
const int NS = lengths[3];
const int s0 = split * SL;
const int s1 = s0 + SL < S ? s0 + SL : S;
const int hidden = S - P;             // row r sees keys s <= hidden + r % P
const float qk_scale = softmax_scale[0];

// Stage scale * q[h] (coalesced reads), then the chunk sums.
for (int i = tid; i < R * D; i += TPG) {
  const int r = i / D;
  const int d = i % D;
  qs[r * D + (d % CH) * DC + d / CH] = qk_scale * float(q[(h * R + r) * D + d]);
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
for (int i = tid; i < R * DC; i += TPG) {
  const int r = i / DC;
  const int c = i % DC;
  float sum = 0.0f;
  #pragma unroll
  for (int e = 0; e < CH; ++e) {
    sum += qs[r * D + e * DC + c];
  }
  qsum[i] = sum;
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

const int sub = lane % TPK;                          // phase 1: this lane's chunks of its key
const int kslot = sg * (32 / TPK) + lane / TPK;      // phase 1: this lane's key within a pass
const int kl = lane % KL;                            // phase 3: this lane's first key of the tile
const int vc = sg * (32 / KL) + lane / KL;           // phase 3: this lane's chunk of a V row
const int head_row = h * C;                          // cache row of token 0 of this head

float m_run[RPS];                     // phase 2: running max and sum of rows sg, sg + NSG, ...
float l_run[RPS];
#pragma unroll
for (int i = 0; i < RPS; ++i) {
  m_run[i] = NEG;
  l_run[i] = 0.0f;
}
float acc[R][VC];                     // phase 3: unnormalized output of V chunk vc, this lane's keys
#pragma unroll
for (int r = 0; r < R; ++r) {
  #pragma unroll
  for (int e = 0; e < VC; ++e) {
    acc[r][e] = 0.0f;
  }
}

for (int t0 = s0; t0 < s1; t0 += BK) {
  // 1. Scores of the tile's keys for all rows.
  #pragma unroll
  for (int pass = 0; pass < NPASS; ++pass) {
    const int key = pass * KPP + kslot;
    const int s = t0 + key;
    const bool live = s < s1;
    float part[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      part[r] = 0.0f;
    }
    if (live) {
      const int row = head_row + s;
      #pragma unroll
      for (int i = 0; i < NCK; ++i) {
        const int c = sub + TPK * i;
        const int g = c * CH / GS;
        const float ks = float(k_scales[row * KG + g]);
        const float kb = float(k_biases[row * KG + g]);
        uint wd[KWPC];
        #pragma unroll
        for (int w = 0; w < KWPC; ++w) {
          wd[w] = uint(k[row * KW + c * KWPC + w]);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          part[r] += kb * qsum[r * DC + c];
        }
        #pragma unroll
        for (int e = 0; e < CH; ++e) {
          const float kv = ks * float((wd[e / KVPW] >> (KBITS * (e % KVPW))) & KMASK);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            part[r] += kv * qs[r * D + e * DC + c];
          }
        }
      }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int offset = TPK / 2; offset > 0; offset >>= 1) {
        part[r] += metal::simd_shuffle_xor(part[r], ushort(offset));
      }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r % TPK == sub) {
        sc[r * BK + key] = live && s <= hidden + r % P ? part[r] : NEG;
      }
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

  // 2. Online softmax: SIMD group sg updates rows sg, sg + NSG, ...; lane = key.
  #pragma unroll
  for (int i = 0; i < RPS; ++i) {
    const int r = sg + NSG * i;
    if (r < R) {
      const float x = sc[r * BK + lane];
      const float m_new = metal::max(m_run[i], metal::simd_max(x));
      const float p = x > 0.5f * NEG ? metal::exp(x - m_new) : 0.0f;
      const float a = metal::exp(m_run[i] - m_new);
      l_run[i] = l_run[i] * a + metal::simd_sum(p);
      m_run[i] = m_new;
      sc[r * BK + lane] = p;
      if (lane == 0) {
        alpha[r] = a;
      }
    }
  }
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

  // 3. acc = alpha * acc + sum over this lane's keys of p * v.
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    const float a = alpha[r];
    #pragma unroll
    for (int e = 0; e < VC; ++e) {
      acc[r][e] *= a;
    }
  }
  const int g = vc * VC / GS;
  #pragma unroll
  for (int i = 0; i < BK / KL; ++i) {
    const int key = kl + KL * i;
    const int s = t0 + key;
    if (s < s1) {
      const int row = head_row + s;
      const float vs = float(v_scales[row * VG + g]);
      const float vb = float(v_biases[row * VG + g]);
      const uint word = uint(v[row * VW + vc * VC / VVPW]);
      const int shift = VBITS * (vc * VC % VVPW);
      float vv[VC];
      #pragma unroll
      for (int e = 0; e < VC; ++e) {
        vv[e] = vs * float((word >> (shift + VBITS * e)) & VMASK) + vb;
      }
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        const float p = sc[r * BK + key];
        #pragma unroll
        for (int e = 0; e < VC; ++e) {
          acc[r][e] += p * vv[e];
        }
      }
    }
  }
  // Every lane is done with sc and alpha before the next tile overwrites them.
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}

// The KL key lanes of each V chunk are consecutive lanes: sum their accumulators, then write the partials.
#pragma unroll
for (int r = 0; r < R; ++r) {
  #pragma unroll
  for (int e = 0; e < VC; ++e) {
    #pragma unroll
    for (int offset = KL / 2; offset > 0; offset >>= 1) {
      acc[r][e] += metal::simd_shuffle_xor(acc[r][e], ushort(offset));
    }
  }
}
const int out_row = (h * NS + split) * R;
#pragma unroll
for (int r = 0; r < R; ++r) {
  if (r % KL == kl) {
    #pragma unroll
    for (int e = 0; e < VC; ++e) {
      part_acc[(out_row + r) * DV + vc * VC + e] = acc[r][e];
    }
  }
}
#pragma unroll
for (int i = 0; i < RPS; ++i) {
  const int r = sg + NSG * i;
  if (r < R && lane == 0) {
    part_m[out_row + r] = m_run[i];
    part_l[out_row + r] = l_run[i];
  }
}
