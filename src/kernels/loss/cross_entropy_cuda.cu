// Vocabulary-chunked softmax cross-entropy, fp32 (cross_entropy_cuda.h).
//
// ce_chunk_update: one block per row. Each thread keeps an online (max m, sum s of e^(l−m)) pair
// over its columns (one expf per element: a new maximum rescales s instead of adding a term), the
// pairs are merged down each warp, then thread 0 merges the warps in order and the chunk into the
// row's state. The merge of (m1, s1) and (m2, s2) is (M, s1·e^(m1−M) + s2·e^(m2−M)) with
// M = max(m1, m2); an empty pair is (−inf, 0). NaN logits reach the sum (and so the loss) and are
// never dropped by the max.
#include "kernels/loss/cross_entropy_cuda.h"

#include <climits>
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"

namespace k3::loss::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void lse_push(float& m, float& s, float x) {
  if (x > m) {
    s = s * expf(m - x) + 1.0f;  // m = −inf: s is 0 and expf(−inf) = 0
    m = x;
  } else if (x != -INFINITY) {  // a −inf logit adds nothing (and −inf − −inf would be NaN)
    s += expf(x - m);
  }
}

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float M = fmaxf(m, m2);
  if (M == -INFINITY) {  // both empty
    s += s2;
    return;
  }
  s = s * expf(m - M) + s2 * expf(m2 - M);
  m = M;
}

__global__ void __launch_bounds__(kThreads) ce_init_kernel(float* __restrict__ row_max, float* __restrict__ row_sum,
                                                           float* __restrict__ target_logit, int64_t N) {
  const int64_t n = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (n >= N) return;
  row_max[n] = -INFINITY;
  row_sum[n] = 0.0f;
  target_logit[n] = 0.0f;
}

__global__ void __launch_bounds__(kThreads)
    ce_chunk_update_kernel(float* __restrict__ row_max, float* __restrict__ row_sum, float* __restrict__ target_logit,
                           const float* __restrict__ logits, int64_t ld, const int32_t* __restrict__ target, int64_t v0,
                           int64_t Vc) {
  __shared__ float shm[kThreads / 32], shs[kThreads / 32];
  const int64_t n = blockIdx.x;
  const float* l = logits + n * ld;
  float m = -INFINITY, s = 0.0f;
  for (int64_t j = threadIdx.x; j < Vc; j += kThreads) lse_push(m, s, l[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_down_sync(0xffffffffu, m, o), s2 = __shfl_down_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31);
  if (lane == 0) shm[warp] = m, shs[warp] = s;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float cm = shm[0], cs = shs[0];
  for (int w = 1; w < kThreads / 32; ++w) lse_merge(cm, cs, shm[w], shs[w]);
  float rm = row_max[n], rs = row_sum[n];
  lse_merge(rm, rs, cm, cs);
  row_max[n] = rm;
  row_sum[n] = rs;
  const int64_t t = target[n];
  if (t >= v0 && t < v0 + Vc) target_logit[n] = l[t - v0];
}

// lse per row; per block of kThreads rows, the double sum of the rows' losses (fixed tree order).
__global__ void __launch_bounds__(kThreads)
    ce_finish_kernel(float* __restrict__ lse, double* __restrict__ part, const float* __restrict__ row_max,
                     const float* __restrict__ row_sum, const float* __restrict__ target_logit,
                     const int32_t* __restrict__ target, const float* __restrict__ row_weight, int64_t N) {
  __shared__ double sh[kThreads];
  const int64_t n = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  double loss = 0.0;
  if (n < N) {
    const double m = row_max[n], lz = log(double(row_sum[n]));
    lse[n] = float(m + lz);
    if (target[n] >= 0) {
      loss = (m - double(target_logit[n])) + lz;  // lse − l[target], without lse's rounding
      if (row_weight) loss *= double(row_weight[n]);
    }
  }
  sh[threadIdx.x] = loss;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}

__global__ void ce_sum_kernel(double* __restrict__ loss_sum, const double* __restrict__ part, int64_t nparts) {
  double s = 0.0;
  for (int64_t i = 0; i < nparts; ++i) s += part[i];
  *loss_sum = s;
}

__global__ void __launch_bounds__(kThreads)
    ce_chunk_grad_kernel(float* __restrict__ logits, int64_t ld, const float* __restrict__ lse,
                         const int32_t* __restrict__ target, float scale, const float* __restrict__ row_weight,
                         int64_t v0, int64_t Vc) {
  const int64_t n = blockIdx.x;
  float* l = logits + n * ld;
  const int64_t t = target[n];
  if (t < 0) {
    for (int64_t j = threadIdx.x; j < Vc; j += kThreads) l[j] = 0.0f;
    return;
  }
  const float L = lse[n];
  if (row_weight) scale *= row_weight[n];
  const int64_t jt = t - v0;  // the target's column (maybe outside this chunk)
  for (int64_t j = threadIdx.x; j < Vc; j += kThreads) {
    const float p = expf(l[j] - L);
    l[j] = scale * (j == jt ? p - 1.0f : p);
  }
}

int64_t finish_blocks(int64_t N) { return (N + kThreads - 1) / kThreads; }

void check_rows(const char* fn, int64_t N) {
  if (N < 0) fail(fn, ": negative N = ", N);
  if (N > INT_MAX) fail(fn, ": N = ", N, " rows exceeds the grid limit 2^31-1");
}
void check_chunk(const char* fn, int64_t ld, int64_t v0, int64_t Vc) {
  if (v0 < 0 || Vc < 0) fail(fn, ": negative chunk v0 = ", v0, ", Vc = ", Vc);
  if (ld < Vc) fail(fn, ": row stride ld = ", ld, " is smaller than the chunk width Vc = ", Vc);
}

}  // namespace

void ce_init(float* row_max, float* row_sum, float* target_logit, int64_t N) {
  constexpr const char* fn = "loss::cuda::ce_init";
  check_rows(fn, N);
  if (N == 0) return;
  if (!row_max || !row_sum || !target_logit) fail(fn, ": null row_max, row_sum or target_logit");
  ce_init_kernel<<<unsigned(finish_blocks(N)), kThreads>>>(row_max, row_sum, target_logit, N);
  K3_CUDA_LAUNCH_CHECK();
}

void ce_chunk_update(float* row_max, float* row_sum, float* target_logit, const float* logits, int64_t ld,
                     const int32_t* target, int64_t N, int64_t v0, int64_t Vc) {
  constexpr const char* fn = "loss::cuda::ce_chunk_update";
  check_rows(fn, N);
  check_chunk(fn, ld, v0, Vc);
  if (N == 0 || Vc == 0) return;
  if (!row_max || !row_sum || !target_logit || !logits || !target)
    fail(fn, ": null row_max, row_sum, target_logit, logits or target");
  ce_chunk_update_kernel<<<unsigned(N), kThreads>>>(row_max, row_sum, target_logit, logits, ld, target, v0, Vc);
  K3_CUDA_LAUNCH_CHECK();
}

size_t ce_finish_workspace_bytes(int64_t N) { return N > 0 ? size_t(finish_blocks(N)) * sizeof(double) : 0; }

void ce_finish(float* lse, double* loss_sum, const float* row_max, const float* row_sum, const float* target_logit,
               const int32_t* target, int64_t N, void* workspace, const float* row_weight) {
  constexpr const char* fn = "loss::cuda::ce_finish";
  check_rows(fn, N);
  if (!loss_sum) fail(fn, ": null loss_sum");
  auto* part = static_cast<double*>(workspace);
  const int64_t blocks = N > 0 ? finish_blocks(N) : 0;
  if (N > 0) {
    if (!lse || !row_max || !row_sum || !target_logit || !target)
      fail(fn, ": null lse, row_max, row_sum, target_logit or target");
    if (!workspace) fail(fn, ": null workspace (ce_finish_workspace_bytes)");
    ce_finish_kernel<<<unsigned(blocks), kThreads>>>(lse, part, row_max, row_sum, target_logit, target, row_weight, N);
    K3_CUDA_LAUNCH_CHECK();
  }
  ce_sum_kernel<<<1, 1>>>(loss_sum, part, blocks);  // writes 0 when there are no rows
  K3_CUDA_LAUNCH_CHECK();
}

void ce_chunk_grad(float* logits, int64_t ld, const float* lse, const int32_t* target, float scale, int64_t N,
                   int64_t v0, int64_t Vc, const float* row_weight) {
  constexpr const char* fn = "loss::cuda::ce_chunk_grad";
  check_rows(fn, N);
  check_chunk(fn, ld, v0, Vc);
  if (N == 0 || Vc == 0) return;
  if (!logits || !lse || !target) fail(fn, ": null logits, lse or target");
  ce_chunk_grad_kernel<<<unsigned(N), kThreads>>>(logits, ld, lse, target, scale, row_weight, v0, Vc);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::loss::cuda
