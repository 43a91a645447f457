// Token picks on the GPU (pick_cuda.h). One CTA of 1024 threads per row. The maximum and the check read the row
// coalesced (thread t takes ids t, t + 1024, ...: the max with ties to the lower id and the check do not depend on
// the order). The temperature draw needs ids in order: warp w owns the contiguous ids [w C, (w + 1) C),
// C = ceil(V / 32), its lanes reading them 32 at a time, so that every load is coalesced and the walk to the drawn
// id is one warp scanning 32 ids a step.
#include <cub/block/block_reduce.cuh>

#include <cmath>

#include "core/cuda_check.cuh"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/sample/pick_cuda.h"

namespace k3::sample::cuda {

namespace {

constexpr int kThreads = 1024, kWarps = kThreads / 32;

struct Best {
  float v;
  int32_t id;
};
struct BestOp {
  __device__ Best operator()(const Best& a, const Best& b) const {
    return (b.v > a.v || (b.v == a.v && b.id < a.id)) ? b : a;
  }
};

__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Inclusive prefix sum over the lanes of a warp.
__device__ __forceinline__ double warp_inclusive_sum(double x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const double y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

__global__ void __launch_bounds__(kThreads)
    pick_kernel(const float* __restrict__ logits, int64_t V, const PickRow* __restrict__ rows, int32_t* ids,
                int32_t* bad, double* logprob) {
  pdl::wait_then_release();
  using Reduce = cub::BlockReduce<Best, kThreads>;
  using ReduceInt = cub::BlockReduce<int, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage best;
    typename ReduceInt::TempStorage flag;
  } tmp;
  __shared__ Best s_best;
  __shared__ int s_bad, s_pick, s_last;
  __shared__ double s_wsum[kWarps], s_before[kWarps], s_total;

  const int64_t r = blockIdx.x;
  const float* l = logits + r * V;
  const PickRow row = rows[r];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Pass 1: the largest logit (lowest id among equals) and the check, four loads in flight per thread.
  Best mine{-INFINITY, INT32_MAX};
  int nonfinite = 0;
  for (int64_t v0 = tid; v0 < V; v0 += 4 * kThreads) {
    float x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = v0 + j * kThreads < V ? l[v0 + j * kThreads] : -INFINITY;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (isnan(x[j]) || x[j] == INFINITY) nonfinite = 1;
      if (x[j] > mine.v) mine = Best{x[j], int32_t(v0 + j * kThreads)};
    }
  }
  const Best best = Reduce(tmp.best).Reduce(mine, BestOp());
  if (tid == 0) s_best = best;
  __syncthreads();
  const int any_bad = ReduceInt(tmp.flag).Sum(nonfinite) > 0;
  if (tid == 0) s_bad = any_bad || s_best.v == -INFINITY;
  __syncthreads();
  if (row.mode == 0 || s_bad) {
    if (tid == 0) ids[r] = -1, bad[r] = s_bad;
    if (tid == 0 && logprob) logprob[r] = __longlong_as_double(0x7ff8000000000000LL);
    return;
  }
  if (row.mode == 1) {
    if (tid == 0) ids[r] = s_best.id, bad[r] = 0;
    if (tid == 0 && logprob) logprob[r] = __longlong_as_double(0x7ff8000000000000LL);
    return;
  }

  // Pass 2 (temperature): each warp's sum of weights over its run, the runs added in order, then the warp whose
  // interval [before, before + sum) holds the target walks its ids 32 at a time (on past its run if rounding
  // asks); the last id of nonzero weight is the answer when the walk falls off the end.
  const double mx = s_best.v, inv_t = 1.0 / double(row.temperature);
  const int64_t C = (V + kWarps - 1) / kWarps, begin = min(V, warp * C), end = min(V, begin + C);
  double sum = 0.0;
  int last_nonzero = -1;
  for (int64_t v = begin + lane; v < end; v += 32) {
    const double w = exp((double(l[v]) - mx) * inv_t);
    sum += w;
    if (w != 0.0) last_nonzero = int(v);
  }
  sum = warp_sum(sum);
  if (lane == 0) s_wsum[warp] = sum;
  if (tid == 0) s_pick = INT32_MAX, s_last = -1;
  __syncthreads();
  if (last_nonzero >= 0) atomicMax(&s_last, last_nonzero);
  if (warp == 0) {
    const double w = s_wsum[lane], incl = warp_inclusive_sum(w, lane);
    s_before[lane] = incl - w;
    if (lane == 31) s_total = incl;
  }
  __syncthreads();
  const double target = row.uniform * s_total, before = s_before[warp];
  if (sum > 0.0 && before <= target && target < before + sum) {
    double cum = before;
    for (int64_t base = begin; base < V; base += 32) {
      const int64_t v = base + lane;
      const double w = v < V ? exp((double(l[v]) - mx) * inv_t) : 0.0;
      const double incl = warp_inclusive_sum(w, lane);
      const unsigned hit = __ballot_sync(0xffffffffu, w != 0.0 && target < cum + incl);
      if (hit) {
        if (lane == 0) atomicMin(&s_pick, int(base) + __ffs(int(hit)) - 1);
        break;
      }
      cum += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  if (tid == 0) {
    const int id = s_pick != INT32_MAX ? s_pick : s_last;
    ids[r] = id, bad[r] = 0;
    if (logprob) logprob[r] = (double(l[id]) - mx) * inv_t - log(s_total);
  }
}

}  // namespace

void pick_tokens(const float* logits, int64_t B, int64_t V, const PickRow* rows, int32_t* ids, int32_t* bad,
                 double* logprob) {
  K3_CHECK(B >= 0 && B <= 2147483647 && V >= 1 && V <= 2147483647, "pick_tokens (cuda): bad shape B=", B, " V=", V);
  if (B == 0) return;
  pdl::launch(pick_kernel, unsigned(B), kThreads, 0, logits, V, rows, ids, bad, logprob);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::sample::cuda
