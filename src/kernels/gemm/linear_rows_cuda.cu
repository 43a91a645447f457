// Several bf16 linears of a few rows in one launch (linear_rows_cuda.h).
#include <cuda_bf16.h>

#include <climits>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/gemm/linear_rows_cuda.h"

namespace k3::gemm::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

struct RowsArgs {
  const uint16_t* x;
  int64_t ld_x, K;
  int M, n_outs;
  const uint16_t* w[kLinearRowsMaxOutputs];
  void* y[kLinearRowsMaxOutputs];
  int64_t ld_y[kLinearRowsMaxOutputs];
  int64_t row_end[kLinearRowsMaxOutputs];  // running sum of N: output i owns warp rows [row_end[i-1], row_end[i])
  bool f32[kLinearRowsMaxOutputs];
  bool accumulate[kLinearRowsMaxOutputs];
};

using rowwise::bf16x8_to_f32;

// The first kPrefetchRuns of a lane's 16-byte runs of its weight row are loaded before the kernel waits on the
// previous one (pdl_cuda.cuh): all of a k3-1b row (K = 512 or 1024), the first 1024 columns of longer ones.
constexpr int kPrefetchRuns = 4;

// acc[m] += x[m, k .. k+7] · w8 for the step's rows (fmaf in k order).
__device__ __forceinline__ void rows_fma(float (&acc)[kLinearRowsMaxM], const uint4 w8, const RowsArgs& a, int64_t k) {
  float wf[8];
  bf16x8_to_f32(w8, wf);
#pragma unroll
  for (int m = 0; m < kLinearRowsMaxM; ++m) {
    if (m >= a.M) break;
    float xf[8];
    bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(a.x + m * a.ld_x + k)), xf);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[m] = fmaf(xf[i], wf[i], acc[m]);
  }
}

__global__ void __launch_bounds__(32 * kWarpsPerBlock) linear_rows_kernel(const __grid_constant__ RowsArgs a) {
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  int o = 0;
  while (o < a.n_outs && row >= a.row_end[o]) ++o;
  if (o == a.n_outs) return;  // (this warp touches nothing)
  const int64_t n = row - (o ? a.row_end[o - 1] : 0);
  const uint16_t* w = a.w[o] + n * a.K;
  uint4 wpre[kPrefetchRuns];
#pragma unroll
  for (int p = 0; p < kPrefetchRuns; ++p) {
    const int64_t k = 8 * lane + 256 * p;
    if (k < a.K) wpre[p] = __ldg(reinterpret_cast<const uint4*>(w + k));
  }
  pdl::wait_then_release();

  float acc[kLinearRowsMaxM];
#pragma unroll
  for (int m = 0; m < kLinearRowsMaxM; ++m) acc[m] = 0.0f;
#pragma unroll
  for (int p = 0; p < kPrefetchRuns; ++p) {
    const int64_t k = 8 * lane + 256 * p;
    if (k < a.K) rows_fma(acc, wpre[p], a, k);
  }
#pragma unroll 4
  for (int64_t k = 8 * lane + 256 * kPrefetchRuns; k < a.K; k += 256)
    rows_fma(acc, __ldg(reinterpret_cast<const uint4*>(w + k)), a, k);
#pragma unroll
  for (int m = 0; m < kLinearRowsMaxM; ++m) {
    if (m >= a.M) break;
    const float s = rowwise::warp_sum(acc[m]);
    if (lane == m) {
      if (a.accumulate[o]) static_cast<float*>(a.y[o])[m * a.ld_y[o] + n] += s;
      else if (a.f32[o]) static_cast<float*>(a.y[o])[m * a.ld_y[o] + n] = s;
      else static_cast<uint16_t*>(a.y[o])[m * a.ld_y[o] + n] = rowwise::f32_to_bf16_rne(s);
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

std::string linear_rows_can_run(const uint16_t* x, int64_t ld_x, int64_t M, int64_t K, const LinearRowsOutput* outs,
                                int n_outs) {
  if (M < 0 || M > kLinearRowsMaxM)
    return "linear_rows: M = " + std::to_string(M) + " rows, expected 0.." + std::to_string(kLinearRowsMaxM);
  if (n_outs < 1 || n_outs > kLinearRowsMaxOutputs)
    return "linear_rows: " + std::to_string(n_outs) + " outputs, expected 1.." + std::to_string(kLinearRowsMaxOutputs);
  if (K < 8 || K % 8 != 0 || K > INT_MAX)
    return "linear_rows: K = " + std::to_string(K) + " is not a positive multiple of 8";
  if (ld_x < K || ld_x % 8 != 0 || !aligned16(x))
    return "linear_rows: x must be 16-byte aligned with a row stride >= K and a multiple of 8";
  int64_t rows = 0;
  for (int i = 0; i < n_outs; ++i) {
    const LinearRowsOutput& o = outs[i];
    const std::string at = "linear_rows: output " + std::to_string(i) + ": ";
    if (!o.w || !aligned16(o.w)) return at + "weight null or not 16-byte aligned";
    if (o.N < 1) return at + "N = " + std::to_string(o.N);
    if (!o.y) return at + "null y";
    if (o.y_type != DType::BF16 && o.y_type != DType::F32) return at + "y must be BF16 or F32";
    if (o.accumulate && o.y_type != DType::F32) return at + "an accumulating output must be F32";
    if (o.ld_y && o.ld_y < o.N) return at + "row stride of y smaller than N";
    rows += o.N;
  }
  if (rows > INT_MAX) return "linear_rows: more than 2^31-1 weight rows";
  return {};
}

void linear_rows(const uint16_t* x, int64_t ld_x, int64_t M, int64_t K, const LinearRowsOutput* outs, int n_outs) {
  const std::string why = linear_rows_can_run(x, ld_x, M, K, outs, n_outs);
  if (!why.empty()) fail(why);
  if (M == 0) return;
  RowsArgs a{};
  a.x = x, a.ld_x = ld_x, a.K = K, a.M = int(M), a.n_outs = n_outs;
  int64_t rows = 0;
  for (int i = 0; i < n_outs; ++i) {
    a.w[i] = outs[i].w, a.y[i] = outs[i].y, a.ld_y[i] = outs[i].ld_y ? outs[i].ld_y : outs[i].N;
    a.f32[i] = outs[i].y_type == DType::F32;
    a.accumulate[i] = outs[i].accumulate;
    a.row_end[i] = rows += outs[i].N;
  }
  pdl::launch(linear_rows_kernel, unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock), 32 * kWarpsPerBlock, 0, a);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::gemm::cuda
