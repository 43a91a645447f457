// KDA on the GPU, the small kernels: short conv + SiLU, per-head L2 norm, the lower-bounded gate, the
// gated RMSNorm, and the fused token-by-token recurrence (decode). Contracts: kda_cuda.h. All arithmetic
// in fp32 (bf16 values are widened on load and rounded once on store); the CPU twin sums squares in
// double, so the two agree to fp32 rounding.
#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/cuda.h"
#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/kda/kda_cuda.h"

namespace k3::kda::cuda {
namespace {

using bf16 = __nv_bfloat16;

__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void st(bf16* p, int64_t i, float x) { p[i] = __float2bfloat16_rn(x); }
// x as st() would store it, read back.
template <class T>
__device__ __forceinline__ float ld_rounded(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return __bfloat162float(__float2bfloat16_rn(x));
}

// 1 / (1 + e^-x), as the CPU twin: no NaN at either end.
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// ---- short conv + SiLU -------------------------------------------------------------------------------------
// One thread per (b, t, c). Taps in the CPU twin's order j = 0..K-1 (oldest first) whichever buffer the
// input comes from, so a sequence split across calls gives bit-identical outputs.
template <class T>
__global__ void conv_silu_kernel(T* out, const T* x, int64_t B, int64_t Tn, int64_t C, const float* w, int K,
                                 const float* tail, const int32_t* tail_slot) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= B * Tn * C) return;
  const int64_t c = i % C, t = (i / C) % Tn, b = i / (C * Tn), bt = tail_slot ? tail_slot[b] : b;
  const int P = K - 1;
  float acc = 0.0f;
  for (int j = 0; j < K; ++j) {
    const int64_t s = t - P + j;
    float in;
    if (s >= 0) in = ld(x, (b * Tn + s) * C + c);
    else if (tail != nullptr) in = tail[(bt * P + P + s) * C + c];
    else continue;
    acc = fmaf(w[c * K + j], in, acc);
  }
  st(out, i, acc * sigmoidf_(acc));
}

// One thread per (b, c): the new tail row m is position T - P + m of [old tail ; x], filled in increasing m
// (a row taken from the old tail has index T + m > m, not yet overwritten).
template <class T>
__global__ void conv_tail_kernel(const T* x, int64_t B, int64_t Tn, int64_t C, int K, float* tail,
                                 const int32_t* tail_slot) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= B * C) return;
  const int64_t c = i % C, b = i / C, bt = tail_slot ? tail_slot[b] : b;
  const int P = K - 1;
  for (int m = 0; m < P; ++m) {
    const int64_t s = Tn - P + m;
    const float val = s >= 0 ? ld(x, (b * Tn + s) * C + c) : tail[(bt * P + P + s) * C + c];
    tail[(bt * P + m) * C + c] = val;
  }
}

template <class T>
void conv_launch(T* out, const T* x, int64_t B, int64_t Tn, int64_t C, const float* w, int K, float* tail,
                 const int32_t* tail_slot) {
  K3_CHECK(B >= 1 && Tn >= 0 && C >= 1, "short_conv_silu: need B >= 1, T >= 0, C >= 1; got B=", B, " T=", Tn, " C=", C);
  K3_CHECK(K >= 1 && K <= 8, "short_conv_silu: K must be in [1, 8], got ", K);
  if (Tn == 0) return;
  conv_silu_kernel<T><<<blocks_for(B * Tn * C, 256), 256>>>(out, x, B, Tn, C, w, K, tail, tail_slot);
  K3_CUDA_LAUNCH_CHECK();
  if (tail != nullptr && K > 1) {
    conv_tail_kernel<T><<<blocks_for(B * C, 256), 256>>>(x, B, Tn, C, K, tail, tail_slot);
    K3_CUDA_LAUNCH_CHECK();
  }
}

// ---- per-row norms: one warp per (row, head) --------------------------------------------------------------
// Sum of squares of a row of D values, lane-strided, reduced over the warp (every lane gets the same bits).
template <class T>
__device__ __forceinline__ float row_sum_squares(const T* p, int64_t D, int lane) {
  float ss = 0.0f;
  for (int64_t d = lane; d < D; d += 32) {
    const float v = ld(p, d);
    ss = fmaf(v, v, ss);
  }
  return rowwise::warp_sum(ss);
}

template <class T>
__global__ void l2norm_kernel(T* x, int64_t rows, int64_t D, float eps) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  T* p = x + row * D;
  const float inv = 1.0f / sqrtf(row_sum_squares(p, D, lane) + eps);
  for (int64_t d = lane; d < D; d += 32) st(p, d, ld(p, d) * inv);
}

// ---- one decode step of the three convs and the q, k norms ------------------------------------------------
// One warp per (tensor, sequence, head): lane l takes channels h D + l, l + 32, ... (D / 32 <= 4 of them). Each
// channel is short_conv_silu's thread for T = 1 (the same taps in the same order, the tail shifted by the same
// thread that read it), and q and k are then normalised as l2norm_kernel does: the rounded outputs' squares
// summed lane-strided, the same butterfly. So the fused step has the bits of the four-plus-two launches.
template <class T>
struct ConvQkvArgs {
  T* out[3];
  const T* in[3];
  const float* w[3];
  float* tail[3];
  const int32_t* tail_slot;
  int64_t B, H, D;
  int K;
  float eps;
};

template <class T>
__global__ void conv_qkv_decode_kernel(const __grid_constant__ ConvQkvArgs<T> a) {
  pdl::wait_then_release();
  const int64_t warp = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (warp >= 3 * a.B * a.H) return;
  const int which = int(warp / (a.B * a.H));
  const int64_t b = (warp / a.H) % a.B, h = warp % a.H, C = a.H * a.D, bt = a.tail_slot[b];
  const int P = a.K - 1;
  const float* w = a.w[which];
  float* tail = a.tail[which] + bt * P * C;
  float y[4];
  float ss = 0.0f;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int64_t d = lane + 32 * m;
    if (d >= a.D) break;
    const int64_t c = h * a.D + d;
    const float x = ld(a.in[which], b * C + c);
    float acc = 0.0f;
    for (int j = 0; j < P; ++j) acc = fmaf(w[c * a.K + j], tail[j * C + c], acc);
    acc = fmaf(w[c * a.K + P], x, acc);
    for (int j = 0; j + 1 < P; ++j) tail[j * C + c] = tail[(j + 1) * C + c];
    if (P > 0) tail[(P - 1) * C + c] = x;
    y[m] = ld_rounded<T>(acc * sigmoidf_(acc));
    ss = fmaf(y[m], y[m], ss);
  }
  float inv = 1.0f;
  if (which < 2) inv = 1.0f / sqrtf(rowwise::warp_sum(ss) + a.eps);
  T* out = a.out[which] + b * C + h * a.D;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int64_t d = lane + 32 * m;
    if (d >= a.D) break;
    st(out, d, which < 2 ? y[m] * inv : y[m]);
  }
}

template <class T>
__global__ void gated_rmsnorm_kernel(T* y, const T* o, const T* gate, const float* w, float eps, int64_t rows,
                                     int64_t D) {
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* x = o + row * D;
  const T* gr = gate + row * D;
  T* yr = y + row * D;
  const float inv = 1.0f / sqrtf(row_sum_squares(x, D, lane) / float(D) + eps);
  __syncwarp();  // y may alias o: every lane has read its part of the row before any lane writes
  for (int64_t d = lane; d < D; d += 32) st(yr, d, ld(x, d) * inv * w[d] * sigmoidf_(ld(gr, d)));
}

template <class T>
__global__ void gate_kernel(float* g, const T* z, const float* A_log, const float* dt_bias, float lb, int64_t rows,
                            int64_t H, int64_t D, float* beta) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= rows * H * D) return;
  if (beta && i < rows * H) beta[i] = rowwise::sigmoid_stable(beta[i]);
  const int64_t hd = i % (H * D), h = hd / D;
  g[i] = lb * sigmoidf_(expf(A_log[h]) * (ld(z, i) + dt_bias[hd]));
}

// ---- the fused recurrence ------------------------------------------------------------------------------------
// One CTA of 4 D threads per (b, h) (D = Dk = Dv in {32, 64, 128}); thread (rg, j) = (tid / D, tid % D) owns
// state rows c = R rg .. R rg + R-1 (R = D / 4) of value column j in registers. Per token (K3 eq. 1, as the
// CPU twin):
//   S <- Diag(alpha) S;  u = S^T k;  S <- S + beta k (v - u)^T;  o = S^T (scale q)
// u and o are reduced over the 4 row groups through shared memory.
template <int D>
constexpr int rec_threads() {
  return 4 * D;
}
// FUSE (KdaGateNorm): the gate computed from z as gate_kernel does, beta's sigmoid taken as it reads it, and each
// token's head output put through gated_rmsnorm_kernel's arithmetic (the rounded outputs' squares summed
// lane-strided by one warp, the same butterfly) before it is stored.
template <class TI, class TO, int D, bool FUSE>
__global__ void __launch_bounds__(rec_threads<D>(), 1) recurrent_kernel(KdaParams p, KdaGateNorm f) {
  pdl::wait_then_release();
  static_assert(D == 32 || D == 64 || D == 128, "head dim");
  constexpr int R = D / 4;  // state rows per thread
  __shared__ float sk[D], sq[D], sa[D], red_u[4][D], red_o[4][D], so[FUSE ? D : 1];
  __shared__ float s_inv;
  const int64_t b = blockIdx.x / p.H, h = blockIdx.x % p.H;
  const int tid = threadIdx.x, j = tid % D, rg = tid / D;
  const TI* q = static_cast<const TI*>(p.q);
  const TI* k = static_cast<const TI*>(p.k);
  const TI* v = static_cast<const TI*>(p.v);
  TO* o = static_cast<TO*>(p.o);
  const int64_t bs = p.state_slot ? p.state_slot[b] : b;  // the sequence's place in the state buffers
  const float* S_in = p.state_in + (bs * p.H + h) * D * D;
  float s[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i] = S_in[(rg * R + i) * D + j];

  for (int64_t t = 0; t < p.T; ++t) {
    const int64_t off = ((b * p.T + t) * p.H + h) * D;
    if (tid < D) {
      sk[tid] = ld(k, off + tid);
      sq[tid] = p.scale * ld(q, off + tid);
      if constexpr (FUSE)
        sa[tid] = expf(f.lower_bound * sigmoidf_(expf(f.A_log[h]) * (f.z[off + tid] + f.dt_bias[h * D + tid])));
      else sa[tid] = expf(p.g[off + tid]);
    }
    __syncthreads();
    float u = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int c = rg * R + i;
      s[i] *= sa[c];
      u = fmaf(sk[c], s[i], u);
    }
    red_u[rg][j] = u;
    __syncthreads();
    const float uu = (red_u[0][j] + red_u[1][j]) + (red_u[2][j] + red_u[3][j]);
    float bt = p.beta[(b * p.T + t) * p.H + h];
    if constexpr (FUSE) bt = rowwise::sigmoid_stable(bt);
    const float d = bt * (ld(v, off + j) - uu);
    float ov = 0.0f;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int c = rg * R + i;
      s[i] = fmaf(sk[c], d, s[i]);
      ov = fmaf(sq[c], s[i], ov);
    }
    red_o[rg][j] = ov;
    __syncthreads();
    const float oj = (red_o[0][j] + red_o[1][j]) + (red_o[2][j] + red_o[3][j]);
    if constexpr (FUSE) {
      if (rg == 0) so[j] = ld_rounded<TO>(oj);
      __syncthreads();
      if (tid < 32) {
        float ss = 0.0f;
        for (int d2 = tid; d2 < D; d2 += 32) ss = fmaf(so[d2], so[d2], ss);
        ss = rowwise::warp_sum(ss);
        if (tid == 0) s_inv = 1.0f / sqrtf(ss / float(D) + f.o_eps);
      }
      __syncthreads();
      if (rg == 0)
        st(o, off + j, so[j] * s_inv * f.o_norm[j] * sigmoidf_(ld(static_cast<const TO*>(f.out_gate), off + j)));
    } else {
      if (rg == 0) st(o, off + j, oj);
    }
  }
  float* S_out = p.state_out + (bs * p.H + h) * D * D;
#pragma unroll
  for (int i = 0; i < R; ++i) S_out[(rg * R + i) * D + j] = s[i];
}

bool is_act(DType t) { return t == DType::BF16 || t == DType::F32; }

}  // namespace

void short_conv_silu(float* out, const float* x, int64_t B, int64_t T, int64_t C, const float* weight, int K,
                     float* tail, const int32_t* tail_slot) {
  conv_launch<float>(out, x, B, T, C, weight, K, tail, tail_slot);
}
void short_conv_silu(uint16_t* out, const uint16_t* x, int64_t B, int64_t T, int64_t C, const float* weight, int K,
                     float* tail, const int32_t* tail_slot) {
  conv_launch<bf16>(reinterpret_cast<bf16*>(out), reinterpret_cast<const bf16*>(x), B, T, C, weight, K, tail,
                    tail_slot);
}

template <class T>
static void l2norm_launch(T* x, int64_t rows, int64_t H, int64_t D, float eps) {
  K3_CHECK(rows >= 0 && H >= 1 && D >= 1, "l2norm_heads: need rows >= 0, H >= 1, D >= 1");
  const int64_t n = rows * H;
  if (n == 0) return;
  l2norm_kernel<T><<<blocks_for(n, 8), 256>>>(x, n, D, eps);
  K3_CUDA_LAUNCH_CHECK();
}
void l2norm_heads(float* x, int64_t rows, int64_t H, int64_t D, float eps) { l2norm_launch(x, rows, H, D, eps); }
void l2norm_heads(uint16_t* x, int64_t rows, int64_t H, int64_t D, float eps) {
  l2norm_launch(reinterpret_cast<bf16*>(x), rows, H, D, eps);
}

template <class T>
static void conv_qkv_launch(T* const (&out)[3], const T* const (&in)[3], const float* const (&w)[3], int K,
                            float* const (&tail)[3], const int32_t* tail_slot, int64_t B, int64_t H, int64_t D,
                            float eps) {
  K3_CHECK(B >= 1 && H >= 1 && D >= 32 && D <= 128 && D % 32 == 0 && K >= 1 && K <= 8 && tail_slot,
           "conv_qkv_decode: need B >= 1, H >= 1, D in {32, 64, 96, 128}, K in [1, 8] and tail slots; got B=", B,
           " H=", H, " D=", D, " K=", K);
  ConvQkvArgs<T> a{};
  for (int i = 0; i < 3; ++i) a.out[i] = out[i], a.in[i] = in[i], a.w[i] = w[i], a.tail[i] = tail[i];
  a.tail_slot = tail_slot, a.B = B, a.H = H, a.D = D, a.K = K, a.eps = eps;
  pdl::launch(conv_qkv_decode_kernel<T>, blocks_for(3 * B * H, 8), 256, 0, a);
  K3_CUDA_LAUNCH_CHECK();
}
void conv_qkv_decode(float* const (&out)[3], const float* const (&in)[3], const float* const (&weight)[3], int K,
                     float* const (&tail)[3], const int32_t* tail_slot, int64_t B, int64_t H, int64_t D, float eps) {
  conv_qkv_launch<float>(out, in, weight, K, tail, tail_slot, B, H, D, eps);
}
void conv_qkv_decode(uint16_t* const (&out)[3], const uint16_t* const (&in)[3], const float* const (&weight)[3], int K,
                     float* const (&tail)[3], const int32_t* tail_slot, int64_t B, int64_t H, int64_t D, float eps) {
  bf16* o[3];
  const bf16* x[3];
  for (int i = 0; i < 3; ++i) o[i] = reinterpret_cast<bf16*>(out[i]), x[i] = reinterpret_cast<const bf16*>(in[i]);
  conv_qkv_launch<bf16>(o, x, weight, K, tail, tail_slot, B, H, D, eps);
}

template <class T>
static void gate_launch(float* g, const T* z, const float* A_log, const float* dt_bias, float lb, int64_t rows,
                        int64_t H, int64_t D, float* beta) {
  K3_CHECK(rows >= 0 && H >= 1 && D >= 1, "gate_forward: need rows >= 0, H >= 1, D >= 1");
  K3_CHECK(lb < 0.0f, "gate_forward: lower_bound must be negative, got ", lb);
  const int64_t n = rows * H * D;
  if (n == 0) return;
  gate_kernel<T><<<blocks_for(n, 256), 256>>>(g, z, A_log, dt_bias, lb, rows, H, D, beta);
  K3_CUDA_LAUNCH_CHECK();
}
void gate_forward(float* g, const float* z, const float* A_log, const float* dt_bias, float lower_bound, int64_t rows,
                  int64_t H, int64_t D, float* beta) {
  gate_launch(g, z, A_log, dt_bias, lower_bound, rows, H, D, beta);
}
void gate_forward(float* g, const uint16_t* z, const float* A_log, const float* dt_bias, float lower_bound,
                  int64_t rows, int64_t H, int64_t D, float* beta) {
  gate_launch(g, reinterpret_cast<const bf16*>(z), A_log, dt_bias, lower_bound, rows, H, D, beta);
}

template <class T>
static void rmsnorm_launch(T* y, const T* o, const T* gate, const float* w, float eps, int64_t rows, int64_t H,
                           int64_t D) {
  K3_CHECK(rows >= 0 && H >= 1 && D >= 1, "gated_rmsnorm: need rows >= 0, H >= 1, Dv >= 1");
  const int64_t n = rows * H;
  if (n == 0) return;
  gated_rmsnorm_kernel<T><<<blocks_for(n, 8), 256>>>(y, o, gate, w, eps, n, D);
  K3_CUDA_LAUNCH_CHECK();
}
void gated_rmsnorm(float* y, const float* o, const float* gate, const float* weight, float eps, int64_t rows, int64_t H,
                   int64_t Dv) {
  rmsnorm_launch(y, o, gate, weight, eps, rows, H, Dv);
}
void gated_rmsnorm(uint16_t* y, const uint16_t* o, const uint16_t* gate, const float* weight, float eps, int64_t rows,
                   int64_t H, int64_t Dv) {
  rmsnorm_launch(reinterpret_cast<bf16*>(y), reinterpret_cast<const bf16*>(o), reinterpret_cast<const bf16*>(gate),
                 weight, eps, rows, H, Dv);
}

// Why the recurrence cannot take p, its gate input being `gate` (p.g, or KdaGateNorm's z when fused).
static std::string recurrent_why_not(const KdaParams& p, const float* gate) {
  std::string why;
  if (!k3::cuda::available(&why)) return why;
  if (p.B < 1 || p.H < 1 || p.T < 0) return "kda_recurrent_forward: need B >= 1, H >= 1, T >= 0";
  if (p.D != 32 && p.D != 64 && p.D != 128)
    return "kda_recurrent_forward: head dim D must be 32, 64 or 128 (Dk = Dv = D), got D = " + std::to_string(p.D);
  if (!is_act(p.in_dtype) || !is_act(p.out_dtype)) return "kda_recurrent_forward: q/k/v and o must be BF16 or F32";
  if (p.in_dtype != p.out_dtype) return "kda_recurrent_forward: o must have the dtype of q/k/v";
  if (!p.state_in || !p.state_out) return "kda_recurrent_forward: state_in and state_out are required (may alias)";
  if (p.T > 0 && (!p.q || !p.k || !p.v || !gate || !p.beta || !p.o))
    return "kda_recurrent_forward: q, k, v, g, beta and o are required";
  return {};
}

std::string kda_recurrent_can_run(const KdaParams& p) { return recurrent_why_not(p, p.g); }

template <bool FUSE>
static void recurrent_launch(const KdaParams& p, const KdaGateNorm& f) {
  const unsigned grid = static_cast<unsigned>(p.B * p.H);
  const bool f32 = p.in_dtype == DType::F32;
  switch (p.D) {
    case 32:
      if (f32) pdl::launch(recurrent_kernel<float, float, 32, FUSE>, grid, rec_threads<32>(), 0, p, f);
      else pdl::launch(recurrent_kernel<bf16, bf16, 32, FUSE>, grid, rec_threads<32>(), 0, p, f);
      break;
    case 64:
      if (f32) pdl::launch(recurrent_kernel<float, float, 64, FUSE>, grid, rec_threads<64>(), 0, p, f);
      else pdl::launch(recurrent_kernel<bf16, bf16, 64, FUSE>, grid, rec_threads<64>(), 0, p, f);
      break;
    default:
      if (f32) pdl::launch(recurrent_kernel<float, float, 128, FUSE>, grid, rec_threads<128>(), 0, p, f);
      else pdl::launch(recurrent_kernel<bf16, bf16, 128, FUSE>, grid, rec_threads<128>(), 0, p, f);
      break;
  }
  K3_CUDA_LAUNCH_CHECK();
}

void kda_recurrent_forward(const KdaParams& p) {
  const std::string why = kda_recurrent_can_run(p);
  K3_CHECK(why.empty(), why);
  recurrent_launch<false>(p, KdaGateNorm{});
}

void kda_recurrent_forward(const KdaParams& p, const KdaGateNorm& f) {
  const std::string why = recurrent_why_not(p, f.z);
  K3_CHECK(why.empty(), why);
  K3_CHECK(f.z && f.A_log && f.dt_bias && f.out_gate && f.o_norm && f.lower_bound < 0.0f,
           "kda_recurrent_forward (gate and norm fused): z, A_log, dt_bias, out_gate and o_norm are required and the "
           "lower bound negative");
  recurrent_launch<true>(p, f);
}

}  // namespace k3::kda::cuda
