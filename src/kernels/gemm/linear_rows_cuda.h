// Several bf16 linears of the same few rows in one launch: the projections a decode step takes from one x̂
// (a KDA layer's q, k, v, g, f_a and beta; a MoE layer's router, latent down and shared gate and up).
//   y_i[M, N_i] (+)= x[M, K] · W_i[N_i, K]ᵀ     x, W_i bf16; y_i bf16 or fp32; fp32 accumulation
// cuBLAS runs each as its own GEMM, and at one to eight rows a decode step is a chain of such tiny launches whose
// count, not their bytes, sets its time. Here one warp computes one weight row for all M rows: lane l reads the
// row's bf16 in 16-byte runs at k = 8 l, 8 l + 256, ..., multiplies them with the same runs of every x row (fmaf in
// k order within a run), and a butterfly adds the lanes. So a row's result depends on x's row and W alone, never
// on M or on the other outputs: a sequence decoded alone or in a batch gets the same bits.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace k3::gemm::cuda {

constexpr int64_t kLinearRowsMaxM = 8;    // rows of x per call
constexpr int kLinearRowsMaxOutputs = 8;  // linears per call

struct LinearRowsOutput {
  const uint16_t* w = nullptr;  // bf16 [N, K], row-major, 16-byte aligned
  int64_t N = 0;
  void* y = nullptr;  // [M, ld_y] of y_type
  DType y_type = DType::BF16;
  int64_t ld_y = 0;         // elements (0: N)
  bool accumulate = false;  // y += x · Wᵀ (F32 y only): the fp32 sum added to y, rounded once
};

// Empty string when linear_rows can take the call, else why not (M, K, output count, alignment, strides).
std::string linear_rows_can_run(const uint16_t* x, int64_t ld_x, int64_t M, int64_t K, const LinearRowsOutput* outs,
                                int n_outs);
// Throws k3::Error with linear_rows_can_run's reason. x: bf16 [M, ld_x], ld_x and K multiples of 8.
void linear_rows(const uint16_t* x, int64_t ld_x, int64_t M, int64_t K, const LinearRowsOutput* outs, int n_outs);

}  // namespace k3::gemm::cuda
