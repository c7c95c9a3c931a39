#include "rmm.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "mlx/backend/cpu/encoder.h"

namespace mlx_infer_kernels {
namespace {

// x [M, K] (natural order, float32) -> kept [M, G]: the `keep` groups of each row with the largest sum
// of |x| (equal sums: the lower index first).
std::vector<char> select_groups(const float* x, int M, int K, int gs, int keep) {
  const int G = K / gs;
  std::vector<char> kept(size_t(M) * G, 0);
  std::vector<float> score(G);
  std::vector<int> order(G);
  for (int m = 0; m < M; ++m) {
    const float* row = x + int64_t(m) * K;
    for (int g = 0; g < G; ++g) {
      float s = 0.0f;
      for (int j = 0; j < gs; ++j) s += std::fabs(row[g * gs + j]);
      score[g] = s;
    }
    std::iota(order.begin(), order.end(), 0);
    std::nth_element(order.begin(), order.begin() + (keep - 1), order.end(), [&](int a, int b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    for (int i = 0; i < keep; ++i) kept[size_t(m) * G + order[i]] = 1;
  }
  return kept;
}

}  // namespace

mx::array rmm_qmm(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int keep,
    mx::StreamOrDevice s) {
  auto [N, K] = check_weights(w, scales, biases, group_size, bits);
  if (x.ndim() != 2 || x.shape(1) != K || x.shape(0) < 1) {
    throw std::invalid_argument(
        "[rmm_qmm] x must be [M >= 1, " + std::to_string(K) + "] for w " + shape_str(w) + ", got " + shape_str(x));
  }
  if (keep < 1 || keep > K / group_size) {
    throw std::invalid_argument("[rmm_qmm] keep must be in [1, " + std::to_string(K / group_size) + "], got " +
                                std::to_string(keep));
  }
  to_kernel_dtype(x.dtype(), "x");
  mx::Stream stream = cpu_stream(s);
  return mx::array(
      {x.shape(0), N},
      mx::promote_types(x.dtype(), scales.dtype()),
      std::make_shared<RmmQmm>(stream, group_size, bits, keep),
      {x, row_contiguous(w, stream), row_contiguous(scales, stream), row_contiguous(biases, stream)});
}

void RmmQmm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const mx::array& x = inputs[0];
  QmmArgs a = product_args(inputs, outputs[0], stream(), group_size_, bits_);
  mx::cpu::get_command_encoder(stream()).dispatch(
      [a, keep = keep_, x]() mutable {
        const int M = a.M, K = a.K, gs = a.group_size, G = K / gs;
        std::vector<float> natural(size_t(M) * K);  // x as float32 [M, K], natural order
        load_x_as(x, row_offsets(x), 0, M, 8, 1, 0, natural.data());
        const std::vector<char> kept = select_groups(natural.data(), M, K, gs, keep);  // [M, G]
        std::vector<int32_t> groups;  // the union over rows, ascending
        for (int g = 0; g < G; ++g) {
          for (int m = 0; m < M; ++m) {
            if (kept[size_t(m) * G + g]) {
              groups.push_back(g);
              break;
            }
          }
        }
        const int U = int(groups.size());
        const int Kc = U * gs;
        std::vector<float> compact(size_t(M) * Kc);  // [M, U * gs]: a row's unkept groups are zero
        for (int m = 0; m < M; ++m) {
          for (int gi = 0; gi < U; ++gi) {
            const int g = groups[gi];
            float* dst = compact.data() + int64_t(m) * Kc + int64_t(gi) * gs;
            if (kept[size_t(m) * G + g]) {
              std::copy_n(natural.data() + int64_t(m) * K + int64_t(g) * gs, gs, dst);
            } else {
              std::fill_n(dst, gs, 0.0f);
            }
          }
        }
        const QmmKernel& k = kernel();
        std::vector<float> xbuf;  // in the kernel's order, on a cache line
        float* xf = aligned(xbuf, size_t(M) * Kc);
        load_x(compact.data(), strided_rows(M, Kc).data(), 1, M, Kc, a.bits, k.lanes, x_block(k, M, a.bits), xf);
        a.x = xf;
        a.groups = groups.data();
        a.G = U;
        split_rows(a.N, Kc, int64_t(M) * a.N * Kc, [&](int n0, int n1, float* scratch) {
          k.rows(a, n0, n1, scratch);
        });
      });
}

void RmmQmm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[rmm_qmm] the mlx-infer CPU kernels have no GPU implementation");
}

bool RmmQmm::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const RmmQmm&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && keep_ == o.keep_;
}

std::vector<mx::Shape> RmmQmm::output_shapes(const std::vector<mx::array>& inputs) {
  return {{inputs[0].shape(0), inputs[1].shape(0)}};
}

}  // namespace mlx_infer_kernels
