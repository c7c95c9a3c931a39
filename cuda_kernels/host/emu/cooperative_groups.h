// The CPU emulation's stand-in for CUDA's <cooperative_groups.h>, which MLX's default kernel header includes
// (and aliases as `cg`): the kernel bodies here use none of it. See cuda_kernels/host/cuda_emu.h.

#pragma once

namespace cooperative_groups {}
