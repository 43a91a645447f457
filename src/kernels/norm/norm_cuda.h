// RMSNorm on the GPU: the CUDA twin of kernels/norm/norm.h (k3::rmsnorm_forward).
//   y = weight ⊙ x / sqrt(mean(x²) + eps)        weight may be null (plain RMS normalisation)
// Math in fp32 (the CPU twin sums squares in fp64; at fp32 output both agree to ~1e-7), one rounding
// at the store. x and y are bf16 (uint16_t bits) or fp32 in any combination; weight is fp32.
// Device pointers; default stream; plain C++ header.
//
// Kernel: one block per row, the row held in registers (<= 32 floats per thread, 16-byte accesses
// when D, the strides and the pointers allow it, scalar otherwise), so x is read once from memory.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace k3::norm::cuda {

struct RmsNormParams {
  void* y = nullptr;  // [N, ld_y] of y_type; may equal x (in place) when the types match
  DType y_type = DType::F32;
  int64_t ld_y = 0;         // row stride in elements (0: D)
  const void* x = nullptr;  // [N, ld_x] of x_type
  DType x_type = DType::F32;
  int64_t ld_x = 0;               // row stride in elements (0: D)
  const float* weight = nullptr;  // [D] or null
  float eps = 1e-5f;
  int64_t N = 0, D = 0;
};

// Empty string when rmsnorm_forward can take p, else why not (types, D > 16384, N > 2^31-1, ...).
std::string can_run(const RmsNormParams& p);
// Throws k3::Error with can_run's reason when it cannot.
void rmsnorm_forward(const RmsNormParams& p);

// Shorthands for contiguous rows.
void rmsnorm_forward(float* y, const float* x, const float* weight, float eps, int64_t N, int64_t D);
void rmsnorm_forward(uint16_t* y, const uint16_t* x, const float* weight, float eps, int64_t N, int64_t D);
void rmsnorm_forward(uint16_t* y, const float* x, const float* weight, float eps, int64_t N, int64_t D);

}  // namespace k3::norm::cuda
