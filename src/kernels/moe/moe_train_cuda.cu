// LatentMoE training pieces on the GPU (moe_train_cuda.h). router_forward_train shares the inference
// router's kernel and lives beside it in moe_cuda.cu; everything else is here.
//
// Dispatch: a stable counting sort of the S = N·K slots (flat order n·K + k, so tokens ascend within
// an expert because a token's experts are distinct). Slots are cut into chunks of kChunk; one warp per
// chunk walks it 32 slots at a time, and __match_any_sync groups the lanes that hold the same expert:
// a lane's rank among its peers is the popcount of the peers below it, and the lowest peer advances
// the chunk's per-expert counter in shared memory. Pass 1 counts per chunk, a scan turns the counts
// into each chunk's start within each expert plus the expert offsets, pass 2 repeats the walk and
// places every slot. Integer counts only, so the placement is the same every run.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/moe/moe_cuda.h"
#include "kernels/moe/moe_train_cuda.h"

namespace k3::moe::cuda {
namespace {

constexpr int kChunk = 4096;               // slots per dispatch chunk (one warp walks 128 steps of 32)
constexpr int kMaxDispatchExperts = 8192;  // a chunk's counters live in shared memory (32 KB)
constexpr int kScanThreads = 1024;

int64_t num_chunks(int64_t S) { return (S + kChunk - 1) / kChunk; }

// ---- dispatch ---------------------------------------------------------------------------------------

// The walk of one chunk by one warp (blockDim.x == 32). cnt [E] in shared memory holds, per expert,
// the next position to hand out (pass 2) or the running count (pass 1). Pass 2 (PLACE) writes
// pos[i] and token[pos[i]]; an entry outside [0, E) is skipped (pos = -1) and counted in *bad (pass 1).
template <bool PLACE>
__device__ void walk_chunk(int32_t* cnt, const int32_t* __restrict__ idx, int64_t begin, int64_t end, int E, int K,
                           int32_t* __restrict__ pos, int32_t* __restrict__ token, int32_t* __restrict__ bad) {
  const int lane = threadIdx.x;
  const unsigned below = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const int e = i < end ? idx[i] : -1;
    const bool valid = e >= 0 && e < E;
    // Every lane takes part (full mask): lanes past the end or with a bad index share the key -1.
    const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
    const int rank = __popc(peers & below);
    int32_t start = 0;
    if (valid) start = cnt[e];
    __syncwarp();  // every peer has read cnt[e] before the lowest one advances it
    if (valid && rank == 0) cnt[e] = start + __popc(peers);
    if (PLACE && i < end) {
      const int32_t r = valid ? start + rank : -1;
      pos[i] = r;
      if (valid) token[r] = int32_t(i / K);
    }
    if (!PLACE && !valid && i < end) atomicAdd(bad, 1);  // integer: order-free
    __syncwarp();
  }
}

// Pass 1: chunk c's count per expert -> chunk[c·E + e].
__global__ void chunk_count_kernel(int32_t* __restrict__ chunk, int32_t* __restrict__ bad,
                                   const int32_t* __restrict__ idx, int64_t S, int E, int K) {
  extern __shared__ int32_t cnt_smem[];
  const int64_t c = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += 32) cnt_smem[e] = 0;
  __syncwarp();
  const int64_t begin = c * kChunk, end = std::min<int64_t>(S, begin + kChunk);
  walk_chunk<false>(cnt_smem, idx, begin, end, E, K, nullptr, nullptr, bad);
  for (int e = threadIdx.x; e < E; e += 32) chunk[c * E + e] = cnt_smem[e];
}

// One block: chunk[c·E + e] becomes the exclusive scan over c (the chunk's first row within expert e),
// and offsets[0..E] the exclusive scan of the experts' totals.
__global__ void __launch_bounds__(kScanThreads)
    dispatch_scan_kernel(int32_t* __restrict__ offsets, int32_t* __restrict__ chunk, int64_t chunks, int E) {
  extern __shared__ int32_t total_smem[];  // [E] expert totals
  __shared__ int32_t part[kScanThreads];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t run = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t v = chunk[c * E + e];
      chunk[c * E + e] = run;
      run += v;
    }
    total_smem[e] = run;
  }
  __syncthreads();
  // Thread t scans experts [t·per, (t+1)·per); the segment sums are scanned by thread 0.
  const int per = (E + blockDim.x - 1) / blockDim.x;
  const int lo = min(E, int(threadIdx.x) * per), hi = min(E, lo + per);
  int32_t s = 0;
  for (int e = lo; e < hi; ++e) s += total_smem[e];
  part[threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t run = 0;
    for (int t = 0; t < int(blockDim.x); ++t) {
      const int32_t v = part[t];
      part[t] = run;
      run += v;
    }
    offsets[E] = run;
  }
  __syncthreads();
  int32_t run = part[threadIdx.x];
  for (int e = lo; e < hi; ++e) {
    offsets[e] = run;
    run += total_smem[e];
  }
}

// Pass 2: place chunk c's slots, starting each expert at offsets[e] + chunk[c·E + e].
__global__ void chunk_place_kernel(int32_t* __restrict__ pos, int32_t* __restrict__ token,
                                   const int32_t* __restrict__ chunk, const int32_t* __restrict__ offsets,
                                   const int32_t* __restrict__ idx, int64_t S, int E, int K) {
  extern __shared__ int32_t cnt_smem[];
  const int64_t c = blockIdx.x;
  for (int e = threadIdx.x; e < E; e += 32) cnt_smem[e] = offsets[e] + chunk[c * E + e];
  __syncwarp();
  const int64_t begin = c * kChunk, end = std::min<int64_t>(S, begin + kChunk);
  walk_chunk<true>(cnt_smem, idx, begin, end, E, K, pos, token, nullptr);
}

// ---- row movement ---------------------------------------------------------------------------------
// Row kernels: blockIdx.y (stride gridDim.y) over rows, x over the row's columns.

dim3 row_grid(int64_t rows, int64_t cols, int threads) {
  const int64_t bx = std::min<int64_t>((cols + threads - 1) / threads, 64);
  return dim3(unsigned(std::max<int64_t>(1, bx)), unsigned(std::max<int64_t>(1, std::min<int64_t>(rows, 65535))));
}

__global__ void gather_rows_kernel(float* __restrict__ xs, const float* __restrict__ x,
                                   const int32_t* __restrict__ token, int64_t rows, int64_t L) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* src = x + int64_t(token[r]) * L;
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < L; c += int64_t(gridDim.x) * blockDim.x)
      xs[r * L + c] = src[c];
  }
}

// dx[n] = Σ_k dxs[pos[n, k]], k ascending, from the first term (0 + a = a exactly).
__global__ void scatter_rows_kernel(float* __restrict__ dx, const float* __restrict__ dxs,
                                    const int32_t* __restrict__ pos, int64_t N, int K, int64_t L) {
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const int32_t* pn = pos + n * K;
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < L; c += int64_t(gridDim.x) * blockDim.x) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc += dxs[int64_t(pn[k]) * L + c];
      dx[n * L + c] = acc;
    }
  }
}

// agg[n] = Σ_k weight[n, k] y[pos[n, k]], k ascending, fma from 0.
__global__ void combine_forward_kernel(float* __restrict__ agg, const float* __restrict__ y,
                                       const float* __restrict__ weight, const int32_t* __restrict__ pos, int64_t N,
                                       int K, int64_t L) {
  for (int64_t n = blockIdx.y; n < N; n += gridDim.y) {
    const int32_t* pn = pos + n * K;
    const float* wn = weight + n * K;
    for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < L; c += int64_t(gridDim.x) * blockDim.x) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) acc = fmaf(wn[k], y[int64_t(pn[k]) * L + c], acc);
      agg[n * L + c] = acc;
    }
  }
}

constexpr int kCombineThreads = 128;

// One block per slot (n, k) (grid-stride over N·K): dy[p] = w dagg[n] and dweight[n, k] = <dagg[n], y[p]>
// with p = pos[n, k]. The dot: per-thread fp64 partial sums over a fixed column stride, then a fixed
// tree (warp shuffles, then the warps' sums in order by thread 0).
__global__ void __launch_bounds__(kCombineThreads)
    combine_backward_kernel(float* __restrict__ dy, float* __restrict__ dweight, const float* __restrict__ dagg,
                            const float* __restrict__ y, const float* __restrict__ weight,
                            const int32_t* __restrict__ pos, int64_t slots, int K, int64_t L) {
  __shared__ double warp_sums[kCombineThreads / 32];
  for (int64_t i = blockIdx.x; i < slots; i += gridDim.x) {
    const int64_t n = i / K;
    const int64_t p = pos[i];
    const float w = weight[i];
    const float* g = dagg + n * L;
    const float* yr = y + p * L;
    float* dyr = dy + p * L;
    double acc = 0.0;
    for (int64_t c = threadIdx.x; c < L; c += blockDim.x) {
      const float gv = g[c];
      dyr[c] = w * gv;
      acc += double(gv) * double(yr[c]);
    }
    acc = rowwise::warp_sum(acc);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      double s = 0.0;
      for (int wi = 0; wi < kCombineThreads / 32; ++wi) s += warp_sums[wi];
      dweight[i] = float(s);
    }
    __syncthreads();  // warp_sums is reused by the next slot
  }
}

// ---- router backward ------------------------------------------------------------------------------

constexpr int kRouterBwdThreads = 128;

// One block per token (grid-stride): zero the row, then thread k < K writes its selected expert's
// dlogit (the K experts of a token are distinct, so no two threads write one element).
__global__ void __launch_bounds__(kRouterBwdThreads)
    router_backward_kernel(float* __restrict__ dlogits, const float* __restrict__ dweight,
                           const float* __restrict__ scores, const int32_t* __restrict__ idx,
                           const float* __restrict__ sel_sum, int64_t N, int E, int K, bool renormalize, double scale) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    float* dl = dlogits + n * E;
    const float* s = scores + n * E;
    const float* dw = dweight + n * K;
    const int32_t* id = idx + n * K;
    for (int e = threadIdx.x; e < E; e += blockDim.x) dl[e] = 0.0f;
    __syncthreads();  // the row is zero before the selected entries are written (other threads' zeros)
    if (int(threadIdx.x) < K) {
      const int k = threadIdx.x;
      double ds;
      if (renormalize) {
        const double den = double(sel_sum[n]) + 1e-20;
        double dot = 0.0;  // Σ_k dw_k s_k, k ascending
        for (int j = 0; j < K; ++j) dot += double(dw[j]) * double(s[id[j]]);
        ds = scale * (double(dw[k]) / den - dot / (den * den));
      } else {
        ds = scale * double(dw[k]);
      }
      const double sv = s[id[k]];
      dl[id[k]] = float(ds * sv * (1.0 - sv));
    }
  }
}

// ---- expert linears ---------------------------------------------------------------------------------

const char* elem_ptr(const void* base, int64_t elems, DType t) {
  return static_cast<const char*>(base) + elems * int64_t(dtype_size(t));
}

void check_linear(const char* what, const TrainDispatch& d, DType in_type, int64_t out, int64_t in) {
  K3_CHECK(in_type == DType::F32 || in_type == DType::BF16, "moe::cuda::", what, ": operands must be F32 or BF16, got ",
           dtype_name(in_type));
  K3_CHECK(out > 0 && in > 0, "moe::cuda::", what, ": out and in must be positive, got ", out, ", ", in);
  K3_CHECK(int64_t(d.offsets().size()) == d.num_experts() + 1, "moe::cuda::", what,
           ": the dispatch has not been built");
}

}  // namespace

// ---- dispatch ---------------------------------------------------------------------------------------

namespace {
// The constructor's arguments, checked before any buffer is sized from them; returns E.
int64_t checked_experts(int64_t max_tokens, int64_t E, int64_t K) {
  K3_CHECK(E >= 1 && E <= kMaxDispatchExperts && K >= 1 && K <= E && max_tokens >= 0,
           "moe::cuda::TrainDispatch: need 1 <= K <= E <= ", kMaxDispatchExperts, " and max_tokens >= 0, got E=", E,
           " K=", K, " max_tokens=", max_tokens);
  K3_CHECK(max_tokens <= INT32_MAX / K, "moe::cuda::TrainDispatch: ", max_tokens, " tokens × top-", K,
           " slots overflow int32");
  return E;
}
}  // namespace

TrainDispatch::TrainDispatch(int64_t max_tokens, int64_t E, int64_t K)
    : E_(checked_experts(max_tokens, E, K)),
      K_(K),
      max_tokens_(max_tokens),
      pos_(size_t(std::max<int64_t>(1, max_tokens * K))),
      token_(size_t(std::max<int64_t>(1, max_tokens * K))),
      offsets_(size_t(E + 2)),
      chunk_(size_t(std::max<int64_t>(1, num_chunks(max_tokens * K)) * E)) {}

void TrainDispatch::build(const int32_t* idx, int64_t N) {
  K3_CHECK(N >= 0 && N <= max_tokens_, "moe::cuda::TrainDispatch::build: ", N, " tokens, capacity ", max_tokens_);
  const int64_t S = N * K_;
  K3_CHECK(S == 0 || idx, "moe::cuda::TrainDispatch::build: idx is null");
  N_ = 0;
  offsets_host_.clear();
  K3_CUDA_CHECK(cudaMemsetAsync(offsets_.data(), 0, size_t(E_ + 2) * sizeof(int32_t)));
  if (S > 0) {
    const int64_t chunks = num_chunks(S);
    K3_CHECK(chunks <= INT_MAX, "moe::cuda::TrainDispatch::build: too many chunks");
    const size_t cnt_smem = size_t(E_) * sizeof(int32_t);
    chunk_count_kernel<<<unsigned(chunks), 32, cnt_smem>>>(chunk_.data(), offsets_.data() + E_ + 1, idx, S, int(E_),
                                                           int(K_));
    K3_CUDA_LAUNCH_CHECK();
    dispatch_scan_kernel<<<1, kScanThreads, cnt_smem>>>(offsets_.data(), chunk_.data(), chunks, int(E_));
    K3_CUDA_LAUNCH_CHECK();
    chunk_place_kernel<<<unsigned(chunks), 32, cnt_smem>>>(pos_.data(), token_.data(), chunk_.data(), offsets_.data(),
                                                           idx, S, int(E_), int(K_));
    K3_CUDA_LAUNCH_CHECK();
  }
  std::vector<int32_t> host(size_t(E_ + 2));
  k3::cuda::copy_to_host(host.data(), offsets_.data(), host.size() * sizeof(int32_t));  // synchronises
  K3_CHECK(host[size_t(E_ + 1)] == 0, "moe::cuda::TrainDispatch::build: ", host[size_t(E_ + 1)],
           " expert indices outside [0, ", E_, ")");
  offsets_host_.assign(host.begin(), host.begin() + E_ + 1);
  N_ = N;
}

// ---- rows -------------------------------------------------------------------------------------------

void gather_sorted_rows(float* xs, const float* x, const TrainDispatch& d, int64_t L) {
  K3_CHECK(L > 0, "moe::cuda::gather_sorted_rows: L must be positive, got ", L);
  const int64_t S = d.rows();
  if (S == 0) return;
  gather_rows_kernel<<<row_grid(S, L, 128), 128>>>(xs, x, d.token(), S, L);
  K3_CUDA_LAUNCH_CHECK();
}

void scatter_sorted_rows(float* dx, const float* dxs, const TrainDispatch& d, int64_t N, int64_t L) {
  K3_CHECK(N == d.tokens(), "moe::cuda::scatter_sorted_rows: N = ", N, " but the dispatch was built for ", d.tokens(),
           " tokens");
  K3_CHECK(L > 0, "moe::cuda::scatter_sorted_rows: L must be positive, got ", L);
  if (N == 0) return;
  scatter_rows_kernel<<<row_grid(N, L, 128), 128>>>(dx, dxs, d.pos(), N, int(d.top_k()), L);
  K3_CUDA_LAUNCH_CHECK();
}

void combine_forward_train(float* agg, const float* y, const float* weight, const TrainDispatch& d, int64_t N,
                           int64_t L) {
  K3_CHECK(N == d.tokens(), "moe::cuda::combine_forward_train: N = ", N, " but the dispatch was built for ", d.tokens(),
           " tokens");
  K3_CHECK(L > 0, "moe::cuda::combine_forward_train: L must be positive, got ", L);
  if (N == 0) return;
  combine_forward_kernel<<<row_grid(N, L, 128), 128>>>(agg, y, weight, d.pos(), N, int(d.top_k()), L);
  K3_CUDA_LAUNCH_CHECK();
}

void combine_backward_train(float* dy, float* dweight, const float* dagg, const float* y, const float* weight,
                            const TrainDispatch& d, int64_t N, int64_t L) {
  K3_CHECK(N == d.tokens(), "moe::cuda::combine_backward_train: N = ", N, " but the dispatch was built for ",
           d.tokens(), " tokens");
  K3_CHECK(L > 0, "moe::cuda::combine_backward_train: L must be positive, got ", L);
  const int64_t S = d.rows();
  if (S == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>(S, 65535 * 16));
  combine_backward_kernel<<<blocks, kCombineThreads>>>(dy, dweight, dagg, y, weight, d.pos(), S, int(d.top_k()), L);
  K3_CUDA_LAUNCH_CHECK();
}

// ---- router backward --------------------------------------------------------------------------------

void router_backward_train(float* dlogits, const float* dweight, const float* scores, const int32_t* idx,
                           const float* sel_sum, int64_t N, const RouterParams& p) {
  const std::string why = router_can_run(p);
  K3_CHECK(why.empty(), "moe::cuda::router_backward_train: ", why);
  K3_CHECK(N >= 0, "moe::cuda::router_backward_train: negative token count ", N);
  if (N == 0) return;
  K3_CHECK(dlogits && dweight && scores && idx, "moe::cuda::router_backward_train: null pointer");
  K3_CHECK(sel_sum || !p.renormalize, "moe::cuda::router_backward_train: renormalised routing needs sel_sum");
  const unsigned blocks = unsigned(std::min<int64_t>(N, 65535 * 16));
  router_backward_kernel<<<blocks, kRouterBwdThreads>>>(dlogits, dweight, scores, idx, sel_sum, N, int(p.num_experts),
                                                        int(p.top_k), p.renormalize, double(p.scaling));
  K3_CUDA_LAUNCH_CHECK();
}

// ---- expert linears ---------------------------------------------------------------------------------

void experts_linear_forward(gemm::cuda::GemmContext& ctx, float* y, const void* x, const void* W, DType in_type,
                            const TrainDispatch& d, int64_t out, int64_t in) {
  check_linear("experts_linear_forward", d, in_type, out, in);
  const std::vector<int64_t>& off = d.offsets();
  for (int64_t e = 0; e < d.num_experts(); ++e) {
    const int64_t r0 = off[size_t(e)], rows = off[size_t(e + 1)] - r0;
    if (rows == 0) continue;
    gemm::cuda::LinearParams p;
    p.y = y + r0 * out;  // [rows, out]
    p.y_type = DType::F32;
    p.x = elem_ptr(x, r0 * in, in_type);       // [rows, in]
    p.w = elem_ptr(W, e * out * in, in_type);  // [out, in]
    p.in_type = in_type;
    p.M = rows, p.N = out, p.K = in;
    // cublasGemmEx, not cuBLASLt: Lt caches a plan per shape, and the row counts change every step.
    p.backend = gemm::cuda::GemmBackend::Classic;
    gemm::cuda::linear_forward(ctx, p);
  }
}

void experts_linear_backward_data(gemm::cuda::GemmContext& ctx, float* dx, const void* dy, const void* W, DType in_type,
                                  const TrainDispatch& d, int64_t out, int64_t in, bool accumulate) {
  check_linear("experts_linear_backward_data", d, in_type, out, in);
  const std::vector<int64_t>& off = d.offsets();
  for (int64_t e = 0; e < d.num_experts(); ++e) {
    const int64_t r0 = off[size_t(e)], rows = off[size_t(e + 1)] - r0;
    if (rows == 0) continue;
    // dx [rows, in] = dy [rows, out] · W_e [out, in]: linear_forward with W read as [K, N] = [out, in].
    gemm::cuda::LinearParams p;
    p.y = dx + r0 * in;
    p.y_type = DType::F32;
    p.x = elem_ptr(dy, r0 * out, in_type);
    p.w = elem_ptr(W, e * out * in, in_type);
    p.w_in_out = true;
    p.in_type = in_type;
    p.M = rows, p.N = in, p.K = out;
    p.accumulate = accumulate;
    gemm::cuda::linear_forward(ctx, p);
  }
}

void experts_linear_backward_weight(gemm::cuda::GemmContext& ctx, float* dW, const void* dy, const void* x,
                                    DType in_type, const TrainDispatch& d, int64_t out, int64_t in) {
  check_linear("experts_linear_backward_weight", d, in_type, out, in);
  const std::vector<int64_t>& off = d.offsets();
  for (int64_t e = 0; e < d.num_experts(); ++e) {
    const int64_t r0 = off[size_t(e)], rows = off[size_t(e + 1)] - r0;
    if (rows == 0) continue;
    gemm::cuda::WeightGradParams p;
    p.dw = dW + e * out * in;  // [out, in] += dy_eᵀ [out, rows] · x_e [rows, in]
    p.dy = elem_ptr(dy, r0 * out, in_type);
    p.x = elem_ptr(x, r0 * in, in_type);
    p.in_type = in_type;
    p.M = rows, p.N = out, p.K = in;
    p.accumulate = true;
    gemm::cuda::linear_weight_grad(ctx, p);
  }
}

}  // namespace k3::moe::cuda
