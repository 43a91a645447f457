// The KDA block's elementwise and per-row training ops on the GPU, fp32: contracts in kda_train_ops_cuda.h,
// float64 twins in kda_f64.h. The ops that feed or take from the tensor-core recurrence (conv + SiLU's act and
// d_act, gated RMSNorm's d_o, L2 norm's out and d_out) also have bf16 forms: each kernel is a template on the
// element type of the tensors that change, so both forms run one formula in fp32 and differ only in the load
// (bf16 widens exactly) or the store (rounded to nearest even once, from the value the fp32 form writes). The
// fp32 forms instantiate the template with float, whose load and store are plain, and keep their bits.
//
// Numerics. Values are fp32 and so is the elementwise math; every reduction (a row's sum of squares or dot
// product, a parameter gradient's sum over rows) accumulates in float64 and is rounded once, so the sums
// add no error beyond fp32 rounding of their terms whatever the row count or cancellation. Sigmoids are
// the stable form (exp of a non-positive number only): sigmoid(x) and 1 - sigmoid(x) = sigmoid(-x) each
// keep their relative accuracy at either end, and s(1 - s) is computed as e/(1 + e)^2, e = exp(-|x|).
//
// Determinism. No atomics. Per-row results come from one warp or thread in a fixed order (warp sums are
// xor butterflies: every lane gets the same bits). A parameter gradient summed over rows is reduced in two
// steps: kernel 1 writes a float64 partial sum per 64-row chunk and column to the workspace (the rows of a
// chunk in ascending order), kernel 2 sums a column's partials in chunk order and adds the total, rounded
// once, to the fp32 gradient. Chunks are fixed runs of packed rows, so the bits depend only on the inputs.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/kda/kda_train_ops_cuda.h"

namespace k3::kda::cuda {
namespace {

constexpr int kThreads = 256;         // threads per block, every kernel here
constexpr int kRowsPerWarpBlock = 8;  // rows per block of the warp-per-row kernels (kThreads / 32)
constexpr int64_t kChunkRows = 64;    // rows per partial sum of a parameter gradient
constexpr int kMaxK = 8;              // the conv's taps, as the inference conv (kda_cuda_ops.cu)

int64_t chunks_of(int64_t rows) { return (rows + kChunkRows - 1) / kChunkRows; }
unsigned blocks_for(int64_t n, int64_t per_block) { return static_cast<unsigned>((n + per_block - 1) / per_block); }

// Grid of the partial-sum kernels: x = the row chunk (up to 2^31 - 1), y = a block of kThreads columns.
dim3 chunk_grid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>(chunks_of(rows)), blocks_for(cols, kThreads));
}
void check_chunk_grid(const char* fn, int64_t rows, int64_t cols) {
  K3_CHECK(chunks_of(rows) <= 0x7fffffff && blocks_for(cols, kThreads) <= 65535u, fn, ": ", rows, " rows of ", cols,
           " columns exceed the partial-sum grid");
}

// ---- element access: fp32 or bf16 storage, fp32 math -----------------------------------------------------------
using bf16 = __nv_bfloat16;
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }  // exact
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(bf16* p, float x) { *p = __float2bfloat16_rn(x); }

// The public bf16 forms take the bits as uint16_t (the header is plain C++).
bf16* as_bf16(uint16_t* p) { return reinterpret_cast<bf16*>(p); }
const bf16* as_bf16(const uint16_t* p) { return reinterpret_cast<const bf16*>(p); }

// ---- sigmoid pieces -----------------------------------------------------------------------------------------
struct Sig {
  float s;    // sigmoid(x)
  float oms;  // 1 - sigmoid(x) = sigmoid(-x)
  float ds;   // s (1 - s)
};
__device__ __forceinline__ Sig sig(float x) {
  const float e = expf(-fabsf(x));  // in [0, 1]: no overflow for any x
  const float r = 1.0f / (1.0f + e);
  Sig o;
  o.s = x >= 0.0f ? r : e * r;
  o.oms = x >= 0.0f ? e * r : r;
  o.ds = e * r * r;
  return o;
}
__device__ __forceinline__ float sigmoid(float x) { return sig(x).s; }

// ---- packed sequences -----------------------------------------------------------------------------------------
// The sequence holding row t: the largest b in [0, B) with cu[b] <= t (an empty sequence before it is
// skipped, since its end equals the next start).
__device__ __forceinline__ int seq_of(int64_t t, const int32_t* cu, int B) {
  int lo = 0, hi = B;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] <= t) lo = mid;
    else hi = mid;
  }
  return lo;
}

// ---- column sums of partials ----------------------------------------------------------------------------------
// Column col of partial [n_chunks, ncols], summed in chunk order. acc (fp32, may be null) gets the total
// added (rounded once); sum (float64, may be null) gets it as is.
__global__ void sum_chunks_kernel(float* acc, double* sum, const double* partial, int64_t n_chunks, int64_t ncols) {
  const int64_t col = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (col >= ncols) return;
  double s = 0.0;
  for (int64_t k = 0; k < n_chunks; ++k) s += partial[k * ncols + col];
  if (acc) acc[col] = static_cast<float>(static_cast<double>(acc[col]) + s);
  if (sum) sum[col] = s;
}

void sum_chunks(float* acc, double* sum, const double* partial, int64_t n_chunks, int64_t ncols) {
  sum_chunks_kernel<<<blocks_for(ncols, kThreads), kThreads>>>(acc, sum, partial, n_chunks, ncols);
  K3_CUDA_LAUNCH_CHECK();
}

// ---- conv + SiLU ----------------------------------------------------------------------------------------------
// One thread per (t, c), taps in the twin's order j = 0..K-1 (oldest row first). Act: float or bf16.
template <class Act>
__global__ void conv_fwd_kernel(float* pre, Act* act, const float* in, const float* w, int64_t C, int K,
                                const int32_t* cu, int B, int64_t rows) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * C) return;
  const int64_t t = i / C, c = i % C;
  const int64_t start = cu[seq_of(t, cu, B)];
  const int P = K - 1;
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) {
    const int64_t s = t - P + j;
    if (s >= start) acc = fmaf(w[c * K + j], in[s * C + c], acc);
  }
  pre[i] = acc;
  store(act + i, acc * sigmoid(acc));
}

// d_pre = d_act SiLU'(pre), SiLU'(p) = s (1 + p (1 - s)). DAct (d_act's element): float or bf16.
template <class DAct>
__device__ __forceinline__ float conv_dpre(const DAct* d_act, const float* pre, int64_t i) {
  const float p = pre[i];
  const Sig g = sig(p);
  return to_f32(d_act[i]) * (g.s * (1.0f + p * g.oms));
}

// d_in[s, c] = sum_j w[c, j] d_pre[s + P - j, c] over the rows of s's sequence; one thread per (s, c),
// the rows in ascending order (j = K-1 down to 0).
template <class DAct>
__global__ void conv_bwd_in_kernel(float* d_in, const DAct* d_act, const float* pre, const float* w, int64_t C, int K,
                                   const int32_t* cu, int B, int64_t rows) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * C) return;
  const int64_t s = i / C, c = i % C;
  const int64_t end = min(int64_t(cu[seq_of(s, cu, B) + 1]), rows);
  const int P = K - 1;
  float acc = 0.0f;
  for (int j = K - 1; j >= 0; --j) {
    const int64_t t = s + P - j;
    if (t < end) acc = fmaf(w[c * K + j], conv_dpre(d_act, pre, t * C + c), acc);
  }
  d_in[i] = acc;
}

// Partial dw[c, j] = sum over the chunk's rows t of d_pre[t, c] in[t - P + j, c] (rows of t's sequence only),
// written to partial[chunk][c*K + j].
template <class DAct>
__global__ void conv_bwd_w_kernel(double* partial, const DAct* d_act, const float* pre, const float* in, int64_t C,
                                  int K, const int32_t* cu, int B, int64_t rows) {
  const int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t t0 = blockIdx.x * kChunkRows, t1 = min(rows, t0 + kChunkRows);
  const int P = K - 1;
  double acc[kMaxK];
#pragma unroll
  for (int j = 0; j < kMaxK; ++j) acc[j] = 0.0;
  int b = seq_of(t0, cu, B);
  for (int64_t t = t0; t < t1; ++t) {
    while (b + 1 < B && cu[b + 1] <= t) ++b;
    const int64_t start = cu[b];
    const double dp = conv_dpre(d_act, pre, t * C + c);
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
      const int64_t s = t - P + j;
      if (j < K && s >= start) acc[j] += dp * double(in[s * C + c]);
    }
  }
  double* out = partial + (int64_t(blockIdx.x) * C + c) * K;
#pragma unroll
  for (int j = 0; j < kMaxK; ++j)
    if (j < K) out[j] = acc[j];
}

void check_conv(const char* fn, int64_t C, int K, const int32_t* cu, int B, int64_t rows) {
  K3_CHECK(C >= 1, fn, ": C must be >= 1, got ", C);
  K3_CHECK(K >= 1 && K <= kMaxK, fn, ": K must be in [1, ", kMaxK, "], got ", K);
  K3_CHECK(rows >= 0, fn, ": rows must be >= 0, got ", rows);
  K3_CHECK(rows == 0 || (B >= 1 && cu != nullptr), fn, ": need B >= 1 and cu_seqlens for ", rows, " rows, got B = ", B,
           (cu ? "" : " and a null cu_seqlens"));
}

// ---- gate ---------------------------------------------------------------------------------------------------
__global__ void gate_fwd_kernel(float* g, float* sg, const float* z, const float* A_log, const float* dt_bias, float lb,
                                int64_t rows, int64_t H, int64_t D) {
  const int64_t HD = H * D;
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * HD) return;
  const int64_t hd = i % HD, h = hd / D;
  const float s = sigmoid(expf(A_log[h]) * (z[i] + dt_bias[hd]));
  sg[i] = s;
  g[i] = lb * s;
}

// dz over the chunk's rows of column hd (written), and the column's partial sums of A dm (-> ddt_bias) and
// dm (z + dt_bias) A (-> dA_log) to partial_dt / partial_al [chunk][hd].
__global__ void gate_bwd_kernel(float* dz, double* partial_dt, double* partial_al, const float* dg, const float* z,
                                const float* A_log, const float* dt_bias, float lb, int64_t rows, int64_t H,
                                int64_t D) {
  const int64_t HD = H * D;
  const int64_t hd = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (hd >= HD) return;
  const int64_t t0 = blockIdx.x * kChunkRows, t1 = min(rows, t0 + kChunkRows);
  const float A = expf(A_log[hd / D]), bias = dt_bias[hd];
  double acc_dt = 0.0, acc_al = 0.0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t i = t * HD + hd;
    const float x = z[i] + bias;
    const float dm = lb * dg[i] * sig(A * x).ds;
    const float dzi = A * dm;
    dz[i] = dzi;
    acc_dt += double(dzi);
    acc_al += double(dm) * double(x) * double(A);
  }
  partial_dt[int64_t(blockIdx.x) * HD + hd] = acc_dt;
  partial_al[int64_t(blockIdx.x) * HD + hd] = acc_al;
}

// dA_log[h] += sum over the head's D columns of colsum_al; one warp per head.
__global__ void gate_alog_kernel(float* dA_log, const double* colsum_al, int64_t H, int64_t D) {
  const int64_t h = blockIdx.x * int64_t(kRowsPerWarpBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (h >= H) return;
  double s = 0.0;
  for (int64_t d = lane; d < D; d += 32) s += colsum_al[h * D + d];
  s = rowwise::warp_sum(s);
  if (lane == 0) dA_log[h] = static_cast<float>(static_cast<double>(dA_log[h]) + s);
}

void check_gate(const char* fn, int64_t rows, int64_t H, int64_t D, float lb) {
  K3_CHECK(rows >= 0 && H >= 1 && D >= 1, fn, ": need rows >= 0, H >= 1, D >= 1; got rows = ", rows, ", H = ", H,
           ", D = ", D);
  K3_CHECK(std::isfinite(lb) && lb < 0.0f, fn, ": lower_bound must be finite and negative, got ", lb);
}

// ---- per-row norms: one warp per row of D -----------------------------------------------------------------------
__global__ void grms_fwd_kernel(float* on, float* inv, const float* o, const float* gp, const float* w, float eps,
                                int64_t rows, int64_t D) {
  const int64_t r = blockIdx.x * int64_t(kRowsPerWarpBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float* orow = o + r * D;
  double ss = 0.0;
  for (int64_t e = lane; e < D; e += 32) ss += double(orow[e]) * double(orow[e]);
  ss = rowwise::warp_sum(ss);
  const float v = static_cast<float>(1.0 / sqrt(ss / double(D) + double(eps)));
  if (lane == 0) inv[r] = v;
  for (int64_t e = lane; e < D; e += 32) on[r * D + e] = orow[e] * v * w[e] * sigmoid(gp[r * D + e]);
}

// dn = don w s, n = o inv: d_o = inv (dn - n mean(dn n)), dgp = don n w s (1 - s). DO (d_o's element): float
// or bf16.
template <class DO>
__global__ void grms_bwd_kernel(DO* d_o, float* dgp, const float* don, const float* o, const float* inv,
                                const float* gp, const float* w, int64_t rows, int64_t D) {
  const int64_t r = blockIdx.x * int64_t(kRowsPerWarpBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float v = inv[r];
  double dot = 0.0;
  for (int64_t e = lane; e < D; e += 32) {
    const int64_t i = r * D + e;
    dot += double(don[i] * w[e] * sigmoid(gp[i])) * double(o[i] * v);
  }
  const float mean = static_cast<float>(rowwise::warp_sum(dot) / double(D));
  for (int64_t e = lane; e < D; e += 32) {
    const int64_t i = r * D + e;
    const Sig g = sig(gp[i]);
    const float n = o[i] * v, dd = don[i];
    const float dn = dd * w[e] * g.s;
    dgp[i] = dd * n * w[e] * g.ds;
    store(d_o + i, v * (dn - n * mean));
  }
}

// Partial dw[e] = sum over the chunk's rows of don n s.
__global__ void grms_bwd_w_kernel(double* partial, const float* don, const float* o, const float* inv, const float* gp,
                                  int64_t rows, int64_t D) {
  const int64_t e = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (e >= D) return;
  const int64_t r0 = blockIdx.x * kChunkRows, r1 = min(rows, r0 + kChunkRows);
  double acc = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * D + e;
    acc += double(don[i]) * double(o[i] * inv[r]) * double(sigmoid(gp[i]));
  }
  partial[int64_t(blockIdx.x) * D + e] = acc;
}

// out = in inv; Out (out's element): float or bf16.
template <class Out>
__global__ void l2_fwd_kernel(Out* out, float* inv, const float* in, int64_t rows, int64_t D, float eps) {
  const int64_t r = blockIdx.x * int64_t(kRowsPerWarpBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float* x = in + r * D;
  double ss = 0.0;
  for (int64_t d = lane; d < D; d += 32) ss += double(x[d]) * double(x[d]);
  const float v = static_cast<float>(1.0 / sqrt(rowwise::warp_sum(ss) + double(eps)));
  if (lane == 0) inv[r] = v;
  for (int64_t d = lane; d < D; d += 32) store(out + r * D + d, x[d] * v);
}

// d_in = inv (d_out - out (out . d_out)); T (out's and d_out's element): float or bf16. The fp32 form's d_in may
// alias d_out: a lane writes only the elements it read itself, after the warp's sum (a shuffle, which every lane
// reaches after its reads).
template <class T>
__global__ void l2_bwd_kernel(float* d_in, const T* d_out, const T* out, const float* inv, int64_t rows, int64_t D) {
  const int64_t r = blockIdx.x * int64_t(kRowsPerWarpBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  double dot = 0.0;
  for (int64_t d = lane; d < D; d += 32) dot += double(to_f32(out[r * D + d])) * double(to_f32(d_out[r * D + d]));
  const float dp = static_cast<float>(rowwise::warp_sum(dot));
  const float v = inv[r];
  for (int64_t d = lane; d < D; d += 32) {
    const int64_t i = r * D + d;
    d_in[i] = v * (to_f32(d_out[i]) - to_f32(out[i]) * dp);
  }
}

void check_rows(const char* fn, int64_t rows, int64_t D) {
  K3_CHECK(rows >= 0 && D >= 1, fn, ": need head_rows >= 0 and D >= 1, got head_rows = ", rows, ", D = ", D);
}

// ---- sigmoid ------------------------------------------------------------------------------------------------
__global__ void sigmoid_fwd_kernel(float* beta, const float* x, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) beta[i] = sigmoid(x[i]);
}
__global__ void sigmoid_bwd_kernel(float* dx, const float* dbeta, const float* beta, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    const float b = beta[i];
    dx[i] = dbeta[i] * (b * (1.0f - b));
  }
}

void need(const char* fn, const void* p, const char* name) { K3_CHECK(p != nullptr, fn, ": ", name, " is null"); }

}  // namespace

// ---- conv + SiLU ----------------------------------------------------------------------------------------------
namespace {
// Both forms of each direction: Act / DAct is float or bf16, the checks and launches are shared.
template <class Act>
void conv_forward(float* pre, Act* act, const float* in, const float* w, int64_t C, int K, const int32_t* cu_seqlens,
                  int B, int64_t rows) {
  const char* fn = "conv_silu_forward_train";
  check_conv(fn, C, K, cu_seqlens, B, rows);
  if (rows == 0) return;
  need(fn, pre, "pre"), need(fn, act, "act"), need(fn, in, "in"), need(fn, w, "w");
  conv_fwd_kernel<<<blocks_for(rows * C, kThreads), kThreads>>>(pre, act, in, w, C, K, cu_seqlens, B, rows);
  K3_CUDA_LAUNCH_CHECK();
}

template <class DAct>
void conv_backward(float* d_in, float* dw, const DAct* d_act, const float* pre, const float* in, const float* w,
                   int64_t C, int K, const int32_t* cu_seqlens, int B, int64_t rows, void* workspace) {
  const char* fn = "conv_silu_backward_train";
  check_conv(fn, C, K, cu_seqlens, B, rows);
  if (rows == 0) return;
  need(fn, d_in, "d_in"), need(fn, dw, "dw"), need(fn, d_act, "d_act"), need(fn, pre, "pre"), need(fn, in, "in");
  need(fn, w, "w"), need(fn, workspace, "workspace");
  K3_CHECK(static_cast<const void*>(d_in) != static_cast<const void*>(d_act), fn, ": d_in must not alias d_act");
  check_chunk_grid(fn, rows, C);
  auto* partial = static_cast<double*>(workspace);
  conv_bwd_w_kernel<<<chunk_grid(rows, C), kThreads>>>(partial, d_act, pre, in, C, K, cu_seqlens, B, rows);
  K3_CUDA_LAUNCH_CHECK();
  sum_chunks(dw, nullptr, partial, chunks_of(rows), C * K);
  conv_bwd_in_kernel<<<blocks_for(rows * C, kThreads), kThreads>>>(d_in, d_act, pre, w, C, K, cu_seqlens, B, rows);
  K3_CUDA_LAUNCH_CHECK();
}
}  // namespace

void conv_silu_forward_train(float* pre, float* act, const float* in, const float* w, int64_t C, int K,
                             const int32_t* cu_seqlens, int B, int64_t rows) {
  conv_forward(pre, act, in, w, C, K, cu_seqlens, B, rows);
}
void conv_silu_forward_train(float* pre, uint16_t* act, const float* in, const float* w, int64_t C, int K,
                             const int32_t* cu_seqlens, int B, int64_t rows) {
  conv_forward(pre, as_bf16(act), in, w, C, K, cu_seqlens, B, rows);
}

size_t conv_silu_backward_workspace_bytes(int64_t rows, int64_t C, int K) {
  K3_CHECK(rows >= 0 && C >= 1 && K >= 1, "conv_silu_backward_workspace_bytes: need rows >= 0, C >= 1, K >= 1; got ",
           rows, ", ", C, ", ", K);
  return static_cast<size_t>(chunks_of(rows) * C * K) * sizeof(double);
}

void conv_silu_backward_train(float* d_in, float* dw, const float* d_act, const float* pre, const float* in,
                              const float* w, int64_t C, int K, const int32_t* cu_seqlens, int B, int64_t rows,
                              void* workspace) {
  conv_backward(d_in, dw, d_act, pre, in, w, C, K, cu_seqlens, B, rows, workspace);
}
void conv_silu_backward_train(float* d_in, float* dw, const uint16_t* d_act, const float* pre, const float* in,
                              const float* w, int64_t C, int K, const int32_t* cu_seqlens, int B, int64_t rows,
                              void* workspace) {
  conv_backward(d_in, dw, as_bf16(d_act), pre, in, w, C, K, cu_seqlens, B, rows, workspace);
}

// ---- gate ---------------------------------------------------------------------------------------------------
void gate_forward_train(float* g, float* sg, const float* z, const float* A_log, const float* dt_bias,
                        float lower_bound, int64_t rows, int64_t H, int64_t D) {
  const char* fn = "gate_forward_train";
  check_gate(fn, rows, H, D, lower_bound);
  if (rows == 0) return;
  need(fn, g, "g"), need(fn, sg, "sg"), need(fn, z, "z"), need(fn, A_log, "A_log"), need(fn, dt_bias, "dt_bias");
  gate_fwd_kernel<<<blocks_for(rows * H * D, kThreads), kThreads>>>(g, sg, z, A_log, dt_bias, lower_bound, rows, H, D);
  K3_CUDA_LAUNCH_CHECK();
}

size_t gate_backward_workspace_bytes(int64_t rows, int64_t H, int64_t D) {
  K3_CHECK(rows >= 0 && H >= 1 && D >= 1, "gate_backward_workspace_bytes: need rows >= 0, H >= 1, D >= 1; got ", rows,
           ", ", H, ", ", D);
  if (rows == 0) return 0;
  return static_cast<size_t>(2 * chunks_of(rows) * H * D + H * D) * sizeof(double);
}

void gate_backward_train(float* dz, float* dA_log, float* ddt_bias, const float* dg, const float* sg, const float* z,
                         const float* A_log, const float* dt_bias, float lower_bound, int64_t rows, int64_t H,
                         int64_t D, void* workspace) {
  const char* fn = "gate_backward_train";
  (void)sg;  // s (1 - s) is recomputed from z (see the header)
  check_gate(fn, rows, H, D, lower_bound);
  if (rows == 0) return;
  need(fn, dz, "dz"), need(fn, dA_log, "dA_log"), need(fn, ddt_bias, "ddt_bias"), need(fn, dg, "dg");
  need(fn, z, "z"), need(fn, A_log, "A_log"), need(fn, dt_bias, "dt_bias"), need(fn, workspace, "workspace");
  const int64_t HD = H * D, nc = chunks_of(rows);
  check_chunk_grid(fn, rows, HD);
  auto* partial_dt = static_cast<double*>(workspace);
  double* partial_al = partial_dt + nc * HD;
  double* colsum_al = partial_al + nc * HD;
  gate_bwd_kernel<<<chunk_grid(rows, HD), kThreads>>>(dz, partial_dt, partial_al, dg, z, A_log, dt_bias, lower_bound,
                                                      rows, H, D);
  K3_CUDA_LAUNCH_CHECK();
  sum_chunks(ddt_bias, nullptr, partial_dt, nc, HD);
  sum_chunks(nullptr, colsum_al, partial_al, nc, HD);
  gate_alog_kernel<<<blocks_for(H, kRowsPerWarpBlock), kThreads>>>(dA_log, colsum_al, H, D);
  K3_CUDA_LAUNCH_CHECK();
}

// ---- gated RMSNorm ------------------------------------------------------------------------------------------
void gated_rmsnorm_forward_train(float* on, float* inv, const float* o, const float* gp, const float* w, float eps,
                                 int64_t head_rows, int64_t D) {
  const char* fn = "gated_rmsnorm_forward_train";
  check_rows(fn, head_rows, D);
  if (head_rows == 0) return;
  need(fn, on, "on"), need(fn, inv, "inv"), need(fn, o, "o"), need(fn, gp, "gp"), need(fn, w, "w");
  grms_fwd_kernel<<<blocks_for(head_rows, kRowsPerWarpBlock), kThreads>>>(on, inv, o, gp, w, eps, head_rows, D);
  K3_CUDA_LAUNCH_CHECK();
}

size_t gated_rmsnorm_backward_workspace_bytes(int64_t head_rows, int64_t D) {
  K3_CHECK(head_rows >= 0 && D >= 1, "gated_rmsnorm_backward_workspace_bytes: need head_rows >= 0, D >= 1; got ",
           head_rows, ", ", D);
  return static_cast<size_t>(chunks_of(head_rows) * D) * sizeof(double);
}

namespace {
// Both forms: DO (d_o's element) is float or bf16.
template <class DO>
void gated_rmsnorm_backward(DO* d_o, float* dgp, float* dw, const float* don, const float* o, const float* inv,
                            const float* gp, const float* w, int64_t head_rows, int64_t D, void* workspace) {
  const char* fn = "gated_rmsnorm_backward_train";
  check_rows(fn, head_rows, D);
  if (head_rows == 0) return;
  need(fn, d_o, "d_o"), need(fn, dgp, "dgp"), need(fn, dw, "dw"), need(fn, don, "don"), need(fn, o, "o");
  need(fn, inv, "inv"), need(fn, gp, "gp"), need(fn, w, "w"), need(fn, workspace, "workspace");
  check_chunk_grid(fn, head_rows, D);
  auto* partial = static_cast<double*>(workspace);
  grms_bwd_w_kernel<<<chunk_grid(head_rows, D), kThreads>>>(partial, don, o, inv, gp, head_rows, D);
  K3_CUDA_LAUNCH_CHECK();
  sum_chunks(dw, nullptr, partial, chunks_of(head_rows), D);
  grms_bwd_kernel<<<blocks_for(head_rows, kRowsPerWarpBlock), kThreads>>>(d_o, dgp, don, o, inv, gp, w, head_rows, D);
  K3_CUDA_LAUNCH_CHECK();
}
}  // namespace

void gated_rmsnorm_backward_train(float* d_o, float* dgp, float* dw, const float* don, const float* o, const float* inv,
                                  const float* gp, const float* w, int64_t head_rows, int64_t D, void* workspace) {
  gated_rmsnorm_backward(d_o, dgp, dw, don, o, inv, gp, w, head_rows, D, workspace);
}
void gated_rmsnorm_backward_train(uint16_t* d_o, float* dgp, float* dw, const float* don, const float* o,
                                  const float* inv, const float* gp, const float* w, int64_t head_rows, int64_t D,
                                  void* workspace) {
  gated_rmsnorm_backward(as_bf16(d_o), dgp, dw, don, o, inv, gp, w, head_rows, D, workspace);
}

// ---- L2 norm ------------------------------------------------------------------------------------------------
namespace {
// Both forms: Out / T (out's and d_out's element) is float or bf16.
template <class Out>
void l2norm_forward(Out* out, float* inv, const float* in, int64_t head_rows, int64_t D, float eps) {
  const char* fn = "l2norm_forward_train";
  check_rows(fn, head_rows, D);
  if (head_rows == 0) return;
  need(fn, out, "out"), need(fn, inv, "inv"), need(fn, in, "in");
  l2_fwd_kernel<<<blocks_for(head_rows, kRowsPerWarpBlock), kThreads>>>(out, inv, in, head_rows, D, eps);
  K3_CUDA_LAUNCH_CHECK();
}

template <class T>
void l2norm_backward(float* d_in, const T* d_out, const T* out, const float* inv, int64_t head_rows, int64_t D) {
  const char* fn = "l2norm_backward_train";
  check_rows(fn, head_rows, D);
  if (head_rows == 0) return;
  need(fn, d_in, "d_in"), need(fn, d_out, "d_out"), need(fn, out, "out"), need(fn, inv, "inv");
  l2_bwd_kernel<<<blocks_for(head_rows, kRowsPerWarpBlock), kThreads>>>(d_in, d_out, out, inv, head_rows, D);
  K3_CUDA_LAUNCH_CHECK();
}
}  // namespace

void l2norm_forward_train(float* out, float* inv, const float* in, int64_t head_rows, int64_t D, float eps) {
  l2norm_forward(out, inv, in, head_rows, D, eps);
}
void l2norm_forward_train(uint16_t* out, float* inv, const float* in, int64_t head_rows, int64_t D, float eps) {
  l2norm_forward(as_bf16(out), inv, in, head_rows, D, eps);
}
void l2norm_backward_train(float* d_in, const float* d_out, const float* out, const float* inv, int64_t head_rows,
                           int64_t D) {
  l2norm_backward(d_in, d_out, out, inv, head_rows, D);
}
void l2norm_backward_train(float* d_in, const uint16_t* d_out, const uint16_t* out, const float* inv, int64_t head_rows,
                           int64_t D) {
  l2norm_backward(d_in, as_bf16(d_out), as_bf16(out), inv, head_rows, D);
}

// ---- sigmoid ------------------------------------------------------------------------------------------------
void sigmoid_forward_train(float* beta, const float* x, int64_t n) {
  K3_CHECK(n >= 0, "sigmoid_forward_train: n must be >= 0, got ", n);
  if (n == 0) return;
  need("sigmoid_forward_train", beta, "beta"), need("sigmoid_forward_train", x, "x");
  sigmoid_fwd_kernel<<<blocks_for(n, kThreads), kThreads>>>(beta, x, n);
  K3_CUDA_LAUNCH_CHECK();
}

void sigmoid_backward_train(float* dx, const float* dbeta, const float* beta, int64_t n) {
  K3_CHECK(n >= 0, "sigmoid_backward_train: n must be >= 0, got ", n);
  if (n == 0) return;
  need("sigmoid_backward_train", dx, "dx"), need("sigmoid_backward_train", dbeta, "dbeta");
  need("sigmoid_backward_train", beta, "beta");
  sigmoid_bwd_kernel<<<blocks_for(n, kThreads), kThreads>>>(dx, dbeta, beta, n);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::kda::cuda
