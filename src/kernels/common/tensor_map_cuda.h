// Tensor maps for Hopper's bulk tensor copies (TMA), for the .cu files of kernels that load tiles with
// ptx::tma_load_3d. Host code; needs the CUDA headers (CUtensorMap), so include it from .cu files.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace k3::cuda_tma {

// A 3-D bf16 tensor [d2][d1][d0] (d0 contiguous) at `base`, with byte strides stride1 (between
// consecutive d1) and stride2 (between consecutive d2), read in boxes of box0 × box1 × 1 elements
// with the 128-byte swizzle (box0 · 2 <= 128: one box row is one swizzle row), elements outside the
// tensor arriving as zeros. base 16-byte aligned, strides multiples of 16. `what` names the tensor in
// the k3::Error raised when the driver rejects it.
CUtensorMap bf16_3d_sw128(const void* base, uint64_t d0, uint64_t d1, uint64_t d2, uint64_t stride1, uint64_t stride2,
                          uint32_t box0, uint32_t box1, const char* what);

}  // namespace k3::cuda_tma
