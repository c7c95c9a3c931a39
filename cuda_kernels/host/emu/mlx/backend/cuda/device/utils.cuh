// The CPU emulation's stand-in for MLX's mlx/backend/cuda/device/utils.cuh (found first on the include path of
// the emulated builds: g++ -I cuda_kernels/host/emu -I cuda_kernels/host), so the source `mx.fast.cuda_kernel`
// builds compiles for the emulator unchanged. See cuda_kernels/host/cuda_emu.h.

#pragma once

#include "cuda_emu.h"

// As mlx/backend/cuda/device/config.h.
#define MAX_NDIM 10
#define WARP_SIZE 32
