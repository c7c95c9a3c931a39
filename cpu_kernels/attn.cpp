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

// Fewest keys per split of a head's sequence (smaller splits cost more in merging than they balance).
constexpr int kMinSplitTokens = 256;
// Splits per thread over all heads (later ones balance a core that was busy).
constexpr int kSplitsPerThread = 4;

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
    if (bits != 4 && bits != 8) {
      throw std::invalid_argument("[quant_attention] bits must be 4 or 8, got " + std::to_string(bits));
    }
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("[quant_attention] group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
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
    ThreadPool& pool = ThreadPool::instance();
    const int most = (a.S + kMinSplitTokens - 1) / kMinSplitTokens;
    const int wanted = (kSplitsPerThread * pool.size() + a.H - 1) / a.H;
    const int splits = std::max(1, std::min(most, wanted));
    // Splits start on a tile, so that a tile of channel keys lies in one quantization group.
    const int per = ((a.S + splits - 1) / splits + kAttnTile - 1) / kAttnTile * kAttnTile;
    const int64_t row_floats = 2 + a.Dv;  // m, l, acc[Dv] of one row of one split
    std::vector<float> partials(size_t(a.H) * splits * a.R * row_floats);
    const size_t scratch = size_t(kAttnTile) * (a.D + a.Dv + a.R);
    pool.parallel_for(a.H * splits, [&](int c) {
      const int h = c / splits, sp = c % splits;
      const int s0 = sp * per, s1 = std::min(a.S, s0 + per);
      float* base = partials.data() + int64_t(c) * a.R * row_floats;
      AttnPartial p{base, base + a.R, base + 2 * a.R};
      if (s0 >= s1) {  // an empty split (only when S < splits * per rounds so): contributes nothing
        std::fill(p.m, p.m + a.R, -std::numeric_limits<float>::infinity());
        std::fill(p.l, p.l + a.R, 0.0f);
        return;
      }
      kernel().attend(a, h, s0, s1, p, thread_scratch(scratch));
    });
    for (int h = 0; h < a.H; ++h) {
      for (int r = 0; r < a.R; ++r) {
        float m = -std::numeric_limits<float>::infinity();
        for (int sp = 0; sp < splits; ++sp) {
          m = std::max(m, partials[(int64_t(h) * splits + sp) * a.R * row_floats + r]);
        }
        float* o = y + (int64_t(h) * a.R + r) * a.Dv;
        std::fill(o, o + a.Dv, 0.0f);
        float l = 0.0f;
        for (int sp = 0; sp < splits; ++sp) {
          const float* base = partials.data() + (int64_t(h) * splits + sp) * a.R * row_floats;
          if (base[a.R + r] == 0.0f) continue;
          const float w = std::exp(base[r] - m);
          l += w * base[a.R + r];
          const float* acc = base + 2 * a.R + int64_t(r) * a.Dv;
          for (int d = 0; d < a.Dv; ++d) o[d] += w * acc[d];
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < a.Dv; ++d) o[d] *= inv;
        lse_out[int64_t(h) * a.R + r] = m + std::log(l);
      }
    }
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

}  // namespace mlx_infer_kernels
