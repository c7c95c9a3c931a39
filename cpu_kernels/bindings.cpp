// Python bindings (nanobind, in MLX's "mlx" domain so that mx.array passes through unchanged).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "qmm.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "mlx-infer's CPU kernels (see mlx_infer/kernels/cpu.py)";
  m.def("qmm", &mlx_infer_kernels::qmm, "x"_a, "w"_a, "scales"_a, "biases"_a, "group_size"_a, "bits"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "y [M, N] = x [M, K] @ dequantize(w, scales, biases).T, accumulated in float32.");
  m.def("dequantize_f32", &mlx_infer_kernels::dequantize_f32, "w"_a, "scales"_a, "biases"_a,
        "group_size"_a, "bits"_a, nb::kw_only(), "stream"_a = nb::none(),
        "The weight as float32 [N, K].");
  m.def("isa", &mlx_infer_kernels::isa, "The instruction set in use: avx512, avx2, neon or generic.");
  m.def("num_threads", &mlx_infer_kernels::num_threads, "Threads a product is split over.");
}
