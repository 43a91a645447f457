// RMSNorm forward with saved statistics and its backward, fp32, for GPU training (norm_train_cuda.h).
//
// y and dx: one block per row, two passes over the row (the second reads it back from L1/L2): a
// block-wide fp32 sum (rowwise::block_sum, fixed order, every thread gets the same bits), then the
// elementwise store. dw: a column sum over rows, without atomics: kernel 1 gives each (chunk of
// kDwRowsPerChunk rows, column) one thread that sums its rows in order in double; kernel 2 adds the
// chunk sums, in chunk order, to dw. Double because the sum runs over up to every token of a
// batch and its terms have both signs; it costs nothing next to reading dy and x.
#include <climits>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/norm/norm_train_cuda.h"

namespace k3::norm::cuda {

namespace {

constexpr int kMaxThreads = 256;
constexpr int kColThreads = 256;

// Threads for a row of D: about 4 elements each, a multiple of the warp, at most kMaxThreads.
int row_threads(int64_t D) {
  int64_t t = (D + 3) / 4;
  t = (t + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > kMaxThreads ? kMaxThreads : t));
}

__global__ void __launch_bounds__(kMaxThreads)
    rms_forward_kernel(float* y, int64_t ldy, float* __restrict__ rstd, const float* x, int64_t ldx,
                       const float* __restrict__ w, float eps, int D) {
  __shared__ float sh[32][1];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * ldx;
  float* yr = y + n * ldy;
  float ss[1] = {0.0f};
  for (int d = int(threadIdx.x); d < D; d += int(blockDim.x)) ss[0] = fmaf(xr[d], xr[d], ss[0]);
  rowwise::block_sum<1>(ss, sh);
  const float r = 1.0f / sqrtf(ss[0] / float(D) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
  // Each thread reads x[d] before it writes y[d] (the same d): y may alias x.
  for (int d = int(threadIdx.x); d < D; d += int(blockDim.x)) {
    const float xh = xr[d] * r;
    yr[d] = w ? w[d] * xh : xh;
  }
}

// dx = r (g − xhat · m), g = dy ⊙ w, xhat = x r, m = mean(g ⊙ xhat) = r Σ(g ⊙ x) / D.
__global__ void __launch_bounds__(kMaxThreads)
    rms_backward_dx_kernel(float* dx, int64_t lddx, const float* dy, int64_t lddy, const float* __restrict__ x,
                           int64_t ldx, const float* __restrict__ rstd, const float* __restrict__ w, int D) {
  __shared__ float sh[32][1];
  const int64_t n = blockIdx.x;
  const float* xr = x + n * ldx;
  const float* dyr = dy + n * lddy;
  float* dxr = dx + n * lddx;
  float s[1] = {0.0f};
  for (int d = int(threadIdx.x); d < D; d += int(blockDim.x)) {
    const float g = w ? dyr[d] * w[d] : dyr[d];
    s[0] = fmaf(g, xr[d], s[0]);
  }
  rowwise::block_sum<1>(s, sh);
  const float r = rstd[n];
  const float m = r * s[0] / float(D);
  // Each thread reads dy[d] before it writes dx[d] (the same d): dx may alias dy.
  for (int d = int(threadIdx.x); d < D; d += int(blockDim.x)) {
    const float g = w ? dyr[d] * w[d] : dyr[d];
    dxr[d] = r * (g - (xr[d] * r) * m);
  }
}

// part[c][d] = Σ_{n in chunk c, in order} dy[n][d] · x[n][d] · rstd[n], in double.
// Grid: x = chunk, y = block of kColThreads columns.
__global__ void __launch_bounds__(kColThreads)
    rms_dw_partial_kernel(double* __restrict__ part, const float* __restrict__ dy, int64_t lddy,
                          const float* __restrict__ x, int64_t ldx, const float* __restrict__ rstd, int64_t N, int D) {
  const int d = int(blockIdx.y) * kColThreads + int(threadIdx.x);
  if (d >= D) return;
  const int64_t c = blockIdx.x;
  const int64_t n0 = c * kDwRowsPerChunk, n1 = n0 + kDwRowsPerChunk < N ? n0 + kDwRowsPerChunk : N;
  double acc = 0.0;
  for (int64_t n = n0; n < n1; ++n) acc += double(dy[n * lddy + d]) * (double(x[n * ldx + d]) * double(rstd[n]));
  part[c * D + d] = acc;
}

int64_t dw_chunks(int64_t N) { return (N + kDwRowsPerChunk - 1) / kDwRowsPerChunk; }

void check_shape(const char* fn, int64_t N, int64_t D) {
  if (N < 0 || D < 0) fail(fn, ": negative shape N = ", N, ", D = ", D);
  if (N > INT_MAX) fail(fn, ": N = ", N, " rows exceeds the grid limit 2^31-1");
  if (D > INT_MAX) fail(fn, ": D = ", D, " exceeds 2^31-1");
}
void check_ld(const char* fn, const char* name, int64_t ld, int64_t D) {
  if (ld < D) fail(fn, ": row stride ", name, " = ", ld, " is smaller than D = ", D);
}

}  // namespace

void rmsnorm_forward_train(float* y, int64_t ldy, float* rstd, const float* x, int64_t ldx, const float* w, float eps,
                           int64_t N, int64_t D) {
  constexpr const char* fn = "norm::cuda::rmsnorm_forward_train";
  check_shape(fn, N, D);
  check_ld(fn, "ldy", ldy, D);
  check_ld(fn, "ldx", ldx, D);
  if (N == 0) return;
  if (!rstd) fail(fn, ": null rstd");
  if (D == 0) fail(fn, ": D = 0 (the mean of an empty row)");
  if (!y || !x) fail(fn, ": null y or x");
  rms_forward_kernel<<<unsigned(N), row_threads(D)>>>(y, ldy, rstd, x, ldx, w, eps, int(D));
  K3_CUDA_LAUNCH_CHECK();
}

size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t D) {
  if (N <= 0 || D <= 0) return 0;
  return size_t(dw_chunks(N)) * size_t(D) * sizeof(double);
}

void rmsnorm_backward_train(float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy, const float* x,
                            int64_t ldx, const float* rstd, const float* w, int64_t N, int64_t D, void* workspace) {
  constexpr const char* fn = "norm::cuda::rmsnorm_backward_train";
  check_shape(fn, N, D);
  check_ld(fn, "lddx", lddx, D);
  check_ld(fn, "lddy", lddy, D);
  check_ld(fn, "ldx", ldx, D);
  if (N == 0 || D == 0) return;
  if (!dx || !dy || !x || !rstd) fail(fn, ": null dx, dy, x or rstd");
  if (dw) {
    if (!workspace) fail(fn, ": dw is given but the workspace is null (rmsnorm_backward_workspace_bytes)");
    // Before dx is written, so that dx may alias dy.
    const int64_t chunks = dw_chunks(N);
    auto* part = static_cast<double*>(workspace);
    const dim3 grid(unsigned(chunks), unsigned((D + kColThreads - 1) / kColThreads));
    if (grid.y > 65535u) fail(fn, ": D = ", D, " too large for the dw kernel's grid");
    rms_dw_partial_kernel<<<grid, kColThreads>>>(part, dy, lddy, x, ldx, rstd, N, int(D));
    K3_CUDA_LAUNCH_CHECK();
    elementwise::cuda::add_chunk_column_sums(dw, part, chunks, D);
  }
  rms_backward_dx_kernel<<<unsigned(N), row_threads(D)>>>(dx, lddx, dy, lddy, x, ldx, rstd, w, int(D));
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::norm::cuda
