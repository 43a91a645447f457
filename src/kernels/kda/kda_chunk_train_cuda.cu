// KDA recurrence core for training, fp32, chunked (C = 16): the four kernels and their launchers. Design,
// math and numerics: kda_chunk_train_cuda.h. Thread layout shared by the kernels: 256 threads; where a 16 x 16
// (row r, value column j) tile is computed, thread t owns (r, j) = (t / 16, t % 16).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/kda/kda_chunk_train_cuda.h"
#include "kernels/kda/kda_train_common.cuh"

namespace k3::kda::cuda {
namespace {

using chunk_train::C;
using chunk_train::ChunkLoc;
using chunk_train::locate_chunk;

// ---- device code ----------------------------------------------------------------------------------------
constexpr int VS = 16;   // value columns per slice of the state
constexpr int VSP = 17;  // padded row of a state slice where threads walk its rows (bank-conflict free)
constexpr int NT = 256;  // threads per block, every kernel
static_assert(NT == C * VS, "a 16 x 16 tile has one element per thread");
static_assert(NT / 32 * 2 == C, "prepare_chunk: each warp takes two columns of the pair loop");

// The per-(chunk, head) quantities of the chunked form ([C][D] rows r; rows >= n are zero, alpha there 1).
template <int D>
struct Prep {
  float Q[C][D];      // scale q
  float K[C][D];      // k
  float alpha[C][D];  // expf(g)
  float E[C][D];      // alpha_0 ... alpha_r
  float Qt[C][D];     // E Q
  float Kt[C][D];     // E k
  float P[C][D];      // alpha_{r+1} ... alpha_{n-1}
  float Kd[C][D];     // P k
  float A[C][C];      // strictly lower: A_rs = sum_c k_r k_s W_rs
  float M[C][C];      // lower with diagonal: M_rs = sum_c Q_r k_s W_rs
};

// What the sequential kernels read per chunk (copied whole, as float4, from the workspace to shared memory).
template <int D>
struct Item {
  float Qt[C][D], Kt[C][D], Kd[C][D];
  float A[C][C], M[C][C];
  float El[D];  // E_{n-1}
};
static_assert(sizeof(Item<32>) % 16 == 0 && sizeof(Item<64>) % 16 == 0 && sizeof(Item<128>) % 16 == 0,
              "items are copied as float4");

// Fills s for the chunk rows [row0, row0 + n) of head h. Ends with a barrier.
template <int D>
__device__ void prepare_chunk(Prep<D>& s, const KdaTrainParams& p, int h, int64_t row0, int n) {
  const int tid = threadIdx.x;
  const int64_t HD = int64_t(p.H) * D;
  for (int i = tid; i < C * D; i += NT) {
    const int r = i / D, c = i % D;
    float q = 0.f, k = 0.f, a = 1.f;
    if (r < n) {
      const int64_t off = (row0 + r) * HD + int64_t(h) * D + c;
      q = p.scale * p.q[off];
      k = p.k[off];
      a = expf(p.g[off]);
    }
    s.Q[r][c] = q;
    s.K[r][c] = k;
    s.alpha[r][c] = a;
  }
  for (int i = tid; i < C * C; i += NT) {
    s.A[i / C][i % C] = 0.f;
    s.M[i / C][i % C] = 0.f;
  }
  __syncthreads();

  // Per channel: E (running product from the chunk start), P_s (running product over s < tau < n, ascending
  // tau: the same factors in the same order as the pair loop's W_{n-1,s}).
  for (int c = tid; c < D; c += NT) {
    float e = 1.f;
    for (int r = 0; r < C; ++r) {
      if (r < n) {
        e *= s.alpha[r][c];
        float w = 1.f;
        for (int t = r + 1; t < n; ++t) w *= s.alpha[t][c];
        s.E[r][c] = e;
        s.Qt[r][c] = e * s.Q[r][c];
        s.Kt[r][c] = e * s.K[r][c];
        s.P[r][c] = w;
        s.Kd[r][c] = w * s.K[r][c];
      } else {
        s.E[r][c] = s.Qt[r][c] = s.Kt[r][c] = s.P[r][c] = s.Kd[r][c] = 0.f;
      }
    }
  }

  // Pair loop: warp w takes columns s = w and C-1-w; lane l the channels l, l+32, ...; W_rs is carried down
  // r = s+1 .. n-1 as a running product per channel; each dot product is a warp butterfly sum.
  constexpr int CPL = D / 32;
  const int warp = tid / 32, lane = tid % 32;
  for (int pass = 0; pass < 2; ++pass) {
    const int sc = pass == 0 ? warp : C - 1 - warp;
    if (sc >= n) continue;  // warp-uniform
    float w[CPL];
    float m0 = 0.f;
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i;
      m0 = fmaf(s.Q[sc][c], s.K[sc][c], m0);
      w[i] = 1.f;
    }
    m0 = rowwise::warp_sum(m0);
    if (lane == 0) s.M[sc][sc] = m0;
    for (int r = sc + 1; r < n; ++r) {
      float a = 0.f, m = 0.f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i;
        w[i] *= s.alpha[r][c];
        const float kw = s.K[sc][c] * w[i];
        a = fmaf(s.K[r][c], kw, a);
        m = fmaf(s.Q[r][c], kw, m);
      }
      a = rowwise::warp_sum(a);
      m = rowwise::warp_sum(m);
      if (lane == 0) {
        s.A[r][sc] = a;
        s.M[r][sc] = m;
      }
    }
  }
  __syncthreads();
}

// Forward substitution of one chunk, one thread per value column j (threads 0 .. VS-1 call it):
// X_r <- X_r - sum_{s<r} A_rs U_s (term by term), U_r = beta_r X_r; rows >= n of U are zeroed.
__device__ __forceinline__ void forward_substitution(float (*X)[VS], float (*U)[VS], const float (*A)[C],
                                                     const float* beta, int n, int j) {
  for (int r = 0; r < C; ++r) {
    if (r < n) {
      float x = X[r][j];
      for (int s = 0; s < r; ++s) x = fmaf(-A[r][s], U[s][j], x);
      X[r][j] = x;
      U[r][j] = beta[r] * x;
    } else {
      U[r][j] = 0.f;
    }
  }
}

// Copies n4 float4s from global to shared memory.
__device__ __forceinline__ void copy4(float4* dst, const float4* src, int n4) {
  for (int i = threadIdx.x; i < n4; i += NT) dst[i] = src[i];
}

template <int D>
__global__ void __launch_bounds__(NT) prep_kernel(KdaTrainParams p, Item<D>* items) {
  extern __shared__ float4 smem4[];
  Prep<D>& s = *reinterpret_cast<Prep<D>*>(smem4);
  const int64_t ci = chunk_train::grid_chunk();
  if (ci >= p.chunks) return;
  const int h = chunk_train::grid_head();
  const ChunkLoc L = locate_chunk(p, ci);
  prepare_chunk<D>(s, p, h, L.row0, L.n);
  Item<D>& it = items[ci * p.H + h];
  for (int i = threadIdx.x; i < C * D; i += NT) {
    const int r = i / D, c = i % D;
    it.Qt[r][c] = s.Qt[r][c];
    it.Kt[r][c] = s.Kt[r][c];
    it.Kd[r][c] = s.Kd[r][c];
  }
  for (int i = threadIdx.x; i < C * C; i += NT) {
    it.A[i / C][i % C] = s.A[i / C][i % C];
    it.M[i / C][i % C] = s.M[i / C][i % C];
  }
  for (int c = threadIdx.x; c < D; c += NT) it.El[c] = s.E[L.n - 1][c];
}

template <int D>
struct FwdSmem {
  Item<D> it;
  float S[D][VS];  // this block's 16 columns of the state
  float X[C][VS], U[C][VS];
  float beta[C];
};

template <int D>
__global__ void __launch_bounds__(NT) fwd_seq_kernel(KdaTrainParams p, const Item<D>* items, float* o, float* states) {
  extern __shared__ float4 smem4[];
  FwdSmem<D>& s = *reinterpret_cast<FwdSmem<D>*>(smem4);
  const int b = blockIdx.x, h = blockIdx.y, sl = blockIdx.z;
  const int tid = threadIdx.x, r = tid / VS, j = tid % VS;
  const int64_t begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1], c0 = p.chunk_offsets[b];
  const int64_t nch = (end - begin + C - 1) / C;
  const int64_t HD = int64_t(p.H) * D, col = int64_t(h) * D + sl * VS + j;
  for (int i = tid; i < D * VS; i += NT) s.S[i / VS][i % VS] = 0.f;
  for (int64_t lc = 0; lc < nch; ++lc) {
    const int64_t ci = c0 + lc, row0 = begin + C * lc;
    const int n = int(end - row0 < C ? end - row0 : C);
    __syncthreads();  // the previous chunk is done with it, S, U
    copy4(reinterpret_cast<float4*>(&s.it), reinterpret_cast<const float4*>(items + (ci * p.H + h)),
          int(sizeof(Item<D>) / 16));
    if (tid < C) s.beta[tid] = tid < n ? p.beta[(row0 + tid) * p.H + h] : 0.f;
    float* st = states + (ci * p.H + h) * D * D + sl * VS;
    for (int i = tid; i < D * VS; i += NT) st[(i / VS) * D + i % VS] = s.S[i / VS][i % VS];
    __syncthreads();
    // X = V - Kt S0.
    float x = 0.f;
    if (r < n) {
      float acc = 0.f;
      for (int c = 0; c < D; ++c) acc = fmaf(s.it.Kt[r][c], s.S[c][j], acc);
      x = p.v[(row0 + r) * HD + col] - acc;
    }
    s.X[r][j] = x;
    __syncthreads();
    if (tid < VS) forward_substitution(s.X, s.U, s.it.A, s.beta, n, tid);
    __syncthreads();
    // O = Qt S0 + M U.
    if (r < n) {
      float acc = 0.f;
      for (int c = 0; c < D; ++c) acc = fmaf(s.it.Qt[r][c], s.S[c][j], acc);
      for (int t = 0; t <= r; ++t) acc = fmaf(s.it.M[r][t], s.U[t][j], acc);
      o[(row0 + r) * HD + col] = acc;
    }
    __syncthreads();  // every read of S0 is done
    // S_end = Diag(El) S0 + Kd^T U: thread (r, j) owns rows c = r, r + 16, ... of column j.
    for (int c = r; c < D; c += C) {
      float a = s.it.El[c] * s.S[c][j];
      for (int t = 0; t < n; ++t) a = fmaf(s.it.Kd[t][c], s.U[t][j], a);
      s.S[c][j] = a;
    }
  }
}

template <int D>
struct BwdSeqSmem {
  Item<D> it;
  float dS[D][VS];  // this block's 16 columns of dL/dS_end
  float dO[C][VS], dU[C][VS], dX[C][VS];
  float beta[C];
};

template <int D>
__global__ void __launch_bounds__(NT)
    bwd_seq_kernel(KdaTrainParams p, const Item<D>* items, const float* d_o, float* dstates, float* dB, float* dv) {
  extern __shared__ float4 smem4[];
  BwdSeqSmem<D>& s = *reinterpret_cast<BwdSeqSmem<D>*>(smem4);
  const int b = blockIdx.x, h = blockIdx.y, sl = blockIdx.z;
  const int tid = threadIdx.x, r = tid / VS, j = tid % VS;
  const int64_t begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1], c0 = p.chunk_offsets[b];
  const int64_t nch = (end - begin + C - 1) / C;
  const int64_t HD = int64_t(p.H) * D, col = int64_t(h) * D + sl * VS + j;
  for (int i = tid; i < D * VS; i += NT) s.dS[i / VS][i % VS] = 0.f;
  for (int64_t lc = nch - 1; lc >= 0; --lc) {
    const int64_t ci = c0 + lc, row0 = begin + C * lc;
    const int n = int(end - row0 < C ? end - row0 : C);
    __syncthreads();  // the previous chunk is done with it, dS, dO, dX
    copy4(reinterpret_cast<float4*>(&s.it), reinterpret_cast<const float4*>(items + (ci * p.H + h)),
          int(sizeof(Item<D>) / 16));
    if (tid < C) s.beta[tid] = tid < n ? p.beta[(row0 + tid) * p.H + h] : 0.f;
    s.dO[r][j] = r < n ? d_o[(row0 + r) * HD + col] : 0.f;
    float* dst = dstates + (ci * p.H + h) * D * D + sl * VS;
    for (int i = tid; i < D * VS; i += NT) dst[(i / VS) * D + i % VS] = s.dS[i / VS][i % VS];
    __syncthreads();
    // dU = Kd dS + M^T dO.
    float du = 0.f;
    if (r < n) {
      for (int c = 0; c < D; ++c) du = fmaf(s.it.Kd[r][c], s.dS[c][j], du);
      for (int t = r; t < n; ++t) du = fmaf(s.it.M[t][r], s.dO[t][j], du);
    }
    s.dU[r][j] = du;
    __syncthreads();
    // Back substitution: dB_r = dU_r - sum_{r'>r} A_r'r dX_r', dX_r = beta_r dB_r; dv = dX.
    if (tid < VS) {
      for (int rr = C - 1; rr >= 0; --rr) {
        if (rr >= n) {
          s.dX[rr][tid] = 0.f;
          continue;
        }
        float db = s.dU[rr][tid];
        for (int t = rr + 1; t < n; ++t) db = fmaf(-s.it.A[t][rr], s.dX[t][tid], db);
        const float dx = s.beta[rr] * db;
        s.dX[rr][tid] = dx;
        dB[(row0 + rr) * HD + col] = db;
        dv[(row0 + rr) * HD + col] = dx;
      }
    }
    __syncthreads();
    // dS0 = Diag(El) dS + Qt^T dO - Kt^T dX, in place: thread (r, j) owns rows c = r, r + 16, ... of column j.
    for (int c = r; c < D; c += C) {
      float a = s.it.El[c] * s.dS[c][j];
      for (int t = 0; t < n; ++t) a = fmaf(s.it.Qt[t][c], s.dO[t][j], a);
      for (int t = 0; t < n; ++t) a = fmaf(-s.it.Kt[t][c], s.dX[t][j], a);
      s.dS[c][j] = a;
    }
  }
}

template <int D>
struct BwdChunkSmem {
  Prep<D> pr;
  float dQt[C][D], dKt[C][D], dKd[C][D];  // sums over the slices; reused in place for dQ, dK, dGamma
  float dM[C][C], dA[C][C];
  float dGl[D];  // sum_j S0[c][j] dS[c][j]
  float dbeta[C], beta[C];
  float S0[D][VSP], dS[D][VSP];  // one slice
  float X[C][VS], U[C][VS], dO[C][VS], dB[C][VS], dX[C][VS];
};

template <int D>
__global__ void __launch_bounds__(NT)
    bwd_chunk_kernel(KdaTrainParams p, const float* d_o, const float* states, const float* dstates, const float* dB,
                     float* dq, float* dk, float* dg, float* dbeta) {
  extern __shared__ float4 smem4[];
  BwdChunkSmem<D>& s = *reinterpret_cast<BwdChunkSmem<D>*>(smem4);
  const int64_t ci = chunk_train::grid_chunk();
  if (ci >= p.chunks) return;
  const int h = chunk_train::grid_head();
  const int tid = threadIdx.x, r = tid / VS, j = tid % VS;
  const ChunkLoc L = locate_chunk(p, ci);
  const int n = L.n;
  const int64_t row0 = L.row0, HD = int64_t(p.H) * D;
  prepare_chunk<D>(s.pr, p, h, row0, n);
  for (int i = tid; i < C * D; i += NT) {
    s.dQt[i / D][i % D] = 0.f;
    s.dKt[i / D][i % D] = 0.f;
    s.dKd[i / D][i % D] = 0.f;
  }
  s.dM[r][j] = 0.f;
  s.dA[r][j] = 0.f;
  for (int c = tid; c < D; c += NT) s.dGl[c] = 0.f;
  if (tid < C) {
    s.dbeta[tid] = 0.f;
    s.beta[tid] = tid < n ? p.beta[(row0 + tid) * p.H + h] : 0.f;
  }
  const float* S0g = states + (ci * p.H + h) * D * D;
  const float* dSg = dstates + (ci * p.H + h) * D * D;
  for (int sl = 0; sl < D / VS; ++sl) {
    const int64_t col = int64_t(h) * D + sl * VS + j;
    __syncthreads();  // the previous slice is done with the slice buffers; zeroed accumulators, beta visible
    for (int i = tid; i < D * VS; i += NT) {
      const int c = i / VS, jj = i % VS;
      s.S0[c][jj] = S0g[c * D + sl * VS + jj];
      s.dS[c][jj] = dSg[c * D + sl * VS + jj];
    }
    float x = 0.f, dbv = 0.f, dov = 0.f;
    if (r < n) {
      x = p.v[(row0 + r) * HD + col];
      dbv = dB[(row0 + r) * HD + col];
      dov = d_o[(row0 + r) * HD + col];
    }
    s.dO[r][j] = dov;
    s.dB[r][j] = dbv;
    s.dX[r][j] = s.beta[r] * dbv;  // as bwd_seq_kernel formed dv
    __syncthreads();
    // Recompute X = V - Kt S0, then the forward substitution (the forward's U and residual X).
    if (r < n) {
      float acc = 0.f;
      for (int c = 0; c < D; ++c) acc = fmaf(s.pr.Kt[r][c], s.S0[c][j], acc);
      x -= acc;
    }
    s.X[r][j] = x;
    __syncthreads();
    if (tid < VS) forward_substitution(s.X, s.U, s.pr.A, s.beta, n, tid);
    __syncthreads();
    // Accumulate this slice's share of the products that sum over value columns. Each accumulator entry has
    // one owner thread, and the slices come in order: a fixed summation order.
    for (int i = tid; i < C * D; i += NT) {
      const int rr = i / D, c = i % D;
      if (rr >= n) continue;
      float aq = 0.f, ak = 0.f, ad = 0.f;
#pragma unroll
      for (int jj = 0; jj < VS; ++jj) {
        aq = fmaf(s.dO[rr][jj], s.S0[c][jj], aq);  // dQt = dO S0^T
        ak = fmaf(s.dX[rr][jj], s.S0[c][jj], ak);  // dKt = -dX S0^T
        ad = fmaf(s.U[rr][jj], s.dS[c][jj], ad);   // dKd = U dS^T
      }
      s.dQt[rr][c] += aq;
      s.dKt[rr][c] -= ak;
      s.dKd[rr][c] += ad;
    }
    if (r < n && j < n) {  // (r, j) as a (row, column) pair of the 16 x 16 products
      float am = 0.f, aa = 0.f;
#pragma unroll
      for (int jj = 0; jj < VS; ++jj) {
        am = fmaf(s.dO[r][jj], s.U[j][jj], am);  // dM = dO U^T
        aa = fmaf(s.dX[r][jj], s.U[j][jj], aa);  // dA = -dX U^T
      }
      s.dM[r][j] += am;
      s.dA[r][j] -= aa;
    }
    if (tid < n) {
      float a = 0.f;
      for (int jj = 0; jj < VS; ++jj) a = fmaf(s.dB[tid][jj], s.X[tid][jj], a);  // dbeta_r = dB_r . X_r
      s.dbeta[tid] += a;
    }
    for (int c = tid; c < D; c += NT) {
      float a = 0.f;
      for (int jj = 0; jj < VS; ++jj) a = fmaf(s.S0[c][jj], s.dS[c][jj], a);
      s.dGl[c] += a;
    }
  }
  __syncthreads();

  if (tid < n) dbeta[(row0 + tid) * p.H + h] = s.dbeta[tid];
  // Per key channel c (one thread each; nothing below mixes channels): the elementwise terms, the pair terms,
  // the reverse cumulative sum. dQt, dKt, dKd are turned into dQ, dK, dGamma in place.
  for (int c = tid; c < D; c += NT) {
    const Prep<D>& f = s.pr;
    float ysum = 0.f;
    for (int rr = 0; rr < n; ++rr) {
      const float qt = s.dQt[rr][c], kt = s.dKt[rr][c], kd = s.dKd[rr][c], mrr = s.dM[rr][rr];
      const float y = kd * f.Kd[rr][c];
      s.dKd[rr][c] = qt * f.Qt[rr][c] + kt * f.Kt[rr][c] - y;               // dGamma_r
      s.dQt[rr][c] = qt * f.E[rr][c] + mrr * f.K[rr][c];                    // dQ_r
      s.dKt[rr][c] = kt * f.E[rr][c] + kd * f.P[rr][c] + mrr * f.Q[rr][c];  // dk_r
      ysum += y;
    }
    // dGamma_{n-1}: the chunk end's Diag(E_{n-1}) S0 and the P of every Kd_s.
    s.dKd[n - 1][c] += f.E[n - 1][c] * s.dGl[c] + ysum;
    // Pair terms, column by column with the forward's running decay product W_rs.
    for (int sc = 0; sc < n; ++sc) {
      const float ks = f.K[sc][c];
      float w = 1.f, dks = 0.f, dgs = 0.f;
      for (int rr = sc + 1; rr < n; ++rr) {
        const float am = s.dM[rr][sc], aa = s.dA[rr][sc];
        w *= f.alpha[rr][c];
        const float kw = ks * w;
        const float t = am * f.Q[rr][c] + aa * f.K[rr][c];
        s.dQt[rr][c] += am * kw;
        s.dKt[rr][c] += aa * kw;
        dks += t * w;
        const float xg = t * kw;
        s.dKd[rr][c] += xg;
        dgs -= xg;
      }
      s.dKt[sc][c] += dks;
      s.dKd[sc][c] += dgs;
    }
    // dg_i = sum_{r >= i} dGamma_r; dq = scale dQ.
    float acc = 0.f;
    for (int rr = n - 1; rr >= 0; --rr) {
      const int64_t off = (row0 + rr) * HD + int64_t(h) * D + c;
      acc += s.dKd[rr][c];
      dg[off] = acc;
      dq[off] = p.scale * s.dQt[rr][c];
      dk[off] = s.dKt[rr][c];
    }
  }
}

// Shared memory per block at D = 128 (the largest): prep 66 KB, fwd_seq 37 KB, bwd_seq 38 KB, bwd_chunk 115 KB.
constexpr size_t kMaxSmem = 227 * 1024;  // sm_90's opt-in limit per block
static_assert(sizeof(Prep<128>) <= kMaxSmem && sizeof(FwdSmem<128>) <= kMaxSmem &&
                  sizeof(BwdSeqSmem<128>) <= kMaxSmem && sizeof(BwdChunkSmem<128>) <= kMaxSmem,
              "shared memory over the per-block limit");

// ---- host launchers ---------------------------------------------------------------------------------------

constexpr size_t item_floats(int D) { return size_t(3 * C * D + 2 * C * C + D); }

// Opts a kernel into more than 48 KB of dynamic shared memory (once per kernel), then launches it.
template <class Kernel, class... Args>
void launch(Kernel kernel, bool& attr_set, dim3 grid, size_t smem, Args... args) {
  if (!attr_set) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    attr_set = true;
  }
  kernel<<<grid, NT, smem>>>(args...);
  K3_CUDA_LAUNCH_CHECK();
}

template <int D>
void run_prep(const KdaTrainParams& p, Item<D>* items) {
  static bool attr = false;
  launch(prep_kernel<D>, attr, chunk_train::chunk_head_grid(p.chunks, p.H), sizeof(Prep<D>), p, items);
}

template <int D>
void forward(const KdaTrainParams& p, float* o, float* states, void* workspace) {
  auto* items = static_cast<Item<D>*>(workspace);
  run_prep<D>(p, items);
  static bool attr = false;
  launch(fwd_seq_kernel<D>, attr, dim3(unsigned(p.B), unsigned(p.H), unsigned(D / VS)), sizeof(FwdSmem<D>), p,
         static_cast<const Item<D>*>(items), o, states);
}

template <int D>
void backward(const KdaTrainParams& p, const float* d_o, const float* states, float* dq, float* dk, float* dv,
              float* dg, float* dbeta, void* workspace) {
  auto* items = static_cast<Item<D>*>(workspace);
  float* dstates = reinterpret_cast<float*>(items + p.chunks * p.H);
  float* dB = dstates + p.chunks * p.H * D * D;
  run_prep<D>(p, items);
  static bool attr_seq = false, attr_chunk = false;
  launch(bwd_seq_kernel<D>, attr_seq, dim3(unsigned(p.B), unsigned(p.H), unsigned(D / VS)), sizeof(BwdSeqSmem<D>), p,
         static_cast<const Item<D>*>(items), d_o, dstates, dB, dv);
  launch(bwd_chunk_kernel<D>, attr_chunk, chunk_train::chunk_head_grid(p.chunks, p.H), sizeof(BwdChunkSmem<D>), p, d_o,
         states, static_cast<const float*>(dstates), static_cast<const float*>(dB), dq, dk, dg, dbeta);
}

}  // namespace

size_t kda_chunk_train_states_bytes(const KdaTrainParams& p) {
  chunk_train::check_params("kda_chunk_train_states_bytes", p);
  return size_t(p.chunks) * size_t(p.H) * size_t(p.D) * size_t(p.D) * sizeof(float);
}

size_t kda_chunk_forward_train_workspace_bytes(const KdaTrainParams& p) {
  chunk_train::check_params("kda_chunk_forward_train_workspace_bytes", p);
  return size_t(p.chunks) * size_t(p.H) * item_floats(p.D) * sizeof(float);
}

size_t kda_chunk_backward_train_workspace_bytes(const KdaTrainParams& p) {
  chunk_train::check_params("kda_chunk_backward_train_workspace_bytes", p);
  const size_t CH = size_t(p.chunks) * size_t(p.H), D = size_t(p.D);
  return (CH * item_floats(p.D) + CH * D * D + size_t(p.rows) * size_t(p.H) * D) * sizeof(float);
}

void kda_chunk_forward_train(const KdaTrainParams& p, float* o, float* states, void* workspace) {
  const char* fn = "kda_chunk_forward_train";
  if (!chunk_train::check_forward(fn, p, o, states, workspace)) return;
  switch (p.D) {
    case 32: forward<32>(p, o, states, workspace); break;
    case 64: forward<64>(p, o, states, workspace); break;
    default: forward<128>(p, o, states, workspace); break;
  }
}

void kda_chunk_backward_train(const KdaTrainParams& p, const float* d_o, const float* states, float* dq, float* dk,
                              float* dv, float* dg, float* dbeta, void* workspace) {
  const char* fn = "kda_chunk_backward_train";
  if (!chunk_train::check_backward(fn, p, d_o, states, dq, dk, dv, dg, dbeta, workspace)) return;
  switch (p.D) {
    case 32: backward<32>(p, d_o, states, dq, dk, dv, dg, dbeta, workspace); break;
    case 64: backward<64>(p, d_o, states, dq, dk, dv, dg, dbeta, workspace); break;
    default: backward<128>(p, d_o, states, dq, dk, dv, dg, dbeta, workspace); break;
  }
}

}  // namespace k3::kda::cuda
