// Block AttnRes forward with saved statistics and its backward, fp32, for GPU training
// (attnres_train_cuda.h).
//
// One block per row. Pass 1 accumulates, per thread and per source, the two row sums the softmax
// needs (forward: Σv², Σv·q; backward: Σg·v, Σv·q) and reduces all 2·kMaxSources of them in one
// rowwise::block_sum, whose fixed order gives every thread the same bits: the softmax and the
// per-source coefficients are then computed redundantly by every thread, with no broadcast. Pass 2
// re-reads the sources (from L1/L2) to write h, or to add to dV. Loops over sources run to
// kMaxSources, unrolled, with `i < S` guards, so register arrays are indexed at compile time.
// The kernel parameters are __grid_constant__, so the source pointers are read from the parameter
// space, not a local copy.
//
// dq = Σ_rows Σ_i a_i V_i is a column sum over rows: the row kernel stores a_i [N, S] in the
// workspace, a column kernel sums chunks of kDqRowsPerChunk rows in double (rows, then sources, in
// order) into partials, and a last kernel adds the partials to dq in chunk order. No atomics, so
// every output is bitwise reproducible.
#include <climits>
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/attnres/attnres_train_cuda.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/common/rowwise_cuda.cuh"

namespace k3::attnres::cuda {

namespace {

constexpr int kMaxThreads = 256;
constexpr int kColThreads = 256;
constexpr int kRed = 2 * kMaxSources;  // row sums reduced per row

// Threads for a row of D: about 4 elements each, a multiple of the warp, at most kMaxThreads.
int row_threads(int64_t D) {
  int64_t t = (D + 3) / 4;
  t = (t + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > kMaxThreads ? kMaxThreads : t));
}

struct FwdArgs {
  const float* src[kMaxSources];
  int S, D;
  const float* q;
  float eps;
  float* h;
  float* alpha;
  float* rinv;
};

__global__ void __launch_bounds__(kMaxThreads) attnres_forward_kernel(const __grid_constant__ FwdArgs a) {
  __shared__ float sh[32][kRed];
  const int64_t off = int64_t(blockIdx.x) * a.D;
  float red[kRed];  // [2i] Σ v_i², [2i+1] Σ v_i q
#pragma unroll
  for (int k = 0; k < kRed; ++k) red[k] = 0.0f;
  for (int d = int(threadIdx.x); d < a.D; d += int(blockDim.x)) {
    const float qd = a.q[d];
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S) {
        const float v = a.src[i][off + d];
        red[2 * i] = fmaf(v, v, red[2 * i]);
        red[2 * i + 1] = fmaf(v, qd, red[2 * i + 1]);
      }
  }
  rowwise::block_sum<kRed>(red, sh);

  // Softmax over the scores s_i = r_i (v_i · q), max-subtracted; identical in every thread.
  float r[kMaxSources], al[kMaxSources];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kMaxSources; ++i)
    if (i < a.S) {
      r[i] = 1.0f / sqrtf(red[2 * i] / float(a.D) + a.eps);
      al[i] = red[2 * i + 1] * r[i];
      mx = fmaxf(mx, al[i]);
    }
  float z = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxSources; ++i)
    if (i < a.S) z += (al[i] = expf(al[i] - mx));
#pragma unroll
  for (int i = 0; i < kMaxSources; ++i)
    if (i < a.S) al[i] /= z;
  if (threadIdx.x == 0) {
    const int64_t o = int64_t(blockIdx.x) * a.S;
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S) a.alpha[o + i] = al[i], a.rinv[o + i] = r[i];
  }

  for (int d = int(threadIdx.x); d < a.D; d += int(blockDim.x)) {
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S) acc = fmaf(al[i], a.src[i][off + d], acc);
    a.h[off + d] = acc;
  }
}

struct BwdArgs {
  const float* src[kMaxSources];
  float* dsrc[kMaxSources];
  int S, D;
  const float* q;
  const float* alpha;
  const float* rinv;
  const float* dh;
  float* coef;  // [N, S] a_i, or null (no dq)
};

__global__ void __launch_bounds__(kMaxThreads) attnres_backward_kernel(const __grid_constant__ BwdArgs a) {
  __shared__ float sh[32][kRed];
  const int64_t off = int64_t(blockIdx.x) * a.D;
  const float* g = a.dh + off;
  float red[kRed];  // [2i] dα_i = Σ g v_i, [2i+1] Σ v_i q
#pragma unroll
  for (int k = 0; k < kRed; ++k) red[k] = 0.0f;
  for (int d = int(threadIdx.x); d < a.D; d += int(blockDim.x)) {
    const float qd = a.q[d], gd = g[d];
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S) {
        const float v = a.src[i][off + d];
        red[2 * i] = fmaf(gd, v, red[2 * i]);
        red[2 * i + 1] = fmaf(v, qd, red[2 * i + 1]);
      }
  }
  rowwise::block_sum<kRed>(red, sh);

  const int64_t o = int64_t(blockIdx.x) * a.S;
  float al[kMaxSources], ca[kMaxSources], cb[kMaxSources];
  float mean = 0.0f;  // Σ_j α_j dα_j
#pragma unroll
  for (int i = 0; i < kMaxSources; ++i)
    if (i < a.S) {
      al[i] = a.alpha[o + i];
      mean = fmaf(al[i], red[2 * i], mean);
    }
#pragma unroll
  for (int i = 0; i < kMaxSources; ++i)
    if (i < a.S) {
      const float r = a.rinv[o + i];
      const float ds = al[i] * (red[2 * i] - mean);
      ca[i] = ds * r;                                         // ∂s_i/∂v = r q − r³ (v·q) v / D
      cb[i] = ca[i] * (r * r) * red[2 * i + 1] / float(a.D);  // the second term's coefficient
    }
  if (a.coef && threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S) a.coef[o + i] = ca[i];
  }

  // Sources inner: a thread updates all dV_i at its d in turn, so dsources may even alias each other.
  for (int d = int(threadIdx.x); d < a.D; d += int(blockDim.x)) {
    const float qd = a.q[d], gd = g[d];
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S && a.dsrc[i]) {
        const float v = a.src[i][off + d];
        a.dsrc[i][off + d] += fmaf(al[i], gd, ca[i] * qd) - cb[i] * v;
      }
  }
}

struct ColArgs {
  const float* src[kMaxSources];
  int S, D;
  int64_t N;
  const float* coef;
};

// part[c][d] = Σ_{n in chunk c} Σ_i a_i[n] v_i[n][d], rows then sources in order, in double.
// Grid: x = chunk, y = block of kColThreads columns.
__global__ void __launch_bounds__(kColThreads)
    attnres_dq_partial_kernel(double* __restrict__ part, const __grid_constant__ ColArgs a) {
  const int d = int(blockIdx.y) * kColThreads + int(threadIdx.x);
  if (d >= a.D) return;
  const int64_t c = blockIdx.x;
  const int64_t n0 = c * kDqRowsPerChunk, n1 = n0 + kDqRowsPerChunk < a.N ? n0 + kDqRowsPerChunk : a.N;
  double acc = 0.0;
  for (int64_t n = n0; n < n1; ++n) {
#pragma unroll
    for (int i = 0; i < kMaxSources; ++i)
      if (i < a.S) acc += double(a.coef[n * a.S + i]) * double(a.src[i][n * a.D + d]);
  }
  part[c * a.D + d] = acc;
}

__global__ void query_forward_kernel(float* __restrict__ q, const float* __restrict__ a, const float* __restrict__ b,
                                     int64_t D) {
  for (int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; d < D; d += int64_t(gridDim.x) * blockDim.x)
    q[d] = a[d] * b[d];
}

__global__ void query_backward_kernel(float* __restrict__ da, float* __restrict__ db, const float* __restrict__ dq,
                                      const float* __restrict__ a, const float* __restrict__ b, int64_t D) {
  for (int64_t d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; d < D; d += int64_t(gridDim.x) * blockDim.x) {
    if (da) da[d] += dq[d] * b[d];
    if (db) db[d] += dq[d] * a[d];
  }
}

int64_t dq_chunks(int64_t N) { return (N + kDqRowsPerChunk - 1) / kDqRowsPerChunk; }
size_t coef_bytes(int64_t N, int S) { return (size_t(N) * size_t(S) * sizeof(float) + 255) / 256 * 256; }

void check_common(const char* fn, const float* const* sources, int S, int64_t N, int64_t D, const float* query) {
  if (S < 1 || S > kMaxSources) fail(fn, ": S = ", S, " sources, must be in [1, ", kMaxSources, "]");
  if (N < 0 || D < 0) fail(fn, ": negative shape N = ", N, ", D = ", D);
  if (N > INT_MAX) fail(fn, ": N = ", N, " rows exceeds the grid limit 2^31-1");
  if (D > INT_MAX) fail(fn, ": D = ", D, " exceeds 2^31-1");
  if (N > 0 && D == 0) fail(fn, ": D = 0 (the mean of an empty row)");
  if (N == 0) return;
  for (int i = 0; i < S; ++i)
    if (!sources[i]) fail(fn, ": sources[", i, "] is null");
  if (!query) fail(fn, ": null query");
}

}  // namespace

void attnres_forward_train(const AttnResTrainParams& p) {
  constexpr const char* fn = "attnres::cuda::attnres_forward_train";
  check_common(fn, p.sources, p.S, p.N, p.D, p.query);
  if (p.N == 0) return;
  if (!p.h || !p.alpha || !p.rinv) fail(fn, ": null h, alpha or rinv");
  FwdArgs a{};
  for (int i = 0; i < p.S; ++i) a.src[i] = p.sources[i];
  a.S = p.S, a.D = int(p.D), a.q = p.query, a.eps = p.eps, a.h = p.h, a.alpha = p.alpha, a.rinv = p.rinv;
  attnres_forward_kernel<<<unsigned(p.N), row_threads(p.D)>>>(a);
  K3_CUDA_LAUNCH_CHECK();
}

size_t attnres_backward_workspace_bytes(int64_t N, int64_t D, int S) {
  if (N <= 0 || D <= 0 || S <= 0) return 0;
  return coef_bytes(N, S) + size_t(dq_chunks(N)) * size_t(D) * sizeof(double);
}

void attnres_backward_train(const AttnResBackwardParams& p) {
  constexpr const char* fn = "attnres::cuda::attnres_backward_train";
  check_common(fn, p.sources, p.S, p.N, p.D, p.query);
  if (p.N == 0) return;
  if (!p.alpha || !p.rinv || !p.dh) fail(fn, ": null alpha, rinv or dh");
  if (p.dquery && !p.workspace)
    fail(fn, ": dquery is given but the workspace is null (attnres_backward_workspace_bytes)");
  float* coef = p.dquery ? static_cast<float*>(p.workspace) : nullptr;

  BwdArgs a{};
  for (int i = 0; i < p.S; ++i) a.src[i] = p.sources[i], a.dsrc[i] = p.dsources[i];
  a.S = p.S, a.D = int(p.D), a.q = p.query, a.alpha = p.alpha, a.rinv = p.rinv, a.dh = p.dh, a.coef = coef;
  attnres_backward_kernel<<<unsigned(p.N), row_threads(p.D)>>>(a);
  K3_CUDA_LAUNCH_CHECK();

  if (p.dquery) {
    ColArgs c{};
    for (int i = 0; i < p.S; ++i) c.src[i] = p.sources[i];
    c.S = p.S, c.D = int(p.D), c.N = p.N, c.coef = coef;
    auto* part = reinterpret_cast<double*>(static_cast<char*>(p.workspace) + coef_bytes(p.N, p.S));
    const int64_t chunks = dq_chunks(p.N);
    const dim3 grid(unsigned(chunks), unsigned((p.D + kColThreads - 1) / kColThreads));
    if (grid.y > 65535u) fail(fn, ": D = ", p.D, " too large for the dq kernel's grid");
    attnres_dq_partial_kernel<<<grid, kColThreads>>>(part, c);
    K3_CUDA_LAUNCH_CHECK();
    elementwise::cuda::add_chunk_column_sums(p.dquery, part, chunks, p.D);
  }
}

void attnres_query_forward(float* q, const float* a, const float* b, int64_t D) {
  if (D < 0) fail("attnres::cuda::attnres_query_forward: negative D = ", D);
  if (D == 0) return;
  if (!q || !a || !b) fail("attnres::cuda::attnres_query_forward: null q, a or b");
  query_forward_kernel<<<rowwise::grid_for(D), 256>>>(q, a, b, D);
  K3_CUDA_LAUNCH_CHECK();
}

void attnres_query_backward(float* da, float* db, const float* dq, const float* a, const float* b, int64_t D) {
  if (D < 0) fail("attnres::cuda::attnres_query_backward: negative D = ", D);
  if (D == 0 || (!da && !db)) return;
  if (!dq || !a || !b) fail("attnres::cuda::attnres_query_backward: null dq, a or b");
  query_backward_kernel<<<rowwise::grid_for(D), 256>>>(da, db, dq, a, b, D);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::attnres::cuda
