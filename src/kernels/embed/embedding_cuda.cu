// Token embedding gather and its deterministic scatter-add backward, fp32 (embedding_cuda.h).
#include "kernels/embed/embedding_cuda.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <numeric>

#include "core/cuda_check.cuh"
#include "core/error.h"

namespace k3::embed::cuda {

namespace {

constexpr int kThreads = 256;

// One block per position; threads over the row.
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(float* __restrict__ x, const float* __restrict__ table, const int32_t* __restrict__ ids,
                             int64_t D) {
  const int64_t n = blockIdx.x;
  const int32_t id = ids[n];
  float* xr = x + n * D;
  const float* tr = table + int64_t(id) * D;
  for (int64_t d = threadIdx.x; d < D; d += blockDim.x) xr[d] = id >= 0 ? tr[d] : NAN;
}

// Grid: x = run, y = block of kThreads columns; one thread per (run, column) owns that table entry.
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(float* __restrict__ dtable, const float* __restrict__ dx,
                              const int32_t* __restrict__ order, const int32_t* __restrict__ run_start,
                              const int32_t* __restrict__ run_id, int64_t D) {
  const int64_t d = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (d >= D) return;
  const int64_t r = blockIdx.x;
  const int32_t i0 = run_start[r], i1 = run_start[r + 1];
  double acc = 0.0;
  for (int32_t i = i0; i < i1; ++i) acc += double(dx[int64_t(order[i]) * D + d]);
  float* t = dtable + int64_t(run_id[r]) * D + d;
  *t = float(double(*t) + acc);
}

}  // namespace

EmbeddingRuns make_embedding_runs(const std::vector<int32_t>& ids, const std::vector<bool>* skip) {
  if (ids.size() > size_t(INT_MAX)) fail("embed::cuda::make_embedding_runs: ", ids.size(), " positions exceed 2^31-1");
  if (skip && skip->size() != ids.size())
    fail("embed::cuda::make_embedding_runs: ", skip->size(), " skip flags for ", ids.size(), " positions");
  for (size_t n = 0; n < ids.size(); ++n)
    if (ids[n] < 0) fail("embed::cuda::make_embedding_runs: ids[", n, "] = ", ids[n], " is negative");
  EmbeddingRuns r;
  for (size_t n = 0; n < ids.size(); ++n)
    if (!skip || !(*skip)[n]) r.order.push_back(int32_t(n));
  // Stable: equal ids keep position order.
  std::stable_sort(r.order.begin(), r.order.end(),
                   [&](int32_t a, int32_t b) { return ids[size_t(a)] < ids[size_t(b)]; });
  for (size_t i = 0; i < r.order.size(); ++i) {
    const int32_t id = ids[size_t(r.order[i])];
    if (i == 0 || id != r.run_id.back()) {
      r.run_start.push_back(int32_t(i));
      r.run_id.push_back(id);
    }
  }
  r.run_start.push_back(int32_t(r.order.size()));
  return r;
}

void embedding_forward(float* x, const float* table, const int32_t* ids, int64_t N, int64_t D) {
  if (N < 0 || D < 0) fail("embed::cuda::embedding_forward: negative shape N = ", N, ", D = ", D);
  if (N > INT_MAX) fail("embed::cuda::embedding_forward: N = ", N, " positions exceed the grid limit 2^31-1");
  if (N == 0 || D == 0) return;
  if (!x || !table || !ids) fail("embed::cuda::embedding_forward: null x, table or ids");
  const int threads = int(std::min<int64_t>(kThreads, (D + 31) / 32 * 32));
  embedding_forward_kernel<<<unsigned(N), threads>>>(x, table, ids, D);
  K3_CUDA_LAUNCH_CHECK();
}

void embedding_backward(float* dtable, const float* dx, const int32_t* order, const int32_t* run_start,
                        const int32_t* run_id, int64_t runs, int64_t D) {
  if (runs < 0 || D < 0) fail("embed::cuda::embedding_backward: negative shape runs = ", runs, ", D = ", D);
  if (runs > INT_MAX) fail("embed::cuda::embedding_backward: ", runs, " runs exceed the grid limit 2^31-1");
  if (runs == 0 || D == 0) return;
  if (!dtable || !dx || !order || !run_start || !run_id)
    fail("embed::cuda::embedding_backward: null dtable, dx, order, run_start or run_id");
  const int64_t col_blocks = (D + kThreads - 1) / kThreads;
  if (col_blocks > 65535) fail("embed::cuda::embedding_backward: D = ", D, " too large for the grid");
  embedding_backward_kernel<<<dim3(unsigned(runs), unsigned(col_blocks)), kThreads>>>(dtable, dx, order, run_start,
                                                                                      run_id, D);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::embed::cuda
