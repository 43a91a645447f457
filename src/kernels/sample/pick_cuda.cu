// Token picks on the GPU (pick_cuda.h). One CTA of 1024 threads per row; thread t owns the contiguous ids
// [t C, (t + 1) C), C = ceil(V / 1024), so every per-thread loop walks ids in increasing order as the host does.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cmath>

#include "core/cuda_check.cuh"
#include "kernels/sample/pick_cuda.h"

namespace k3::sample::cuda {

namespace {

constexpr int kThreads = 1024;

struct Best {
  float v;
  int32_t id;
};
struct BestOp {
  __device__ Best operator()(const Best& a, const Best& b) const {
    return (b.v > a.v || (b.v == a.v && b.id < a.id)) ? b : a;
  }
};

__global__ void __launch_bounds__(kThreads) pick_kernel(const float* __restrict__ logits, int64_t V,
                                                        const PickRow* __restrict__ rows, int32_t* ids, int32_t* bad) {
  using Reduce = cub::BlockReduce<Best, kThreads>;
  using ReduceInt = cub::BlockReduce<int, kThreads>;
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage best;
    typename ReduceInt::TempStorage flag;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ Best s_best;
  __shared__ int s_bad, s_pick, s_last;

  const int64_t r = blockIdx.x;
  const float* l = logits + r * V;
  const PickRow row = rows[r];
  const int tid = threadIdx.x;
  const int64_t C = (V + kThreads - 1) / kThreads, begin = min(V, tid * C), end = min(V, begin + C);

  // Pass 1: the largest logit (lowest id among equals) and the check.
  Best mine{-INFINITY, begin < V ? int32_t(begin) : INT32_MAX};
  int nonfinite = 0;
  for (int64_t v = begin; v < end; ++v) {
    const float x = l[v];
    if (isnan(x) || x == INFINITY) nonfinite = 1;
    if (x > mine.v) mine = Best{x, int32_t(v)};
  }
  const Best best = Reduce(tmp.best).Reduce(mine, BestOp());
  if (tid == 0) s_best = best;
  __syncthreads();
  const int any_bad = ReduceInt(tmp.flag).Sum(nonfinite) > 0;
  if (tid == 0) s_bad = any_bad || s_best.v == -INFINITY;
  __syncthreads();
  if (row.mode == 0 || s_bad) {
    if (tid == 0) ids[r] = -1, bad[r] = s_bad;
    return;
  }
  if (row.mode == 1) {
    if (tid == 0) ids[r] = s_best.id, bad[r] = 0;
    return;
  }

  // Pass 2 (temperature): each thread's run of weights, the runs added by a scan, then the thread whose
  // interval [before, before + sum) holds the target walks its ids (on past its run if rounding asks).
  const double mx = s_best.v, inv_t = 1.0 / double(row.temperature);
  double sum = 0.0;
  int last_nonzero = -1;
  for (int64_t v = begin; v < end; ++v) {
    const double w = exp((double(l[v]) - mx) * inv_t);
    sum += w;
    if (w != 0.0) last_nonzero = int(v);
  }
  double before = 0.0, total = 0.0;
  Scan(tmp.scan).ExclusiveSum(sum, before, total);
  if (tid == 0) s_pick = -1, s_last = -1;
  __syncthreads();
  if (last_nonzero >= 0) atomicMax(&s_last, last_nonzero);
  const double target = row.uniform * total;
  if (sum > 0.0 && before <= target && target < before + sum) {
    double cum = before;
    int found = -1;
    for (int64_t v = begin; v < V; ++v) {
      const double w = exp((double(l[v]) - mx) * inv_t);
      if (w == 0.0) continue;
      cum += w;
      if (target < cum) {
        found = int(v);
        break;
      }
    }
    if (found >= 0) atomicMin(reinterpret_cast<unsigned*>(&s_pick), unsigned(found));
  }
  __syncthreads();
  if (tid == 0) ids[r] = s_pick >= 0 ? s_pick : s_last, bad[r] = 0;
}

}  // namespace

void pick_tokens(const float* logits, int64_t B, int64_t V, const PickRow* rows, int32_t* ids, int32_t* bad) {
  K3_CHECK(B >= 0 && B <= 2147483647 && V >= 1 && V <= 2147483647, "pick_tokens (cuda): bad shape B=", B, " V=", V);
  if (B == 0) return;
  pick_kernel<<<unsigned(B), kThreads>>>(logits, V, rows, ids, bad);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::sample::cuda
