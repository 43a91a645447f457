// The training MLA attention core and output gate on the GPU, fp32 (mla_train_cuda.h: the design and
// the numerics). The CPU twins are in mla_f64.cpp.
//
// Thread geometry shared by every attention kernel: 256 threads as a 16 x 16 grid, ty = tid / 16,
// tx = tid % 16; in every product the thread owns rows ty + 16i and columns tx + 16j. Lanes 0-15 and
// 16-31 of a warp are two values of ty, so the 16 owners of one row are one half-warp: row maxima and
// sums are xor-shuffles over offsets 8, 4, 2, 1 (every lane ends with the same bits, since a + b ==
// b + a exactly), and a P row written by its half-warp is read back after __syncwarp alone.
// Shared tiles are row-major with an odd row stride (D | 1): the reads K[tx + 16j][c] of a half-warp
// fall in 16 distinct banks, the reads Q[ty + 16i][c] are two broadcasts.
#include <cmath>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/mla/mla_train_common.cuh"
#include "kernels/mla/mla_train_cuda.h"

namespace k3::mla::cuda {

namespace {

using train_common::allow_smem;
using train_common::check_attention;
using train_common::check_backward;
using train_common::delta_bytes;

constexpr int kThreads = 256;
constexpr int kFwdBM = 64, kFwdBN = 64;  // forward: queries per block x keys per tile
constexpr int kBwdOuter = 32;            // backward: rows (keys for dK/dV, queries for dQ) per block
constexpr int kBwdInner = 64;            // backward: rows of the streamed tiles

struct AttnArgs {
  const float* q;
  int64_t ldq;
  const float* kv;
  int64_t ldkv;
  const float* k_rot;
  int64_t ldr;
  const float* d_o;  // backward only
  int64_t ldo;
  const float* lse;    // [H, rows]: read by the backward, written by the forward (through out_lse)
  const float* delta;  // [H, rows], backward only
  const int32_t* cu;
  int64_t rows;
  int H, Dn, Dr, Dv;
  float scale;
  bool causal;  // key s seen by query t when s <= t; else every key of the sequence
};

__device__ __forceinline__ float halfwarp_max(float x) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float halfwarp_sum(float x) {
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// dst[r][c] (row stride ld) for r < nrows, c < wa + wb: columns [0, wa) from a[r*lda + c], columns
// [wa, wa + wb) from b[r*ldb + c - wa]; rows r >= valid are zero (nothing is read for them).
__device__ __forceinline__ void load_tile(float* dst, int ld, int nrows, int valid, const float* a, int64_t lda, int wa,
                                          const float* b, int64_t ldb, int wb) {
  const int w = wa + wb;
  for (int idx = threadIdx.x; idx < nrows * w; idx += kThreads) {
    const int r = idx / w, c = idx - r * w;
    float x = 0.0f;
    if (r < valid) x = c < wa ? a[r * lda + c] : b[r * ldb + (c - wa)];
    dst[r * ld + c] = x;
  }
}

// Tiles of rows [r0, r0 + n) of sequence rows starting at global row `base` (len rows): q | k | v | dO
// of head h. Row pointers are formed only for rows that exist.
struct Tiles {
  const AttnArgs a;
  int64_t base;
  int len, h, dqk;
  __device__ int valid(int r0, int n) const { return max(0, min(n, len - r0)); }
  __device__ int64_t row(int r0) const { return base + min(r0, max(len - 1, 0)); }
  __device__ void q(float* dst, int ld, int r0, int n) const {
    load_tile(dst, ld, n, valid(r0, n), a.q + row(r0) * a.ldq + int64_t(h) * dqk, a.ldq, dqk, nullptr, 0, 0);
  }
  __device__ void k(float* dst, int ld, int r0, int n) const {
    load_tile(dst, ld, n, valid(r0, n), a.kv + row(r0) * a.ldkv + int64_t(h) * (a.Dn + a.Dv), a.ldkv, a.Dn,
              a.k_rot + row(r0) * a.ldr, a.ldr, a.Dr);
  }
  __device__ void v(float* dst, int ld, int r0, int n) const {
    load_tile(dst, ld, n, valid(r0, n), a.kv + row(r0) * a.ldkv + int64_t(h) * (a.Dn + a.Dv) + a.Dn, a.ldkv, a.Dv,
              nullptr, 0, 0);
  }
  __device__ void d_o(float* dst, int ld, int r0, int n) const {
    load_tile(dst, ld, n, valid(r0, n), a.d_o + row(r0) * a.ldo + int64_t(h) * a.Dv, a.ldo, a.Dv, nullptr, 0, 0);
  }
  // lse and Delta of rows r0.. (0 past the end: those rows are masked wherever they are used).
  __device__ void stats(float* s_lse, float* s_delta, int r0, int n) const {
    for (int r = threadIdx.x; r < n; r += kThreads) {
      const bool ok = r0 + r < len;
      const int64_t i = int64_t(h) * a.rows + base + r0 + r;
      s_lse[r] = ok ? a.lse[i] : 0.0f;
      s_delta[r] = ok ? a.delta[i] : 0.0f;
    }
  }
};

// acc[i][j] += Σ_{c < K} A[(ty + 16i)*lda + c] · B[(tx + 16j)*ldb + c]: a [16 RI x 16 CJ] block of
// A Bᵀ over rows of both tiles, c ascending.
template <int RI, int CJ>
__device__ __forceinline__ void mma_abt(float (&acc)[RI][CJ], const float* A, int lda, const float* B, int ldb, int K,
                                        int ty, int tx) {
  for (int c = 0; c < K; ++c) {
    float x[RI], y[CJ];
#pragma unroll
    for (int i = 0; i < RI; ++i) x[i] = A[(ty + 16 * i) * lda + c];
#pragma unroll
    for (int j = 0; j < CJ; ++j) y[j] = B[(tx + 16 * j) * ldb + c];
#pragma unroll
    for (int i = 0; i < RI; ++i)
#pragma unroll
      for (int j = 0; j < CJ; ++j) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: block = 64 queries [m0, m0 + 64) of one (sequence, head); 64-key tiles 0.. up to the causal
// end min(len, m0 + 64). CV = column blocks of 16 for O (ceil(Dv / 16) rounded up to a bucket).

size_t fwd_smem_bytes(int dqk, int dv) {
  return size_t(kFwdBM * (dqk | 1) + kFwdBN * (dqk | 1) + kFwdBN * (dv | 1) + kFwdBM * (kFwdBN + 1)) * sizeof(float);
}

template <int CV>
__global__ void __launch_bounds__(kThreads)
    attn_fwd_kernel(const AttnArgs a, float* __restrict__ o, int64_t ldo, float* __restrict__ lse) {
  extern __shared__ float smem[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kFwdBM;  // the heaviest (latest) query blocks first
  if (m0 >= len) return;
  const int dqk = a.Dn + a.Dr, dv = a.Dv, LQ = dqk | 1, LV = dv | 1, LP = kFwdBN + 1;
  float* sQ = smem;
  float* sK = sQ + kFwdBM * LQ;
  float* sV = sK + kFwdBN * LQ;
  float* sP = sV + kFwdBN * LV;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const Tiles tl{a, base, len, h, dqk};
  tl.q(sQ, LQ, m0, kFwdBM);

  float acc[4][CV];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < CV; ++j) acc[i][j] = 0.0f;
  float m_r[4], l_r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m_r[i] = -INFINITY, l_r[i] = 0.0f;

  const int kv_end = a.causal ? min(len, m0 + kFwdBM) : len;
  for (int n0 = 0; n0 < kv_end; n0 += kFwdBN) {
    __syncthreads();  // the previous tile's K, V and P are no longer read
    tl.k(sK, LQ, n0, kFwdBN);
    tl.v(sV, LV, n0, kFwdBN);
    __syncthreads();

    float s[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
    mma_abt<4, 4>(s, sQ, LQ, sK, LQ, dqk, ty, tx);

    // Online softmax of rows ty + 16i over this tile's keys tx + 16j; masked scores are -inf by selection.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int t = m0 + ty + 16 * i;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = n0 + tx + 16 * j;
        const float x = ((key <= t || !a.causal) && key < len) ? s[i][j] * a.scale : -INFINITY;
        s[i][j] = x;
        mx = fmaxf(mx, x);
      }
      mx = halfwarp_max(mx);
      const float m_new = fmaxf(m_r[i], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: exp(-inf - 0) = 0
      const float alpha = expf(m_r[i] - m_use);
      m_r[i] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p = expf(s[i][j] - m_use);
        sP[(ty + 16 * i) * LP + tx + 16 * j] = p;
        sum += p;
      }
      l_r[i] = l_r[i] * alpha + halfwarp_sum(sum);
#pragma unroll
      for (int j = 0; j < CV; ++j) acc[i][j] *= alpha;
    }
    __syncwarp();  // P rows ty + 16i were written by this half-warp only

    // O += P V over the keys of the tile that any row here can see (later ones have p = 0).
    const int n_keys = min(kFwdBN, kv_end - n0);
    for (int n = 0; n < n_keys; ++n) {
      float p[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] = sP[(ty + 16 * i) * LP + n];
#pragma unroll
      for (int j = 0; j < CV; ++j) {
        const int col = tx + 16 * j;
        if (col < dv) {
          const float v = sV[n * LV + col];
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i][j] = fmaf(p[i], v, acc[i][j]);
        }
      }
    }
  }

  // o = O / l and lse = m + log l for the rows that exist (l >= 1: its largest term is exp(0)).
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = m0 + ty + 16 * i;
    if (t >= len) continue;
    float* orow = o + (base + t) * ldo + int64_t(h) * dv;
#pragma unroll
    for (int j = 0; j < CV; ++j) {
      const int col = tx + 16 * j;
      if (col < dv) orow[col] = acc[i][j] / l_r[i];
    }
    if (tx == 0) lse[int64_t(h) * a.rows + base + t] = m_r[i] + logf(l_r[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// delta[h, r] = Σ_c dO[r, h*Dv + c] · O[r, h*Dv + c]: one warp per (row, head), lanes stride the
// columns, a double sum reduced by a fixed xor tree, rounded once.
__global__ void __launch_bounds__(kThreads)
    attn_delta_kernel(float* __restrict__ delta, const float* __restrict__ d_o, const float* __restrict__ o,
                      int64_t ldo, int64_t rows, int H, int Dv) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows * H) return;  // the whole warp leaves together
  const int64_t r = w / H;
  const int h = int(w - r * H);
  const float* x = d_o + r * ldo + int64_t(h) * Dv;
  const float* y = o + r * ldo + int64_t(h) * Dv;
  double acc = 0.0;
  for (int c = lane; c < Dv; c += 32) acc = fma(double(x[c]), double(y[c]), acc);
  acc = rowwise::warp_sum(acc);
  if (lane == 0) delta[int64_t(h) * rows + r] = float(acc);
}

size_t dkv_smem_bytes(int dqk, int dv) {
  return size_t((kBwdOuter + kBwdInner) * ((dqk | 1) + (dv | 1)) + 2 * kBwdInner * (kBwdOuter + 1) + 2 * kBwdInner) *
         sizeof(float);
}

// dK and dV of the keys [n0, n0 + 32) of one (sequence, head): loops over the 64-query tiles from
// the one holding query n0 to the sequence's end. Per tile, for queries t (rows ty + 16i) and keys s
// (columns tx + 16j): P_ts = exp(scale·q_t·k_s - lse_t), dS_ts = P_ts (dO_t·v_s - Delta_t), both
// masked to s <= t < len by selection, then for keys s = ty + 16i and columns c = tx + 16j:
//   dV[s][c] += Σ_t P_ts dO_t[c],   dK[s][c] += Σ_t dS_ts q_t[c]   (t ascending).
// dK is scaled once at the end. Its rot columns go to the per-head scratch dk_rot_h [H, rows, Dr].
template <int CQ, int CV>
__global__ void __launch_bounds__(kThreads)
    attn_bwd_dkv_kernel(const AttnArgs a, float* __restrict__ dkv, int64_t lddkv, float* __restrict__ dk_rot_h) {
  extern __shared__ float smem[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int n0 = blockIdx.x * kBwdOuter;  // the heaviest (earliest) key blocks first
  if (n0 >= len) return;
  const int dqk = a.Dn + a.Dr, dv = a.Dv, LQ = dqk | 1, LV = dv | 1, LP = kBwdOuter + 1;
  float* sK = smem;
  float* sV = sK + kBwdOuter * LQ;
  float* sQ = sV + kBwdOuter * LV;
  float* sdO = sQ + kBwdInner * LQ;
  float* sP = sdO + kBwdInner * LV;
  float* sdS = sP + kBwdInner * LP;
  float* sL = sdS + kBwdInner * LP;
  float* sD = sL + kBwdInner;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const Tiles tl{a, base, len, h, dqk};
  tl.k(sK, LQ, n0, kBwdOuter);
  tl.v(sV, LV, n0, kBwdOuter);

  float dk[2][CQ], dvv[2][CV];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < CQ; ++j) dk[i][j] = 0.0f;
#pragma unroll
    for (int j = 0; j < CV; ++j) dvv[i][j] = 0.0f;
  }

  for (int m0 = a.causal ? n0 / kBwdInner * kBwdInner : 0; m0 < len; m0 += kBwdInner) {
    __syncthreads();  // the previous tile's Q, dO, P, dS are no longer read
    tl.q(sQ, LQ, m0, kBwdInner);
    tl.d_o(sdO, LV, m0, kBwdInner);
    tl.stats(sL, sD, m0, kBwdInner);
    __syncthreads();

    float s[4][2], dp[4][2];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) s[i][j] = dp[i][j] = 0.0f;
    mma_abt<4, 2>(s, sQ, LQ, sK, LQ, dqk, ty, tx);
    mma_abt<4, 2>(dp, sdO, LV, sV, LV, dv, ty, tx);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = ty + 16 * i, t = m0 + r;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = tx + 16 * j, key = n0 + c;
        const bool seen = (key <= t || !a.causal) && key < len && t < len;
        const float p = seen ? expf(s[i][j] * a.scale - sL[r]) : 0.0f;
        sP[r * LP + c] = p;
        sdS[r * LP + c] = seen ? p * (dp[i][j] - sD[r]) : 0.0f;
      }
    }
    __syncthreads();

    const int n_q = min(kBwdInner, len - m0);  // later rows have P = dS = 0
    for (int t = 0; t < n_q; ++t) {
      float p[2], ds[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        p[i] = sP[t * LP + ty + 16 * i];
        ds[i] = sdS[t * LP + ty + 16 * i];
      }
#pragma unroll
      for (int j = 0; j < CV; ++j) {
        const int col = tx + 16 * j;
        if (col < dv) {
          const float x = sdO[t * LV + col];
#pragma unroll
          for (int i = 0; i < 2; ++i) dvv[i][j] = fmaf(p[i], x, dvv[i][j]);
        }
      }
#pragma unroll
      for (int j = 0; j < CQ; ++j) {
        const int col = tx + 16 * j;
        if (col < dqk) {
          const float x = sQ[t * LQ + col];
#pragma unroll
          for (int i = 0; i < 2; ++i) dk[i][j] = fmaf(ds[i], x, dk[i][j]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int key = n0 + ty + 16 * i;
    if (key >= len) continue;
    const int64_t row = base + key;
    float* dkn = dkv + row * lddkv + int64_t(h) * (a.Dn + dv);
    float* dkr = dk_rot_h + (int64_t(h) * a.rows + row) * a.Dr;
#pragma unroll
    for (int j = 0; j < CQ; ++j) {
      const int col = tx + 16 * j;
      if (col < a.Dn) dkn[col] = dk[i][j] * a.scale;
      else if (col < dqk) dkr[col - a.Dn] = dk[i][j] * a.scale;
    }
#pragma unroll
    for (int j = 0; j < CV; ++j) {
      const int col = tx + 16 * j;
      if (col < dv) dkn[a.Dn + col] = dvv[i][j];
    }
  }
}

size_t dq_smem_bytes(int dqk, int dv) {
  return size_t((kBwdOuter + kBwdInner) * ((dqk | 1) + (dv | 1)) + kBwdOuter * (kBwdInner + 1) + 2 * kBwdOuter) *
         sizeof(float);
}

// dQ of the queries [m0, m0 + 32) of one (sequence, head): loops over the 64-key tiles up to the
// causal end. dS as in the dK/dV kernel, then for queries t = ty + 16i and columns c = tx + 16j:
//   dQ[t][c] += Σ_s dS_ts k_s[c]   (s ascending), scaled once at the end.
template <int CQ>
__global__ void __launch_bounds__(kThreads) attn_bwd_dq_kernel(const AttnArgs a, float* __restrict__ dq, int64_t lddq) {
  extern __shared__ float smem[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kBwdOuter;  // the heaviest (latest) query blocks first
  if (m0 >= len) return;
  const int dqk = a.Dn + a.Dr, dv = a.Dv, LQ = dqk | 1, LV = dv | 1, LS = kBwdInner + 1;
  float* sQ = smem;
  float* sdO = sQ + kBwdOuter * LQ;
  float* sK = sdO + kBwdOuter * LV;
  float* sV = sK + kBwdInner * LQ;
  float* sdS = sV + kBwdInner * LV;
  float* sL = sdS + kBwdOuter * LS;
  float* sD = sL + kBwdOuter;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const Tiles tl{a, base, len, h, dqk};
  tl.q(sQ, LQ, m0, kBwdOuter);
  tl.d_o(sdO, LV, m0, kBwdOuter);
  tl.stats(sL, sD, m0, kBwdOuter);

  float acc[2][CQ];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < CQ; ++j) acc[i][j] = 0.0f;

  const int kv_end = a.causal ? min(len, m0 + kBwdOuter) : len;
  for (int n0 = 0; n0 < kv_end; n0 += kBwdInner) {
    __syncthreads();  // the previous tile's K and dS are no longer read
    tl.k(sK, LQ, n0, kBwdInner);
    tl.v(sV, LV, n0, kBwdInner);
    __syncthreads();

    float s[2][4], dp[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[i][j] = dp[i][j] = 0.0f;
    mma_abt<2, 4>(s, sQ, LQ, sK, LQ, dqk, ty, tx);
    mma_abt<2, 4>(dp, sdO, LV, sV, LV, dv, ty, tx);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = ty + 16 * i, t = m0 + r;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = tx + 16 * j, key = n0 + c;
        const bool seen = (key <= t || !a.causal) && key < len && t < len;
        const float p = seen ? expf(s[i][j] * a.scale - sL[r]) : 0.0f;
        sdS[r * LS + c] = seen ? p * (dp[i][j] - sD[r]) : 0.0f;
      }
    }
    __syncwarp();  // dS rows ty + 16i were written by this half-warp only

    const int n_keys = min(kBwdInner, kv_end - n0);  // later keys have dS = 0 for every row here
    for (int n = 0; n < n_keys; ++n) {
      float ds[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) ds[i] = sdS[(ty + 16 * i) * LS + n];
#pragma unroll
      for (int j = 0; j < CQ; ++j) {
        const int col = tx + 16 * j;
        if (col < dqk) {
          const float x = sK[n * LQ + col];
#pragma unroll
          for (int i = 0; i < 2; ++i) acc[i][j] = fmaf(ds[i], x, acc[i][j]);
        }
      }
    }
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = m0 + ty + 16 * i;
    if (t >= len) continue;
    float* drow = dq + (base + t) * lddq + int64_t(h) * dqk;
#pragma unroll
    for (int j = 0; j < CQ; ++j) {
      const int col = tx + 16 * j;
      if (col < dqk) drow[col] = acc[i][j] * a.scale;
    }
  }
}

// dk_rot[r][c] = Σ_{h = 0..H-1} dk_rot_h[h][r][c], in head order, summed in double, rounded once.
__global__ void __launch_bounds__(kThreads)
    dk_rot_sum_kernel(float* __restrict__ dk_rot, int64_t lddr, const float* __restrict__ dk_rot_h, int64_t rows, int H,
                      int Dr) {
  const int64_t n = rows * Dr;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / Dr;
    const int c = int(i - r * Dr);
    double acc = 0.0;
    for (int h = 0; h < H; ++h) acc += double(dk_rot_h[int64_t(h) * n + i]);
    dk_rot[r * lddr + c] = float(acc);
  }
}

// ---------------------------------------------------------------------------------------------
// The output gate.

__global__ void __launch_bounds__(kThreads)
    gate_fwd_kernel(float* __restrict__ og, float* __restrict__ gate, const float* __restrict__ o, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = rowwise::sigmoid_stable(gate[i]);
    gate[i] = s;
    og[i] = o[i] * s;
  }
}

__global__ void __launch_bounds__(kThreads)
    gate_bwd_kernel(float* __restrict__ d_o, float* __restrict__ dz, const float* __restrict__ dog,
                    const float* __restrict__ o, const float* __restrict__ gate, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float s = gate[i], g = dog[i];
    d_o[i] = g * s;
    dz[i] = g * o[i] * s * (1.0f - s);  // σ' = σ(1 - σ), multiplied left to right as the f64 twin
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Column blocks of 16 per thread for a width w <= 256: buckets 4 (<= 64), 8 (<= 128), 12 (<= 192), 16.
int col_blocks(int64_t w) { return w <= 64 ? 4 : w <= 128 ? 8 : w <= 192 ? 12 : 16; }

template <int CV>
void launch_fwd(const AttnArgs& a, float* o, int64_t ldo, float* lse, int B, int64_t max_len) {
  static size_t allowed = 0;
  const size_t smem = fwd_smem_bytes(a.Dn + a.Dr, a.Dv);
  allow_smem(attn_fwd_kernel<CV>, smem, allowed);
  const dim3 grid(unsigned((max_len + kFwdBM - 1) / kFwdBM), unsigned(a.H), unsigned(B));
  attn_fwd_kernel<CV><<<grid, kThreads, smem>>>(a, o, ldo, lse);
  K3_CUDA_LAUNCH_CHECK();
}

template <int CQ, int CV>
void launch_dkv(const AttnArgs& a, float* dkv, int64_t lddkv, float* dk_rot_h, int B, int64_t max_len) {
  static size_t allowed = 0;
  const size_t smem = dkv_smem_bytes(a.Dn + a.Dr, a.Dv);
  allow_smem(attn_bwd_dkv_kernel<CQ, CV>, smem, allowed);
  const dim3 grid(unsigned((max_len + kBwdOuter - 1) / kBwdOuter), unsigned(a.H), unsigned(B));
  attn_bwd_dkv_kernel<CQ, CV><<<grid, kThreads, smem>>>(a, dkv, lddkv, dk_rot_h);
  K3_CUDA_LAUNCH_CHECK();
}

template <int CQ>
void launch_dq(const AttnArgs& a, float* dq, int64_t lddq, int B, int64_t max_len) {
  static size_t allowed = 0;
  const size_t smem = dq_smem_bytes(a.Dn + a.Dr, a.Dv);
  allow_smem(attn_bwd_dq_kernel<CQ>, smem, allowed);
  const dim3 grid(unsigned((max_len + kBwdOuter - 1) / kBwdOuter), unsigned(a.H), unsigned(B));
  attn_bwd_dq_kernel<CQ><<<grid, kThreads, smem>>>(a, dq, lddq);
  K3_CUDA_LAUNCH_CHECK();
}

template <int CQ>
void dispatch_dkv(const AttnArgs& a, float* dkv, int64_t lddkv, float* dk_rot_h, int B, int64_t max_len) {
  switch (col_blocks(a.Dv)) {
    case 4: return launch_dkv<CQ, 4>(a, dkv, lddkv, dk_rot_h, B, max_len);
    case 8: return launch_dkv<CQ, 8>(a, dkv, lddkv, dk_rot_h, B, max_len);
    default: return launch_dkv<CQ, 16>(a, dkv, lddkv, dk_rot_h, B, max_len);  // 12 and 16: one bucket for Dv
  }
}

}  // namespace

namespace train_common {

static_assert(kThreads == 256, "dk_rot_sum launches 256 threads a block");
void dk_rot_sum(unsigned grid, float* dk_rot, int64_t lddr, const float* dk_rot_h, int64_t rows, int H, int Dr) {
  dk_rot_sum_kernel<<<grid, kThreads>>>(dk_rot, lddr, dk_rot_h, rows, H, Dr);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace train_common

void attention_forward_train(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq, const float* kv,
                             int64_t ldkv, const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int B,
                             int64_t max_len, int64_t rows, const Dims& d, float scale, bool causal) {
  constexpr const char* fn = "mla::cuda::attention_forward_train";
  check_attention(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale);
  K3_CHECK(ldo >= d.H * d.Dv, fn, ": ldo = ", ldo, " < H*Dv = ", d.H * d.Dv);
  if (rows == 0 || B == 0) return;
  K3_CHECK(o && lse && q && kv && cu_seqlens && (k_rot || d.Dr == 0), fn, ": null device pointer");
  AttnArgs a{};
  a.q = q, a.ldq = ldq, a.kv = kv, a.ldkv = ldkv, a.k_rot = k_rot, a.ldr = ldr;
  a.cu = cu_seqlens, a.rows = rows;
  a.H = int(d.H), a.Dn = int(d.Dn), a.Dr = int(d.Dr), a.Dv = int(d.Dv), a.scale = scale;
  a.causal = causal;
  switch (col_blocks(d.Dv)) {
    case 4: return launch_fwd<4>(a, o, ldo, lse, B, max_len);
    case 8: return launch_fwd<8>(a, o, ldo, lse, B, max_len);
    default: return launch_fwd<16>(a, o, ldo, lse, B, max_len);
  }
}

size_t attention_backward_workspace_bytes(int64_t rows, const Dims& d) {
  return train_common::backward_workspace_bytes("mla::cuda::attention_backward_workspace_bytes", rows, d);
}

void attention_backward_train(float* dq, int64_t lddq, float* dkv, int64_t lddkv, float* dk_rot, int64_t lddr,
                              const float* d_o, int64_t ldo, const float* o, const float* q, int64_t ldq,
                              const float* kv, int64_t ldkv, const float* k_rot, int64_t ldr, const float* lse,
                              const int32_t* cu_seqlens, int B, int64_t max_len, int64_t rows, const Dims& d,
                              float scale, void* workspace, bool causal) {
  constexpr const char* fn = "mla::cuda::attention_backward_train";
  check_backward(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale, ldo, lddq, lddkv, lddr);
  if (rows == 0 || B == 0) return;
  K3_CHECK(dq && dkv && d_o && o && q && kv && lse && cu_seqlens && (d.Dr == 0 || (k_rot && dk_rot)), fn,
           ": null device pointer");
  K3_CHECK(workspace, fn,
           ": workspace is null (attention_backward_workspace_bytes = ", attention_backward_workspace_bytes(rows, d),
           " bytes)");
  float* delta = static_cast<float*>(workspace);
  float* dk_rot_h = reinterpret_cast<float*>(static_cast<char*>(workspace) + delta_bytes(rows, d));

  const int64_t warps = rows * d.H;
  const int64_t blocks = (warps * 32 + kThreads - 1) / kThreads;
  K3_CHECK(blocks <= INT32_MAX, fn, ": rows*H = ", warps, " is too large");
  attn_delta_kernel<<<unsigned(blocks), kThreads>>>(delta, d_o, o, ldo, rows, int(d.H), int(d.Dv));
  K3_CUDA_LAUNCH_CHECK();

  AttnArgs a{};
  a.q = q, a.ldq = ldq, a.kv = kv, a.ldkv = ldkv, a.k_rot = k_rot, a.ldr = ldr, a.d_o = d_o, a.ldo = ldo;
  a.lse = lse, a.delta = delta, a.cu = cu_seqlens, a.rows = rows;
  a.H = int(d.H), a.Dn = int(d.Dn), a.Dr = int(d.Dr), a.Dv = int(d.Dv), a.scale = scale;
  a.causal = causal;
  switch (col_blocks(d.Dn + d.Dr)) {
    case 4: dispatch_dkv<4>(a, dkv, lddkv, dk_rot_h, B, max_len), launch_dq<4>(a, dq, lddq, B, max_len); break;
    case 8: dispatch_dkv<8>(a, dkv, lddkv, dk_rot_h, B, max_len), launch_dq<8>(a, dq, lddq, B, max_len); break;
    case 12: dispatch_dkv<12>(a, dkv, lddkv, dk_rot_h, B, max_len), launch_dq<12>(a, dq, lddq, B, max_len); break;
    default: dispatch_dkv<16>(a, dkv, lddkv, dk_rot_h, B, max_len), launch_dq<16>(a, dq, lddq, B, max_len); break;
  }
  if (d.Dr > 0) {
    train_common::dk_rot_sum(rowwise::grid_for(rows * d.Dr, kThreads), dk_rot, lddr, dk_rot_h, rows, int(d.H),
                             int(d.Dr));
  }
}

void output_gate_forward_train(float* og, float* gate, const float* o, int64_t n) {
  K3_CHECK(n >= 0, "mla::cuda::output_gate_forward_train: n must be >= 0, got ", n);
  if (n == 0) return;
  K3_CHECK(og && gate && o, "mla::cuda::output_gate_forward_train: null device pointer");
  gate_fwd_kernel<<<rowwise::grid_for(n, kThreads), kThreads>>>(og, gate, o, n);
  K3_CUDA_LAUNCH_CHECK();
}

void output_gate_backward_train(float* d_o, float* dz, const float* dog, const float* o, const float* gate, int64_t n) {
  K3_CHECK(n >= 0, "mla::cuda::output_gate_backward_train: n must be >= 0, got ", n);
  if (n == 0) return;
  K3_CHECK(d_o && dz && dog && o && gate, "mla::cuda::output_gate_backward_train: null device pointer");
  gate_bwd_kernel<<<rowwise::grid_for(n, kThreads), kThreads>>>(d_o, dz, dog, o, gate, n);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::mla::cuda
