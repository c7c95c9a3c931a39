// Row moves inside one array, in place when MLX can donate its buffer (the repacker's copy, kv/repack.py).
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mlx_infer_kernels {

namespace mx = mlx::core;

// out [R, W]: `a` [R, W] (any dtype) with row dst[i] replaced by row src[i] of `a` for every i; the reads
// see `a` before any write, so src and dst may overlap (a row named twice in dst gets its last move). src,
// dst int32 [M]; every index must lie in [0, R) (the caller checks: an index outside is skipped). When `a`
// is row-contiguous and nothing else holds its buffer, out takes that buffer and only the M rows are
// copied (a scatter of rows gathered from the same array copies all R rows: the gather holds the input).
// Throws std::invalid_argument on another ndim, src / dst not int32 [M] of one size, or a non-CPU stream.
mx::array move_rows(const mx::array& a, const mx::array& src, const mx::array& dst, mx::StreamOrDevice s = {});

// out [R, W]: `a` [R, W] with row dst[i] replaced by row i of x (x [..., W] of a's dtype, any leading shape
// flattened into M rows, any strides; a row named twice in dst gets its last write). dst int32 [M] in [0, R)
// (an index outside is skipped). In place as move_rows when MLX can donate a's buffer: a KV pool plane's
// write of a step's new tokens as one operation (a scatter wants its rows reshaped first).
// Throws std::invalid_argument on another ndim, dtype or width, or dst not int32 [M].
mx::array write_rows(const mx::array& a, const mx::array& x, const mx::array& dst, mx::StreamOrDevice s = {});

class MoveRows : public mx::Primitive {
 public:
  explicit MoveRows(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferMoveRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

class WriteRows : public mx::Primitive {
 public:
  explicit WriteRows(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "MlxInferWriteRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;
};

}  // namespace mlx_infer_kernels
