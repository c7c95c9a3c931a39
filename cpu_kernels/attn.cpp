#include "attn.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "mlx/backend/cpu/encoder.h"
#include "thread_pool.h"

namespace mlx_infer_kernels {
namespace {

// Keys per split of a head's sequence. The splits start at fixed multiples of it, whatever the length, so a
// query row's result does not depend on how many keys or rows the call has: a verify forward's rows equal
// the decode steps' bit for bit (keys a row does not see add exact zeros; splits it sees none of are skipped).
constexpr int kSplitTokens = 256;
static_assert(kSplitTokens % kAttnTile == 0, "splits start on a tile");

// Flash-decoding (arXiv 2307.08691) over H heads of R query rows: head h's keys [0, length(h)) are split
// into ranges of kSplitTokens keys, spread with the other heads' over the pool's threads, attend(h, s0, s1,
// partial, scratch) computes each range's partial, and the partials of a row are merged in order into
// store(h, r, o, lse): o its Dv normalized outputs (zeros for a row that saw no key), lse the log of its
// softmax denominator (-inf then). max_length bounds every length(h); scratch_floats per thread.
template <class Length, class Attend, class Store>
void flash_decode(int H, int R, int Dv, int max_length, size_t scratch_floats, Length length, Attend attend,
                  Store store) {
  ThreadPool& pool = ThreadPool::instance();
  const int per = kSplitTokens;
  const int splits = std::max(1, (max_length + per - 1) / per);
  const int64_t row_floats = 2 + Dv;  // m, l, acc[Dv] of one row of one split
  std::vector<float> partials(size_t(H) * splits * R * row_floats);
  pool.parallel_for(H * splits, [&](int c) {
    const int h = c / splits, sp = c % splits;
    const int s0 = sp * per, s1 = std::min(length(h), s0 + per);
    float* base = partials.data() + int64_t(c) * R * row_floats;
    AttnPartial p{base, base + R, base + 2 * R};
    if (s0 >= s1) {  // an empty split (a short head, or S < splits * per rounding so): contributes nothing
      std::fill(p.m, p.m + R, -std::numeric_limits<float>::infinity());
      std::fill(p.l, p.l + R, 0.0f);
      return;
    }
    attend(h, s0, s1, p, thread_scratch(scratch_floats));
  });
  std::vector<float> o(Dv);
  for (int h = 0; h < H; ++h) {
    for (int r = 0; r < R; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int sp = 0; sp < splits; ++sp) {
        m = std::max(m, partials[(int64_t(h) * splits + sp) * R * row_floats + r]);
      }
      std::fill(o.begin(), o.end(), 0.0f);
      float l = 0.0f;
      for (int sp = 0; sp < splits; ++sp) {
        const float* base = partials.data() + (int64_t(h) * splits + sp) * R * row_floats;
        if (base[R + r] == 0.0f) continue;
        const float w = std::exp(base[r] - m);
        l += w * base[R + r];
        const float* acc = base + 2 * R + int64_t(r) * Dv;
        for (int d = 0; d < Dv; ++d) o[d] += w * acc[d];
      }
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int d = 0; d < Dv; ++d) o[d] *= inv;
      store(h, r, o.data(), l > 0.0f ? m + std::log(l) : -std::numeric_limits<float>::infinity());
    }
  }
}

// Checks one packed cache (w, scales, biases) [H, C, dim * bits / 32] / [H, C, dim / group_size];
// returns dim.
int check_cache(const mx::array& w, const mx::array& scales, const mx::array& biases, int group_size, int bits,
                const char* what) {
  const std::string name = std::string("[quant_attention] ") + what;
  if (w.ndim() != 3 || w.dtype() != mx::uint32) {
    throw std::invalid_argument(name + " must be a 3-D uint32 array, got " + shape_str(w));
  }
  const int dim = w.shape(2) * 32 / bits;
  if (dim % 32 != 0 || dim % group_size != 0) {
    throw std::invalid_argument(name + ": head dim " + std::to_string(dim) + " must be a multiple of 32 and of group_size");
  }
  const mx::Shape sb{w.shape(0), w.shape(1), dim / group_size};
  if (scales.shape() != sb || biases.shape() != sb || scales.dtype() != biases.dtype()) {
    throw std::invalid_argument(name + " scales and biases must be one dtype, shaped " +
                                shape_str(mx::zeros(sb, mx::float32)) + ", got " + shape_str(scales) + " and " +
                                shape_str(biases));
  }
  to_kernel_dtype(scales.dtype(), what);
  return dim;
}

}  // namespace

std::vector<mx::array> quant_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v,
    const mx::array& v_scales,
    const mx::array& v_biases,
    int length,
    float scale,
    int positions,
    int group_size,
    int k_bits,
    int v_bits,
    bool channel_keys,
    mx::StreamOrDevice s) {
  for (int bits : {k_bits, v_bits}) {
    check_bits(bits, "quant_attention");
  }
  check_group_size(group_size, "quant_attention");
  int D, C;
  if (channel_keys) {
    if (k.ndim() != 3 || k.dtype() != mx::uint32) {
      throw std::invalid_argument("[quant_attention] channel k must be a 3-D uint32 array, got " + shape_str(k));
    }
    D = k.shape(1);
    C = k.shape(2) * 32 / k_bits;
    const mx::Shape sb{k.shape(0), D, C / group_size};
    if (C % group_size != 0 || k_scales.shape() != sb || k_biases.shape() != sb ||
        k_scales.dtype() != k_biases.dtype()) {
      throw std::invalid_argument("[quant_attention] channel k scales and biases must be one dtype, shaped " +
                                  shape_str(mx::zeros(sb, mx::float32)) + ", got " + shape_str(k_scales));
    }
    to_kernel_dtype(k_scales.dtype(), "k_scales");
    if (D % 32 != 0) {
      throw std::invalid_argument("[quant_attention] head dim " + std::to_string(D) + " must be a multiple of 32");
    }
  } else {
    D = check_cache(k, k_scales, k_biases, group_size, k_bits, "k");
    C = k.shape(1);
  }
  check_cache(v, v_scales, v_biases, group_size, v_bits, "v");
  if (v.shape(0) != k.shape(0) || (!channel_keys && v.shape(1) != C)) {
    throw std::invalid_argument("[quant_attention] k and v must have the same heads and rows, got " + shape_str(k) +
                                " and " + shape_str(v));
  }
  C = std::min(C, v.shape(1));
  if (q.ndim() != 3 || q.shape(0) != k.shape(0) || q.shape(2) != D || q.shape(1) < 1) {
    throw std::invalid_argument("[quant_attention] q must be [" + std::to_string(k.shape(0)) + ", R, " +
                                std::to_string(D) + "], got " + shape_str(q));
  }
  if (positions < 1 || length < positions || length > C || q.shape(1) % positions != 0) {
    throw std::invalid_argument("[quant_attention] need 1 <= positions <= length <= cache rows and R a multiple of positions");
  }
  to_kernel_dtype(q.dtype(), "q");
  mx::Stream stream = cpu_stream(s);
  mx::array qf = row_contiguous(mx::astype(q, mx::float32, stream), stream);
  const int Dv = v.shape(2) * 32 / v_bits;
  return mx::array::make_arrays(
      {{q.shape(0), q.shape(1), Dv}, {q.shape(0), q.shape(1)}}, {mx::float32, mx::float32},
      std::make_shared<QuantAttention>(stream, length, scale, positions, group_size, k_bits, v_bits, channel_keys),
      {qf, row_contiguous(k, stream), row_contiguous(k_scales, stream), row_contiguous(k_biases, stream),
       row_contiguous(v, stream), row_contiguous(v_scales, stream), row_contiguous(v_biases, stream)});
}

void QuantAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const char* names[] = {"q", "k", "k_scales", "k_biases", "v", "v_scales", "v_biases"};
  for (size_t i = 0; i < inputs.size(); ++i) require_row_contiguous(inputs[i], names[i]);
  mx::array& out = outputs[0];
  mx::array& lse = outputs[1];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  lse.set_data(mx::allocator::malloc(lse.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const mx::array& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.set_output_array(lse);
  AttnArgs a{};
  a.q = inputs[0].data<float>();
  a.k = inputs[1].data<uint32_t>();
  a.k_scales = inputs[2].data<void>();
  a.k_biases = inputs[3].data<void>();
  a.v = inputs[4].data<uint32_t>();
  a.v_scales = inputs[5].data<void>();
  a.v_biases = inputs[6].data<void>();
  a.H = inputs[0].shape(0);
  a.R = inputs[0].shape(1);
  a.D = inputs[0].shape(2);
  a.channel_keys = channel_keys_;
  a.C = channel_keys_ ? inputs[1].shape(2) * 32 / k_bits_ : inputs[1].shape(1);
  a.Cv = inputs[4].shape(1);
  a.Dv = out.shape(2);
  a.S = length_;
  a.P = positions_;
  a.group_size = group_size_;
  a.k_bits = k_bits_;
  a.v_bits = v_bits_;
  a.k_dtype = to_kernel_dtype(inputs[2].dtype(), "k_scales");
  a.v_dtype = to_kernel_dtype(inputs[5].dtype(), "v_scales");
  a.scale = scale_;
  encoder.dispatch([a, y = out.data<float>(), lse_out = lse.data<float>()]() {
    flash_decode(
        a.H, a.R, a.Dv, a.S, attn_scratch_floats(a.D, a.Dv, a.R), [&](int) { return a.S; },
        [&](int h, int s0, int s1, AttnPartial p, float* scratch) { kernel().attend(a, h, s0, s1, p, scratch); },
        [&](int h, int r, const float* o, float lse) {
          std::copy(o, o + a.Dv, y + (int64_t(h) * a.R + r) * a.Dv);
          lse_out[int64_t(h) * a.R + r] = lse;
        });
  });
}

void QuantAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[quant_attention] the mlx-infer CPU kernels have no GPU implementation");
}

bool QuantAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const QuantAttention&>(other);
  return length_ == o.length_ && scale_ == o.scale_ && positions_ == o.positions_ &&
         group_size_ == o.group_size_ && k_bits_ == o.k_bits_ && v_bits_ == o.v_bits_ &&
         channel_keys_ == o.channel_keys_;
}

std::vector<mx::Shape> QuantAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[0].shape(1), inputs[4].shape(2) * 32 / v_bits_},
          {inputs[0].shape(0), inputs[0].shape(1)}};
}

namespace {

// Throws std::invalid_argument naming `what` unless `a` is an int32 array of shape `shape`.
void check_int32(const mx::array& a, const mx::Shape& shape, const char* what) {
  if (a.dtype() != mx::int32 || a.shape() != shape) {
    throw std::invalid_argument(std::string("[paged_attention] ") + what + " must be int32 " +
                                shape_str(mx::zeros(shape, mx::float32)) + ", got " + shape_str(a) +
                                (a.dtype() == mx::int32 ? "" : " (not int32)"));
  }
}

// Stores o [n] floats as dtype dt at y.
void store_row(const float* o, int n, Dtype dt, void* y) {
  if (dt == Dtype::f32) {
    std::copy(o, o + n, static_cast<float*>(y));
  } else if (dt == Dtype::f16) {
    auto* out = static_cast<mx::float16_t*>(y);
    for (int d = 0; d < n; ++d) out[d] = static_cast<mx::float16_t>(o[d]);
  } else {
    auto* out = static_cast<mx::bfloat16_t*>(y);
    for (int d = 0; d < n; ++d) out[d] = static_cast<mx::bfloat16_t>(o[d]);
  }
}

}  // namespace

namespace {

// Checks the operands paged_attention and paged_quant_attention share (q [B, n_q, L, D], the head dims D
// and Dv, the index, lengths, positions and window).
void check_paged_operands(const mx::array& q, int D, int Dv, const mx::array& index, const mx::array& lengths,
                          const mx::array& q_pos, const mx::array& k_pos, int window, const std::string& pools) {
  const int B = q.shape(0), n_q = q.shape(1), L = q.shape(2);
  if (q.shape(3) != D || D % 16 != 0 || Dv % 16 != 0 || Dv < 16) {
    throw std::invalid_argument("[paged_attention] head dims must agree (q " + shape_str(q) + ", " + pools +
                                ") and be multiples of 16 (D " + std::to_string(D) + ", Dv " + std::to_string(Dv) + ")");
  }
  if (index.ndim() != 3 || index.shape(0) != B || index.shape(1) < 1 || n_q % index.shape(1) != 0) {
    throw std::invalid_argument("[paged_attention] index must be int32 [B=" + std::to_string(B) +
                                ", n_kv, S] with n_q (" + std::to_string(n_q) + ") a multiple of n_kv, got " +
                                shape_str(index));
  }
  const int S = index.shape(2);
  check_int32(index, index.shape(), "index");
  check_int32(lengths, {B}, "lengths");
  check_int32(q_pos, {B, L}, "q_pos");
  check_int32(k_pos, {B, S}, "k_pos");
  if (window < 0) {
    throw std::invalid_argument("[paged_attention] window must be >= 0 (0: none), got " + std::to_string(window));
  }
}

void check_paged_q(const mx::array& q) {
  if (q.ndim() != 4 || q.shape(2) < 1) {
    throw std::invalid_argument("[paged_attention] q must be [B, n_q, L, D] with L >= 1, got " + shape_str(q));
  }
  to_kernel_dtype(q.dtype(), "q");
}

}  // namespace

mx::array paged_attention(
    const mx::array& q,
    const mx::array& k_pool,
    const mx::array& v_pool,
    const mx::array& index,
    const mx::array& lengths,
    const mx::array& q_pos,
    const mx::array& k_pos,
    float scale,
    int window,
    mx::StreamOrDevice s) {
  check_paged_q(q);
  // the pools' leading dims, one row per combination (a dense cache's buffer [B, n_kv, capacity, D] as it is)
  if (k_pool.ndim() < 2 || v_pool.ndim() != k_pool.ndim() || k_pool.dtype() != v_pool.dtype() ||
      !std::equal(k_pool.shape().begin(), k_pool.shape().end() - 1, v_pool.shape().begin())) {
    throw std::invalid_argument("[paged_attention] k_pool and v_pool must be [rows..., D] and [rows..., Dv] of one dtype, got " +
                                shape_str(k_pool) + " and " + shape_str(v_pool));
  }
  to_kernel_dtype(k_pool.dtype(), "k_pool");
  check_paged_operands(q, k_pool.shape(-1), v_pool.shape(-1), index, lengths, q_pos, k_pos, window,
                       "k_pool " + shape_str(k_pool));
  mx::Stream stream = cpu_stream(s);
  // The operands go in as they are (a lazily computed one would need a copy operation in the graph to be
  // known row-contiguous now): eval_cpu reads each through contiguous_data.
  return mx::array(
      {q.shape(0), q.shape(1), q.shape(2), v_pool.shape(-1)}, q.dtype(), std::make_shared<PagedAttention>(stream, scale, window),
      {mx::astype(q, mx::float32, stream), k_pool, v_pool, index, lengths, q_pos, k_pos});
}

mx::array paged_quant_attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& k_scales,
    const mx::array& k_biases,
    const mx::array& v,
    const mx::array& v_scales,
    const mx::array& v_biases,
    const mx::array& index,
    const mx::array& lengths,
    const mx::array& q_pos,
    const mx::array& k_pos,
    float scale,
    int group_size,
    int window,
    mx::StreamOrDevice s) {
  check_paged_q(q);
  check_group_size(group_size, "paged_attention");
  int bits[2], dims[2];
  const mx::array* packed[2][3] = {{&k, &k_scales, &k_biases}, {&v, &v_scales, &v_biases}};
  for (int i = 0; i < 2; ++i) {
    const mx::array &w = *packed[i][0], &sc = *packed[i][1], &bi = *packed[i][2];
    const std::string name = i == 0 ? "k" : "v";
    if (w.ndim() != 2 || w.dtype() != mx::uint32 || sc.ndim() != 2 || sc.shape() != bi.shape() ||
        sc.dtype() != bi.dtype() || sc.shape(0) != w.shape(0) || w.shape(0) != k.shape(0) || sc.shape(1) < 1 ||
        (w.shape(1) * 32) % (sc.shape(1) * group_size) != 0) {
      throw std::invalid_argument("[paged_attention] " + name + " must be uint32 codes [rows, dim * bits / 32] with " +
                                  "scales and biases [rows, dim / group_size] of one dtype, the rows of k; got " +
                                  shape_str(w) + ", " + shape_str(sc) + ", " + shape_str(bi));
    }
    to_kernel_dtype(sc.dtype(), (name + "_scales").c_str());
    dims[i] = sc.shape(1) * group_size;
    bits[i] = w.shape(1) * 32 / dims[i];
    check_bits(bits[i], "paged_attention", name + " ");
    if (dims[i] % 32 != 0) {
      throw std::invalid_argument("[paged_attention] quantized head dim " + std::to_string(dims[i]) +
                                  " must be a multiple of 32");
    }
  }
  if (k_scales.dtype() != v_scales.dtype()) {
    throw std::invalid_argument("[paged_attention] k and v scales must be one dtype");
  }
  check_paged_operands(q, dims[0], dims[1], index, lengths, q_pos, k_pos, window, "k " + shape_str(k));
  mx::Stream stream = cpu_stream(s);
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, stream)};  // as they are: see paged_attention
  for (const mx::array* a : {&k, &k_scales, &k_biases, &v, &v_scales, &v_biases, &index, &lengths, &q_pos, &k_pos}) {
    inputs.push_back(*a);
  }
  return mx::array({q.shape(0), q.shape(1), q.shape(2), dims[1]}, q.dtype(),
                   std::make_shared<PagedAttention>(stream, scale, window, group_size, bits[0], bits[1]), inputs);
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const bool quant = k_bits_ > 0;
  mx::array& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const mx::array& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  const int at = quant ? 7 : 3;  // where index, lengths, q_pos, k_pos start
  const mx::array& index = inputs[at];
  PagedAttnArgs a{};
  a.rows = int64_t(inputs[1].size()) / inputs[1].shape(-1);  // pool rows: the leading dims together
  a.n_kv = index.shape(1);
  a.L = inputs[0].shape(2);
  a.R = inputs[0].shape(1) / a.n_kv * a.L;
  a.S = index.shape(2);
  a.D = inputs[0].shape(3);
  a.Dv = out.shape(3);
  a.window = window_;
  a.scale = scale_;
  if (quant) {
    a.group_size = group_size_;
    a.k_bits = k_bits_;
    a.v_bits = v_bits_;
    a.sb_dtype = to_kernel_dtype(inputs[2].dtype(), "k_scales");
  } else {
    a.kv_dtype = to_kernel_dtype(inputs[1].dtype(), "k_pool");
  }
  const int B = index.shape(0);
  const Dtype out_dtype = to_kernel_dtype(out.dtype(), "out");
  const int64_t row_bytes = int64_t(a.Dv) * out.itemsize();
  encoder.dispatch([a, B, quant, at, out_dtype, row_bytes, inputs, y = out.data<char>()]() mutable {
    std::vector<std::vector<char>> copies(inputs.size());  // of the inputs that are not row-contiguous
    auto data = [&](int i) { return contiguous_data(inputs[size_t(i)], copies[size_t(i)]); };
    a.q = static_cast<const float*>(data(0));
    a.k = data(1);
    a.v = data(quant ? 4 : 2);
    if (quant) {
      a.k_scales = data(2);
      a.k_biases = data(3);
      a.v_scales = data(5);
      a.v_biases = data(6);
    }
    a.index = static_cast<const int32_t*>(data(at));
    const int32_t* lengths = static_cast<const int32_t*>(data(at + 1));
    a.q_pos = static_cast<const int32_t*>(data(at + 2));
    a.k_pos = static_cast<const int32_t*>(data(at + 3));
    flash_decode(
        B * a.n_kv, a.R, a.Dv, a.S, attn_scratch_floats(a.D, a.Dv, a.R),
        [&](int bh) { return std::clamp(lengths[bh / a.n_kv], 0, a.S); },
        [&](int bh, int s0, int s1, AttnPartial p, float* scratch) { kernel().paged_attend(a, bh, s0, s1, p, scratch); },
        [&](int bh, int r, const float* o, float) { store_row(o, a.Dv, out_dtype, y + (int64_t(bh) * a.R + r) * row_bytes); });
  });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[paged_attention] the mlx-infer CPU kernels have no GPU implementation");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const PagedAttention&>(other);
  return scale_ == o.scale_ && window_ == o.window_ && group_size_ == o.group_size_ && k_bits_ == o.k_bits_ &&
         v_bits_ == o.v_bits_;
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  const mx::Shape& q = inputs[0].shape();
  const int Dv = k_bits_ > 0 ? inputs[5].shape(1) * group_size_ : inputs[2].shape(1);
  return {{q[0], q[1], q[2], Dv}};
}

}  // namespace mlx_infer_kernels
