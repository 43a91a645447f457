// The training MLA attention core on bf16 tensor cores (mla_train_tc_cuda.h: the design and the
// numerics; mla_train_cuda.h: the semantics). The CPU twins are in mla_f64.cpp.
//
// MMA FRAGMENTS (PTX ISA, "Matrix Fragments for mma.m16n8k16" with .bf16 operands; the warp's
// lane = 4 g + t, g = groupID = lane / 4 in 0..7, t = threadID_in_group = lane % 4 in 0..3). A
// 32-bit register holds two bf16, the lower column (A) / lower k (B) index in the low half:
//   A (16 x 16, row-major), 4 registers: a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1],
//                                        a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];
//   B (16 x 8, "col": k fastest), 2 registers: b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g];
//   C, D (16 x 8, fp32), 4 registers: c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1].
// Every operand is read from shared memory with plain 32-bit loads of two adjacent bf16:
//   - A = X (X row-major [m][k] in shared memory): a0 = X[g][k0 + 2t ..], a2 = X[g][k0 + 2t + 8 ..];
//   - B for a product X Yᵀ (both row-major [rows][k]): B[k][n] = Y[n][k], so b0 = Y[n0 + g][k0 + 2t ..];
//   - B for a product P Y with Y [k][n] row-major: B[k][n] = Y[k][n] is NOT contiguous in k, so such
//     Y are stored TRANSPOSED in shared memory (Yt [n][k], written so as they are loaded), and
//     b0 = Yt[n0 + g][k0 + 2t ..].
//   - A from accumulators: the C fragments of n-tiles 2c and 2c+1 (columns 16c .. 16c + 15) are
//     exactly the A fragment of the 16-column chunk c: a0 = (C_2c[0], C_2c[1]), a1 = (C_2c[2], C_2c[3]),
//     a2 = (C_2c+1[0], C_2c+1[1]), a3 = (C_2c+1[2], C_2c+1[3]), rounded to bf16.
// Shared rows are D + 8 bf16 long with D a multiple of 16 (or 32/64 for the transposed tiles): the
// row stride in words is 4 (mod 8) times an odd number, so the 32 lanes' words g·stride + t fall in 32
// distinct banks: every fragment load is conflict-free.
// Row statistics in the accumulator layout: row g (and g + 8) of a warp's 16 is spread over the 4
// lanes 4g .. 4g + 3, so row maxima and sums are xor-shuffles over offsets 1 and 2 (every lane ends
// with the same bits, since a + b == b + a exactly).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/mla/mla_train_common.cuh"
#include "kernels/mla/mla_train_tc_cuda.h"

namespace k3::mla::cuda {

namespace {

using train_common::allow_smem;
using train_common::check_attention;
using train_common::check_backward;
using train_common::delta_bytes;

constexpr int kThreads = 128;            // 4 warps of 16 rows each
constexpr int kFwdBM = 64, kFwdBN = 64;  // forward: queries per block x keys per tile
constexpr int kDkvBN = 64, kDkvBM = 32;  // dK/dV: keys per block x queries per tile
constexpr int kDqBM = 64, kDqBN = 64;    // dQ: queries per block x keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct AttnArgs {
  const float* q;
  int64_t ldq;
  const float* kv;
  int64_t ldkv;
  const float* k_rot;
  int64_t ldr;
  const float* d_o;  // backward only
  int64_t ldo;
  const float* lse;    // [H, rows], backward only
  const float* delta;  // [H, rows], backward only
  const int32_t* cu;
  int64_t rows;
  int H, Dn, Dr, Dv;
  int dqp, dvp;  // Dn + Dr and Dv rounded up to a multiple of 16 (the zero-padded shared widths)
  float scale, scale_log2;
};

__device__ __forceinline__ uint16_t to_bf16(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
// Elements [0] and [1] of a bf16 row as one register ([0] in the low half; p is 4-byte aligned).
__device__ __forceinline__ uint32_t ld2(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }

using ptx::quad_max;
using ptx::quad_sum;

// The A fragment of one 16 x 16 chunk of a row-major bf16 tile X (row stride ld): rows 0..15 from
// `x` (X + row0 * ld + k0).
__device__ __forceinline__ void load_a(uint32_t (&af)[4], const uint16_t* x, int ld, int g, int t) {
  const uint16_t* p = x + g * ld + 2 * t;
  af[0] = ld2(p);
  af[1] = ld2(p + 8 * ld);
  af[2] = ld2(p + 8);
  af[3] = ld2(p + 8 * ld + 8);
}
// c += A · B for the n-tile whose 8 B columns are rows 0..7 of `y` (Y + n0 * ld + k0; k fastest).
__device__ __forceinline__ void mma_ab(float (&c)[4], const uint32_t (&af)[4], const uint16_t* y, int ld, int g,
                                       int t) {
  const uint16_t* p = y + g * ld + 2 * t;
  ptx::mma_bf16_16816(c, af, ld2(p), ld2(p + 8));
}
// The A fragment of the 16-column chunk made of accumulator n-tiles c0 and c1, rounded to bf16.
__device__ __forceinline__ void acc_to_a(uint32_t (&af)[4], const float (&c0)[4], const float (&c1)[4]) {
  af[0] = ptx::pack_bf16x2(c0[0], c0[1]);
  af[1] = ptx::pack_bf16x2(c0[2], c0[3]);
  af[2] = ptx::pack_bf16x2(c1[0], c1[1]);
  af[3] = ptx::pack_bf16x2(c1[2], c1[3]);
}

// A bf16 tile of nrows x wpad values from fp32 rows: value (r, c) = a[r*lda + c] for c < wa,
// b[r*ldb + c - wa] for wa <= c < wa + wb, and 0 for c >= wa + wb or r >= valid (nothing is read
// for them). Stored row-major dst[r*ld + c] when dst is given, and transposed dstT[c*ldT + r] when
// dstT is given (both from one read of the value).
__device__ __forceinline__ void load_tile(uint16_t* dst, int ld, uint16_t* dstT, int ldT, int nrows, int wpad,
                                          int valid, const float* a, int64_t lda, int wa, const float* b, int64_t ldb,
                                          int wb) {
  const int w = wa + wb;
  for (int idx = threadIdx.x; idx < nrows * wpad; idx += kThreads) {
    const int r = idx / wpad, c = idx - r * wpad;
    float x = 0.0f;
    if (r < valid && c < w) x = c < wa ? a[r * lda + c] : b[r * ldb + (c - wa)];
    const uint16_t y = to_bf16(x);
    if (dst) dst[r * ld + c] = y;
    if (dstT) dstT[c * ldT + r] = y;
  }
}

// Tiles of rows [r0, r0 + n) of the sequence starting at global row `base` (len rows): q | k | v |
// dO of head h, bf16 (row-major into dst and/or transposed into dstT; nullptr: not stored), zero-padded to dqp (q, k) or dvp (v, dO) columns and n rows. Row pointers are
// formed only for rows that exist.
struct Tiles {
  const AttnArgs a;
  int64_t base;
  int len, h;
  __device__ int valid(int r0, int n) const { return max(0, min(n, len - r0)); }
  __device__ int64_t row(int r0) const { return base + min(r0, max(len - 1, 0)); }
  __device__ void q(uint16_t* dst, int ld, uint16_t* dstT, int ldT, int r0, int n) const {
    const int dqk = a.Dn + a.Dr;
    load_tile(dst, ld, dstT, ldT, n, a.dqp, valid(r0, n), a.q + row(r0) * a.ldq + int64_t(h) * dqk, a.ldq, dqk, nullptr,
              0, 0);
  }
  __device__ void k(uint16_t* dst, int ld, uint16_t* dstT, int ldT, int r0, int n) const {
    load_tile(dst, ld, dstT, ldT, n, a.dqp, valid(r0, n), a.kv + row(r0) * a.ldkv + int64_t(h) * (a.Dn + a.Dv), a.ldkv,
              a.Dn, a.k_rot + row(r0) * a.ldr, a.ldr, a.Dr);
  }
  __device__ void v(uint16_t* dst, int ld, uint16_t* dstT, int ldT, int r0, int n) const {
    load_tile(dst, ld, dstT, ldT, n, a.dvp, valid(r0, n), a.kv + row(r0) * a.ldkv + int64_t(h) * (a.Dn + a.Dv) + a.Dn,
              a.ldkv, a.Dv, nullptr, 0, 0);
  }
  __device__ void d_o(uint16_t* dst, int ld, uint16_t* dstT, int ldT, int r0, int n) const {
    load_tile(dst, ld, dstT, ldT, n, a.dvp, valid(r0, n), a.d_o + row(r0) * a.ldo + int64_t(h) * a.Dv, a.ldo, a.Dv,
              nullptr, 0, 0);
  }
  // log2(e)·lse and Delta of rows r0.. (0 past the end: those rows are masked wherever they are used).
  __device__ void stats(float* s_lse2, float* s_delta, int r0, int n) const {
    for (int r = threadIdx.x; r < n; r += kThreads) {
      const bool ok = r0 + r < len;
      const int64_t i = int64_t(h) * a.rows + base + r0 + r;
      s_lse2[r] = ok ? a.lse[i] * kLog2e : 0.0f;
      s_delta[r] = ok ? a.delta[i] : 0.0f;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Forward: block = 64 queries [m0, m0 + 64) of one (sequence, head), warp w owns queries
// m0 + 16w .. + 15; 64-key tiles 0.. up to the causal end min(len, m0 + 64). NV = 8-column n-tiles
// of O held per thread (a bucket >= dvp / 8).

size_t fwd_smem_bytes(int dqp, int dvp) {
  return size_t(kFwdBM * (dqp + 8) + kFwdBN * (dqp + 8) + dvp * (kFwdBN + 8)) * sizeof(uint16_t);
}

template <int NV>
__global__ void __launch_bounds__(kThreads)
    attn_fwd_tc_kernel(const AttnArgs a, float* __restrict__ o, int64_t ldo, float* __restrict__ lse) {
  extern __shared__ float4 smem4[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kFwdBM;  // the heaviest (latest) query blocks first
  if (m0 >= len) return;
  const int LQ = a.dqp + 8, LVt = kFwdBN + 8, nvt = a.dvp / 8;
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem4);  // [64 queries][LQ]
  uint16_t* sK = sQ + kFwdBM * LQ;                    // [64 keys][LQ]
  uint16_t* sVt = sK + kFwdBN * LQ;                   // V transposed: [dvp][LVt]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const Tiles tl{a, base, len, h};
  tl.q(sQ, LQ, nullptr, 0, m0, kFwdBM);

  float acc[NV][4];
#pragma unroll
  for (int j = 0; j < NV; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  // Rows g and g + 8 of the warp: running max (log2 units of the scaled scores) and this thread's
  // partial sum of the probabilities (its 16 columns of every tile; the quad's sum at the end).
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  const int wq0 = m0 + warp * 16;  // the warp's first query
  const int kv_end = min(len, m0 + kFwdBM);
  for (int n0 = 0; n0 < kv_end; n0 += kFwdBN) {
    __syncthreads();  // the previous tile's K and V are no longer read
    tl.k(sK, LQ, nullptr, 0, n0, kFwdBN);
    tl.v(nullptr, 0, sVt, LVt, n0, kFwdBN);
    __syncthreads();
    if (n0 > wq0 + 15 || wq0 >= len) continue;  // every (query, key) of the warp is masked (warp-uniform)

    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    for (int kk = 0; kk < a.dqp; kk += 16) {
      uint32_t af[4];
      load_a(af, sQ + warp * 16 * LQ + kk, LQ, g, t4);
#pragma unroll
      for (int j = 0; j < 8; ++j) mma_ab(s[j], af, sK + j * 8 * LQ + kk, LQ, g, t4);
    }

    // Online softmax; s[j][e] is (query wq0 + g + 8(e/2), key n0 + 8j + 2t4 + e%2). Masked: -inf.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = wq0 + g + 8 * (e >> 1), key = n0 + 8 * j + 2 * t4 + (e & 1);
        const float x = (key <= t && key < len) ? s[j][e] * a.scale_log2 : -INFINITY;
        s[j][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    float m_use[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m_r[r], quad_max(mx[r]));
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: exp2(-inf - 0) = 0
      alpha[r] = exp2f(m_r[r] - m_use[r]);
      m_r[r] = m_new;
      l_r[r] *= alpha[r];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[j][e] - m_use[e >> 1]);
        s[j][e] = p;
        l_r[e >> 1] += p;
      }
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      acc[j][0] *= alpha[0], acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1], acc[j][3] *= alpha[1];
    }

    // O += P V per 16-key chunk c; chunks past the warp's last query have P = 0 and are skipped.
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (n0 + 16 * c > wq0 + 15) continue;
      uint32_t pa[4];
      acc_to_a(pa, s[2 * c], s[2 * c + 1]);
#pragma unroll
      for (int j = 0; j < NV; ++j)
        if (j < nvt) mma_ab(acc[j], pa, sVt + j * 8 * LVt + 16 * c, LVt, g, t4);
    }
  }

  // o = O / l and lse = ln 2 · (m + log2 l) for the rows that exist (l >= 1: its largest term is 2^0).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_r[r]);
    const int t = wq0 + g + 8 * r;
    if (t >= len) continue;
    float* orow = o + (base + t) * ldo + int64_t(h) * a.Dv;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * t4 + e;
        if (col < a.Dv) orow[col] = acc[j][2 * r + e] / l;
      }
    if (t4 == 0) lse[int64_t(h) * a.rows + base + t] = (m_r[r] + log2f(l)) * kLn2;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// delta[h, r] = Σ_c bf16(dO[r, h*Dv + c]) · O[r, h*Dv + c] (dO rounded as the products dP = dO Vᵀ
// see it, so Delta = Σ_s P_ts dP_ts up to the rounding of P and v): one warp per (row, head), lanes
// stride the columns, a double sum reduced by a fixed xor tree, rounded once.
__global__ void __launch_bounds__(256)
    attn_delta_tc_kernel(float* __restrict__ delta, const float* __restrict__ d_o, const float* __restrict__ o,
                         int64_t ldo, int64_t rows, int H, int Dv) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows * H) return;  // the whole warp leaves together
  const int64_t r = w / H;
  const int h = int(w - r * H);
  const float* x = d_o + r * ldo + int64_t(h) * Dv;
  const float* y = o + r * ldo + int64_t(h) * Dv;
  double acc = 0.0;
  for (int c = lane; c < Dv; c += 32) acc = fma(double(round_bf16(x[c])), double(y[c]), acc);
  acc = rowwise::warp_sum(acc);
  if (lane == 0) delta[int64_t(h) * rows + r] = float(acc);
}

size_t dkv_smem_bytes(int dqp, int dvp) {
  return 2 * kDkvBM * sizeof(float) + size_t(kDkvBN * (dqp + 8) + kDkvBN * (dvp + 8) + kDkvBM * (dqp + 8) +
                                             dqp * (kDkvBM + 8) + kDkvBM * (dvp + 8) + dvp * (kDkvBM + 8)) *
                                          sizeof(uint16_t);
}

// dK and dV of the keys [n0, n0 + 64) of one (sequence, head), warp w owning keys n0 + 16w .. + 15:
// loops over the 32-query tiles from the one holding key n0 to the sequence's end. Per tile, with
// keys s as rows and queries t as columns: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (fp32 accumulators), then
// Pᵀ_st = exp(scale·Sᵀ_st - lse_t), dSᵀ_st = Pᵀ_st (dPᵀ_st - Delta_t), masked to s <= t < len by
// selection; dV += bf16(Pᵀ) dO and dK += bf16(dSᵀ) Q (Q and dO also stored transposed for those B
// operands). dK is scaled once at the end; its rot columns go to the per-head scratch dk_rot_h.
// NQ, NV: 8-column n-tiles of dK and dV per thread (buckets >= dqp / 8, dvp / 8).
template <int NQ, int NV>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dkv_tc_kernel(const AttnArgs a, float* __restrict__ dkv, int64_t lddkv, float* __restrict__ dk_rot_h) {
  extern __shared__ float4 smem4[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int n0 = blockIdx.x * kDkvBN;  // the heaviest (earliest) key blocks first
  if (n0 >= len) return;
  const int dqk = a.Dn + a.Dr, LQ = a.dqp + 8, LV = a.dvp + 8, LT = kDkvBM + 8;
  const int nqt = a.dqp / 8, nvt = a.dvp / 8;
  float* sL = reinterpret_cast<float*>(smem4);              // [32] log2(e)·lse
  float* sD = sL + kDkvBM;                                  // [32] Delta
  uint16_t* sK = reinterpret_cast<uint16_t*>(sD + kDkvBM);  // [64 keys][LQ]
  uint16_t* sV = sK + kDkvBN * LQ;                          // [64 keys][LV]
  uint16_t* sQ = sV + kDkvBN * LV;                          // [32 queries][LQ]
  uint16_t* sQt = sQ + kDkvBM * LQ;                         // Q transposed: [dqp][LT]
  uint16_t* sdO = sQt + a.dqp * LT;                         // [32 queries][LV]
  uint16_t* sdOt = sdO + kDkvBM * LV;                       // dO transposed: [dvp][LT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const Tiles tl{a, base, len, h};
  tl.k(sK, LQ, nullptr, 0, n0, kDkvBN);
  tl.v(sV, LV, nullptr, 0, n0, kDkvBN);

  float dk[NQ][4], dv[NV][4];
#pragma unroll
  for (int j = 0; j < NQ; ++j) dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j) dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.0f;
  const int wk0 = n0 + warp * 16;  // the warp's first key

  for (int m0 = n0 / kDkvBM * kDkvBM; m0 < len; m0 += kDkvBM) {
    __syncthreads();  // the previous tile's Q, dO and statistics are no longer read
    tl.q(sQ, LQ, sQt, LT, m0, kDkvBM);
    tl.d_o(sdO, LV, sdOt, LT, m0, kDkvBM);
    tl.stats(sL, sD, m0, kDkvBM);
    __syncthreads();
    if (wk0 >= len || m0 + kDkvBM - 1 < wk0) continue;  // no key, or every query precedes the warp's keys

    float st[4][4], dpt[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
    for (int kk = 0; kk < a.dqp; kk += 16) {
      uint32_t af[4];
      load_a(af, sK + warp * 16 * LQ + kk, LQ, g, t4);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_ab(st[j], af, sQ + j * 8 * LQ + kk, LQ, g, t4);
    }
    for (int kk = 0; kk < a.dvp; kk += 16) {
      uint32_t af[4];
      load_a(af, sV + warp * 16 * LV + kk, LV, g, t4);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_ab(dpt[j], af, sdO + j * 8 * LV + kk, LV, g, t4);
    }
    // st[j][e] is (key wk0 + g + 8(e/2), query m0 + 8j + 2t4 + e%2): Pᵀ into st, dSᵀ into dpt.
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = wk0 + g + 8 * (e >> 1), qi = 8 * j + 2 * t4 + (e & 1), t = m0 + qi;
        const bool seen = key <= t && t < len;
        const float p = seen ? exp2f(st[j][e] * a.scale_log2 - sL[qi]) : 0.0f;
        dpt[j][e] = seen ? p * (dpt[j][e] - sD[qi]) : 0.0f;
        st[j][e] = p;
      }
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      uint32_t pa[4], da[4];
      acc_to_a(pa, st[2 * c], st[2 * c + 1]);
      acc_to_a(da, dpt[2 * c], dpt[2 * c + 1]);
#pragma unroll
      for (int j = 0; j < NV; ++j)
        if (j < nvt) mma_ab(dv[j], pa, sdOt + j * 8 * LT + 16 * c, LT, g, t4);
#pragma unroll
      for (int j = 0; j < NQ; ++j)
        if (j < nqt) mma_ab(dk[j], da, sQt + j * 8 * LT + 16 * c, LT, g, t4);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wk0 + g + 8 * r;
    if (key >= len) continue;
    const int64_t row = base + key;
    float* dkn = dkv + row * lddkv + int64_t(h) * (a.Dn + a.Dv);
    float* dkr = dk_rot_h + (int64_t(h) * a.rows + row) * a.Dr;
#pragma unroll
    for (int j = 0; j < NQ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * t4 + e;
        if (col < a.Dn) dkn[col] = dk[j][2 * r + e] * a.scale;
        else if (col < dqk) dkr[col - a.Dn] = dk[j][2 * r + e] * a.scale;
      }
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * t4 + e;
        if (col < a.Dv) dkn[a.Dn + col] = dv[j][2 * r + e];
      }
  }
}

size_t dq_smem_bytes(int dqp, int dvp) {
  return 2 * kDqBM * sizeof(float) +
         size_t(kDqBM * (dqp + 8) + kDqBM * (dvp + 8) + kDqBN * (dqp + 8) + kDqBN * (dvp + 8) + dqp * (kDqBN + 8)) *
             sizeof(uint16_t);
}

// dQ of the queries [m0, m0 + 64) of one (sequence, head), warp w owning queries m0 + 16w .. + 15:
// loops over the 64-key tiles up to the causal end. S = Q Kᵀ, dP = dO Vᵀ, dS as in the dK/dV
// kernel, then dQ += bf16(dS) K (K also stored transposed for that B operand), scaled at the end.
// NQ: 8-column n-tiles of dQ per thread (a bucket >= dqp / 8).
template <int NQ>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dq_tc_kernel(const AttnArgs a, float* __restrict__ dq, int64_t lddq) {
  extern __shared__ float4 smem4[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kDqBM;  // the heaviest (latest) query blocks first
  if (m0 >= len) return;
  const int dqk = a.Dn + a.Dr, LQ = a.dqp + 8, LV = a.dvp + 8, LT = kDqBN + 8, nqt = a.dqp / 8;
  float* sL = reinterpret_cast<float*>(smem4);             // [64] log2(e)·lse
  float* sD = sL + kDqBM;                                  // [64] Delta
  uint16_t* sQ = reinterpret_cast<uint16_t*>(sD + kDqBM);  // [64 queries][LQ]
  uint16_t* sdO = sQ + kDqBM * LQ;                         // [64 queries][LV]
  uint16_t* sK = sdO + kDqBM * LV;                         // [64 keys][LQ]
  uint16_t* sV = sK + kDqBN * LQ;                          // [64 keys][LV]
  uint16_t* sKt = sV + kDqBN * LV;                         // K transposed: [dqp][LT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const Tiles tl{a, base, len, h};
  tl.q(sQ, LQ, nullptr, 0, m0, kDqBM);
  tl.d_o(sdO, LV, nullptr, 0, m0, kDqBM);
  tl.stats(sL, sD, m0, kDqBM);

  float acc[NQ][4];
#pragma unroll
  for (int j = 0; j < NQ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
  const int wq0 = m0 + warp * 16;  // the warp's first query
  const int kv_end = min(len, m0 + kDqBM);
  for (int n0 = 0; n0 < kv_end; n0 += kDqBN) {
    __syncthreads();  // the previous tile's K, V are no longer read
    tl.k(sK, LQ, sKt, LT, n0, kDqBN);
    tl.v(sV, LV, nullptr, 0, n0, kDqBN);
    __syncthreads();
    if (n0 > wq0 + 15 || wq0 >= len) continue;  // every (query, key) of the warp is masked (warp-uniform)

    float s[8][4], dp[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.0f;
    for (int kk = 0; kk < a.dqp; kk += 16) {
      uint32_t af[4];
      load_a(af, sQ + warp * 16 * LQ + kk, LQ, g, t4);
#pragma unroll
      for (int j = 0; j < 8; ++j) mma_ab(s[j], af, sK + j * 8 * LQ + kk, LQ, g, t4);
    }
    for (int kk = 0; kk < a.dvp; kk += 16) {
      uint32_t af[4];
      load_a(af, sdO + warp * 16 * LV + kk, LV, g, t4);
#pragma unroll
      for (int j = 0; j < 8; ++j) mma_ab(dp[j], af, sV + j * 8 * LV + kk, LV, g, t4);
    }
    // s[j][e] is (query wq0 + g + 8(e/2), key n0 + 8j + 2t4 + e%2): dS into s.
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = warp * 16 + g + 8 * (e >> 1), t = m0 + qi, key = n0 + 8 * j + 2 * t4 + (e & 1);
        const bool seen = key <= t && t < len;
        const float p = seen ? exp2f(s[j][e] * a.scale_log2 - sL[qi]) : 0.0f;
        s[j][e] = seen ? p * (dp[j][e] - sD[qi]) : 0.0f;
      }
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (n0 + 16 * c > wq0 + 15) continue;  // keys past the warp's last query: dS = 0
      uint32_t da[4];
      acc_to_a(da, s[2 * c], s[2 * c + 1]);
#pragma unroll
      for (int j = 0; j < NQ; ++j)
        if (j < nqt) mma_ab(acc[j], da, sKt + j * 8 * LT + 16 * c, LT, g, t4);
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = wq0 + g + 8 * r;
    if (t >= len) continue;
    float* drow = dq + (base + t) * lddq + int64_t(h) * dqk;
#pragma unroll
    for (int j = 0; j < NQ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * t4 + e;
        if (col < dqk) drow[col] = acc[j][2 * r + e] * a.scale;
      }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// 8-column n-tiles per thread for a padded width w <= 256: buckets 8 (<= 64), 16 (<= 128), 24 (<= 192), 32.
int tiles_bucket(int w) { return w <= 64 ? 8 : w <= 128 ? 16 : w <= 192 ? 24 : 32; }

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, size_t smem, Args... args) {
  kernel<<<grid, kThreads, smem>>>(args...);
  K3_CUDA_LAUNCH_CHECK();
}

template <int NV>
void launch_fwd(const AttnArgs& a, float* o, int64_t ldo, float* lse, int B, int64_t max_len) {
  static size_t allowed = 0;
  const size_t smem = fwd_smem_bytes(a.dqp, a.dvp);
  allow_smem(attn_fwd_tc_kernel<NV>, smem, allowed);
  const dim3 grid(unsigned((max_len + kFwdBM - 1) / kFwdBM), unsigned(a.H), unsigned(B));
  launch(attn_fwd_tc_kernel<NV>, grid, smem, a, o, ldo, lse);
}

template <int NQ, int NV>
void launch_dkv(const AttnArgs& a, float* dkv, int64_t lddkv, float* dk_rot_h, int B, int64_t max_len) {
  static size_t allowed = 0;
  const size_t smem = dkv_smem_bytes(a.dqp, a.dvp);
  allow_smem(attn_bwd_dkv_tc_kernel<NQ, NV>, smem, allowed);
  const dim3 grid(unsigned((max_len + kDkvBN - 1) / kDkvBN), unsigned(a.H), unsigned(B));
  launch(attn_bwd_dkv_tc_kernel<NQ, NV>, grid, smem, a, dkv, lddkv, dk_rot_h);
}

template <int NQ>
void launch_dq(const AttnArgs& a, float* dq, int64_t lddq, int B, int64_t max_len) {
  static size_t allowed = 0;
  const size_t smem = dq_smem_bytes(a.dqp, a.dvp);
  allow_smem(attn_bwd_dq_tc_kernel<NQ>, smem, allowed);
  const dim3 grid(unsigned((max_len + kDqBM - 1) / kDqBM), unsigned(a.H), unsigned(B));
  launch(attn_bwd_dq_tc_kernel<NQ>, grid, smem, a, dq, lddq);
}

template <int NQ>
void dispatch_bwd(const AttnArgs& a, float* dq, int64_t lddq, float* dkv, int64_t lddkv, float* dk_rot_h, int B,
                  int64_t max_len) {
  switch (tiles_bucket(a.dvp)) {
    case 8: launch_dkv<NQ, 8>(a, dkv, lddkv, dk_rot_h, B, max_len); break;
    case 16: launch_dkv<NQ, 16>(a, dkv, lddkv, dk_rot_h, B, max_len); break;
    case 24: launch_dkv<NQ, 24>(a, dkv, lddkv, dk_rot_h, B, max_len); break;
    default: launch_dkv<NQ, 32>(a, dkv, lddkv, dk_rot_h, B, max_len); break;
  }
  launch_dq<NQ>(a, dq, lddq, B, max_len);
}

AttnArgs make_args(const float* q, int64_t ldq, const float* kv, int64_t ldkv, const float* k_rot, int64_t ldr,
                   const int32_t* cu_seqlens, int64_t rows, const Dims& d, float scale) {
  AttnArgs a{};
  a.q = q, a.ldq = ldq, a.kv = kv, a.ldkv = ldkv, a.k_rot = k_rot, a.ldr = ldr;
  a.cu = cu_seqlens, a.rows = rows;
  a.H = int(d.H), a.Dn = int(d.Dn), a.Dr = int(d.Dr), a.Dv = int(d.Dv);
  a.dqp = (a.Dn + a.Dr + 15) / 16 * 16, a.dvp = (a.Dv + 15) / 16 * 16;
  a.scale = scale, a.scale_log2 = scale * kLog2e;
  return a;
}

}  // namespace

void attention_forward_train_bf16(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq, const float* kv,
                                  int64_t ldkv, const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int B,
                                  int64_t max_len, int64_t rows, const Dims& d, float scale) {
  constexpr const char* fn = "mla::cuda::attention_forward_train_bf16";
  check_attention(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale);
  K3_CHECK(ldo >= d.H * d.Dv, fn, ": ldo = ", ldo, " < H*Dv = ", d.H * d.Dv);
  if (rows == 0 || B == 0) return;
  K3_CHECK(o && lse && q && kv && cu_seqlens && (k_rot || d.Dr == 0), fn, ": null device pointer");
  const AttnArgs a = make_args(q, ldq, kv, ldkv, k_rot, ldr, cu_seqlens, rows, d, scale);
  switch (tiles_bucket(a.dvp)) {
    case 8: return launch_fwd<8>(a, o, ldo, lse, B, max_len);
    case 16: return launch_fwd<16>(a, o, ldo, lse, B, max_len);
    case 24: return launch_fwd<24>(a, o, ldo, lse, B, max_len);
    default: return launch_fwd<32>(a, o, ldo, lse, B, max_len);
  }
}

size_t attention_backward_workspace_bytes_bf16(int64_t rows, const Dims& d) {
  return train_common::backward_workspace_bytes("mla::cuda::attention_backward_workspace_bytes_bf16", rows, d);
}

void attention_backward_train_bf16(float* dq, int64_t lddq, float* dkv, int64_t lddkv, float* dk_rot, int64_t lddr,
                                   const float* d_o, int64_t ldo, const float* o, const float* q, int64_t ldq,
                                   const float* kv, int64_t ldkv, const float* k_rot, int64_t ldr, const float* lse,
                                   const int32_t* cu_seqlens, int B, int64_t max_len, int64_t rows, const Dims& d,
                                   float scale, void* workspace) {
  constexpr const char* fn = "mla::cuda::attention_backward_train_bf16";
  check_backward(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale, ldo, lddq, lddkv, lddr);
  if (rows == 0 || B == 0) return;
  K3_CHECK(dq && dkv && d_o && o && q && kv && lse && cu_seqlens && (d.Dr == 0 || (k_rot && dk_rot)), fn,
           ": null device pointer");
  K3_CHECK(workspace, fn, ": workspace is null (attention_backward_workspace_bytes_bf16 = ",
           attention_backward_workspace_bytes_bf16(rows, d), " bytes)");
  float* delta = static_cast<float*>(workspace);
  float* dk_rot_h = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(rows, d));

  const int64_t warps = rows * d.H;
  const int64_t blocks = (warps * 32 + 255) / 256;
  K3_CHECK(blocks <= INT32_MAX, fn, ": rows*H = ", warps, " is too large");
  attn_delta_tc_kernel<<<unsigned(blocks), 256>>>(delta, d_o, o, ldo, rows, int(d.H), int(d.Dv));
  K3_CUDA_LAUNCH_CHECK();

  AttnArgs a = make_args(q, ldq, kv, ldkv, k_rot, ldr, cu_seqlens, rows, d, scale);
  a.d_o = d_o, a.ldo = ldo, a.lse = lse, a.delta = delta;
  switch (tiles_bucket(a.dqp)) {
    case 8: dispatch_bwd<8>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
    case 16: dispatch_bwd<16>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
    case 24: dispatch_bwd<24>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
    default: dispatch_bwd<32>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
  }
  if (d.Dr > 0) {
    const int64_t n = rows * d.Dr;
    const unsigned grid = unsigned(std::min<int64_t>((n + 255) / 256, 65535));
    train_common::dk_rot_sum(grid, dk_rot, lddr, dk_rot_h, rows, int(d.H), int(d.Dr));
  }
}

}  // namespace k3::mla::cuda
