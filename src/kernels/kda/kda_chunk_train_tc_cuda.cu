// KDA recurrence core for training on tensor cores (bf16 operands, fp32 accumulators): the four kernels and their
// launchers. Math, design and numerics: kda_chunk_train_tc_cuda.h.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16; lane = 4 g + q):
//   A (16x16, row): reg0 = A[g][2q..2q+1]  reg1 = A[g+8][2q..]  reg2 = A[g][2q+8..]  reg3 = A[g+8][2q+8..]
//   B (16x8, col):  reg0 = B[2q..2q+1][g]  reg1 = B[2q+8..2q+9][g]
//   C (16x8):       c0, c1 = C[g][2q..2q+1]  c2, c3 = C[g+8][2q..2q+1]
// Two C tiles side by side (16x16) packed in pairs are exactly an A operand (pack_a): products chain in registers.
// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i of lane t holds row t/4,
// columns 2(t%4), +1 of matrix i (.trans: column t/4, rows 2(t%4), +1). The four loaders below pick the row
// addresses so that the registers come out in the fragment order above.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/kda/kda_chunk_train_tc_cuda.h"
#include "kernels/kda/kda_train_common.cuh"

namespace k3::kda::cuda {
namespace {

using chunk_train::C;
using chunk_train::ChunkLoc;
using chunk_train::locate_chunk;

using bf16 = __nv_bfloat16;
constexpr int kMid = 7;       // the re-reference position of A and M (Gamma_m)
constexpr int kLdT = 24;      // row stride (bf16) of a 16x16 tile in shared memory: 48 bytes, conflict-free ldmatrix
constexpr int kSeqWarps = 2;  // warps per CTA of the sequential kernels (16 value columns each)

template <int D>
constexpr int ld_of() {  // row stride (bf16) of [16][D] and [D][D] tiles: D + 8 (a 16-byte shift per row)
  return D + 8;
}

// ---- fragments --------------------------------------------------------------------------------------------
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// A = X[0..15][k0..k0+15] (X row-major, ld elements).
__device__ __forceinline__ void lda_row(uint32_t (&a)[4], const bf16* X, int ld, int k0) {
  const int l = lane_id();
  ptx::ldmatrix_x4(a, ptx::smem_u32(X + ((l & 7) + ((l >> 3) & 1) * 8) * ld + k0 + (l >> 4) * 8));
}
// A[m][k] = X[k0 + k][m0 + m] (X stored [k][m]).
__device__ __forceinline__ void lda_trans(uint32_t (&a)[4], const bf16* X, int ld, int k0, int m0) {
  const int l = lane_id();
  ptx::ldmatrix_x4_trans(a, ptx::smem_u32(X + (k0 + (l & 7) + (l >> 4) * 8) * ld + m0 + ((l >> 3) & 1) * 8));
}
// Two B tiles (n0..n0+7: b[0], b[1]; n0+8..n0+15: b[2], b[3]), B[k][n] = Y[n0 + n][k0 + k] (Y stored [n][k]).
__device__ __forceinline__ void ldb_nk(uint32_t (&b)[4], const bf16* Y, int ld, int n0, int k0) {
  const int l = lane_id();
  ptx::ldmatrix_x4(b, ptx::smem_u32(Y + (n0 + (l & 7) + (l >> 4) * 8) * ld + k0 + ((l >> 3) & 1) * 8));
}
// Two B tiles as ldb_nk, B[k][n] = Y[k0 + k][n0 + n] (Y stored [k][n]).
__device__ __forceinline__ void ldb_kn(uint32_t (&b)[4], const bf16* Y, int ld, int k0, int n0) {
  const int l = lane_id();
  ptx::ldmatrix_x4_trans(b, ptx::smem_u32(Y + (k0 + (l & 7) + ((l >> 3) & 1) * 8) * ld + n0 + (l >> 4) * 8));
}
// c[0..1] += a * (b tiles 0, 1).
__device__ __forceinline__ void mma2(float (&c)[2][4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  ptx::mma_bf16_16816(c[0], a, b[0], b[1]);
  ptx::mma_bf16_16816(c[1], a, b[2], b[3]);
}
// The A operand of the 16x16 accumulator pair (c0, c1) (columns 0-7, 8-15), times s (1 or -1).
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4], float s = 1.f) {
  a[0] = ptx::pack_bf16x2(s * c0[0], s * c0[1]);
  a[1] = ptx::pack_bf16x2(s * c0[2], s * c0[3]);
  a[2] = ptx::pack_bf16x2(s * c1[0], s * c1[1]);
  a[3] = ptx::pack_bf16x2(s * c1[2], s * c1[3]);
}
__device__ __forceinline__ void zero2(float (&c)[2][4]) {
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) c[j][e] = 0.f;
}
// The (row, column) of element e of accumulator tile j of a 16x16 pair: row g + 8 (e >> 1), column 8 j + 2 q + (e & 1).
__device__ __forceinline__ int frag_row(int e) { return (lane_id() >> 2) + (e >> 1) * 8; }
__device__ __forceinline__ int frag_col(int j, int e) { return 8 * j + 2 * (lane_id() & 3) + (e & 1); }

// ---- chunks --------------------------------------------------------------------------------------------------
// The per-(chunk, head) item in the workspace (bytes): bf16 Kt, Qt, Kd [16][D] (dense rows), Aw, A, M [16][16],
// fp32 El [D]. Rows >= n of every tile are zero.
template <int D>
struct Item {
  static constexpr int kKt = 0, kQt = 32 * D, kKd = 64 * D, kAw = 96 * D, kA = kAw + 512, kM = kAw + 1024,
                       kEl = kAw + 1536, kBytes = kEl + 4 * D;
  static_assert(kBytes % 16 == 0 && kEl % 16 == 0, "item tiles are copied in 16-byte pieces");
};

// ---- prep ---------------------------------------------------------------------------------------------------
template <int D>
struct PrepSmem {
  bf16 Qr[C][ld_of<D>()], Kr[C][ld_of<D>()], Ki[C][ld_of<D>()];
  float A[C][C + 1];
  float beta[C];
};

// One CTA of 2 D threads per (chunk, head). Threads c < D: channel c of the elementwise phase.
template <int D>
__global__ void __launch_bounds__(2 * D) prep_kernel(KdaTrainParams p, unsigned char* items) {
  __shared__ __align__(16) PrepSmem<D> s;
  using I = Item<D>;
  constexpr int LD = ld_of<D>();
  const int64_t ci = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32;
  const ChunkLoc L = locate_chunk(p, ci);
  const int n = L.n;
  const int64_t HD = int64_t(p.H) * D;
  unsigned char* it = items + (ci * p.H + h) * I::kBytes;
  bf16* Kt = reinterpret_cast<bf16*>(it + I::kKt);
  bf16* Qt = reinterpret_cast<bf16*>(it + I::kQt);
  bf16* Kd = reinterpret_cast<bf16*>(it + I::kKd);
  if (tid < D) {
    const int c = tid;
    const int64_t base = L.row0 * HD + int64_t(h) * D + c;
    float gam[C];
    float G = 0.f;
#pragma unroll
    for (int r = 0; r < C; ++r) {
      G += r < n ? p.g[base + r * HD] : 0.f;  // padded rows: g = 0 (their k, q are 0)
      gam[r] = G;
    }
    const float Gl = gam[n - 1], Gm = gam[kMid];
#pragma unroll
    for (int r = 0; r < C; ++r) {
      const float qv = r < n ? p.scale * p.q[base + r * HD] : 0.f;
      const float kv = r < n ? p.k[base + r * HD] : 0.f;
      const float E = expf(gam[r]);
      Qt[r * D + c] = __float2bfloat16_rn(qv * E);
      Kt[r * D + c] = __float2bfloat16_rn(kv * E);
      Kd[r * D + c] = __float2bfloat16_rn(kv * expf(Gl - gam[r]));
      const float er = expf(gam[r] - Gm);
      s.Qr[r][c] = __float2bfloat16_rn(qv * er);
      s.Kr[r][c] = __float2bfloat16_rn(kv * er);
      s.Ki[r][c] = __float2bfloat16_rn(kv * expf(Gm - gam[r]));
    }
    reinterpret_cast<float*>(it + I::kEl)[c] = expf(Gl);
    if (c < C) s.beta[c] = c < n ? p.beta[(L.row0 + c) * p.H + h] : 0.f;  // C <= D
  }
  __syncthreads();
  // Warp 0: A = StrictLower(Kr Ki^T); warp 1: M = Lower(Qr Ki^T). Masks are selects (the upper triangle may be huge).
  if (warp < 2) {
    float acc[2][4];
    zero2(acc);
    const bf16* X = warp == 0 ? &s.Kr[0][0] : &s.Qr[0][0];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b[4];
      lda_row(a, X, LD, ks * 16);
      ldb_nk(b, &s.Ki[0][0], LD, 0, ks * 16);
      mma2(acc, a, b);
    }
    bf16* out = reinterpret_cast<bf16*>(it + (warp == 0 ? I::kA : I::kM));
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = frag_row(e), sc = frag_col(j, e);
        const float v = (warp == 0 ? r > sc : r >= sc) ? acc[j][e] : 0.f;
        if (warp == 0) s.A[r][sc] = v;
        out[r * C + sc] = __float2bfloat16_rn(v);
      }
  }
  __syncthreads();
  // Aw = (I + Diag(beta) A)^-1 Diag(beta), column `col` per lane of warp 0:
  //   x_i = beta_i ([i == col] - sum_{j<i} A_ij x_j).
  if (tid < C) {
    const int col = tid;
    bf16* Aw = reinterpret_cast<bf16*>(it + I::kAw);
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float acc = i == col ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < i; ++j) acc = fmaf(-s.A[i][j], x[j], acc);
      x[i] = s.beta[i] * acc;
      Aw[i * C + col] = __float2bfloat16_rn(x[i]);
    }
  }
}

// ---- sequential kernels ---------------------------------------------------------------------------------------
// A chunk item in shared memory (padded rows).
template <int D>
struct ItemSmem {
  bf16 Kt[C][ld_of<D>()], Qt[C][ld_of<D>()], Kd[C][ld_of<D>()];
  bf16 Aw[C][kLdT], A[C][kLdT], M[C][kLdT];
  float El[D];
};

// Queues the copy of item `src` into `dst` (cp.async, 16-byte pieces, all threads of the CTA).
template <int D>
__device__ __forceinline__ void load_item_async(ItemSmem<D>& dst, const unsigned char* src, int nthreads) {
  using I = Item<D>;
  constexpr int RowPieces = D / 8;  // 16-byte pieces per [D] bf16 row
  constexpr int BigPieces = 3 * C * RowPieces, SmallPieces = 3 * C * 2, ElPieces = D / 4;
  for (int i = threadIdx.x; i < BigPieces + SmallPieces + ElPieces; i += nthreads) {
    const void* from;
    void* to;
    if (i < BigPieces) {
      const int t = i / (C * RowPieces), r = (i / RowPieces) % C, pc = i % RowPieces;
      bf16* tile = t == 0 ? &dst.Kt[0][0] : t == 1 ? &dst.Qt[0][0] : &dst.Kd[0][0];
      from = src + (t == 0 ? I::kKt : t == 1 ? I::kQt : I::kKd) + (r * D + pc * 8) * 2;
      to = tile + r * ld_of<D>() + pc * 8;
    } else if (i < BigPieces + SmallPieces) {
      const int k = i - BigPieces, t = k / (2 * C), r = (k / 2) % C, pc = k % 2;
      bf16* tile = t == 0 ? &dst.Aw[0][0] : t == 1 ? &dst.A[0][0] : &dst.M[0][0];
      from = src + (t == 0 ? I::kAw : t == 1 ? I::kA : I::kM) + (r * C + pc * 8) * 2;
      to = tile + r * kLdT + pc * 8;
    } else {
      const int k = i - BigPieces - SmallPieces;
      from = src + I::kEl + k * 16;
      to = &dst.El[k * 4];
    }
    ptx::cp_async16(ptx::smem_u32(to), from, 16);
  }
  ptx::cp_async_commit();
}

template <int D>
struct SeqSmem {
  ItemSmem<D> st[2];  // double buffer
};

// Forward: one CTA of kSeqWarps warps per (sequence, head, 16 kSeqWarps value columns); warp w keeps the state
// columns v0 .. v0 + 15 as S^T (16 values x D keys): S[nt] is the accumulator tile of keys 8 nt .. 8 nt + 7.
template <int D>
__global__ void __launch_bounds__(kSeqWarps * 32)
    fwd_seq_kernel(KdaTrainParams p, const unsigned char* items, float* o, float* states) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SeqSmem<D>& sm = *reinterpret_cast<SeqSmem<D>*>(smem_raw);
  constexpr int LD = ld_of<D>(), NT = kSeqWarps * 32;
  const int b = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = lane_id(), g = lane >> 2, q = lane & 3;
  const int v0 = (blockIdx.z * kSeqWarps + warp) * 16;
  const int64_t begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1], c0 = p.chunk_offsets[b];
  const int64_t nch = (end - begin + C - 1) / C;
  const int64_t HD = int64_t(p.H) * D, colbase = int64_t(h) * D + v0;
  float S[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[nt][e] = 0.f;
  if (nch > 0) load_item_async<D>(sm.st[0], items + (c0 * p.H + h) * Item<D>::kBytes, NT);
  for (int64_t lc = 0; lc < nch; ++lc) {
    const int64_t ci = c0 + lc, row0 = begin + C * lc;
    const int n = int(end - row0 < C ? end - row0 : C);
    // V^T of this chunk (accumulator layout: value row, token column), read before waiting on the item.
    float y[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = frag_col(j, e), val = frag_row(e);
        y[j][e] = tok < n ? p.v[(row0 + tok) * HD + colbase + val] : 0.f;
      }
    if (lc + 1 < nch) {
      load_item_async<D>(sm.st[(lc + 1) & 1], items + ((ci + 1) * p.H + h) * Item<D>::kBytes, NT);
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();  // item lc visible to every warp
    const ItemSmem<D>& it = sm.st[lc & 1];
    // Save S0 (key-major S[c][j]).
    float* st = states + (ci * p.H + h) * D * D + v0;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[(nt * 8 + 2 * q + (e & 1)) * D + g + (e >> 1) * 8] = S[nt][e];
    // S0^T as A operands (keys 16 ks .. 16 ks + 15), for Y^T and O^T.
    float pk[2][4], ok[2][4];
    zero2(pk);
    zero2(ok);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b0[4], b1[4];
      pack_a(a, S[2 * ks], S[2 * ks + 1]);
      ldb_nk(b0, &it.Kt[0][0], LD, 0, ks * 16);  // B[c][t] = Kt[t][c]
      ldb_nk(b1, &it.Qt[0][0], LD, 0, ks * 16);
      mma2(pk, a, b0);
      mma2(ok, a, b1);
    }
    // Y^T = V^T - S0^T Kt^T; U^T = Y^T Aw^T.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] -= pk[j][e];
    float u[2][4];
    zero2(u);
    {
      uint32_t a[4], b[4];
      pack_a(a, y[0], y[1]);
      ldb_nk(b, &it.Aw[0][0], kLdT, 0, 0);  // B[s][r] = Aw[r][s]
      mma2(u, a, b);
    }
    uint32_t au[4];
    pack_a(au, u[0], u[1]);
    // O^T = S0^T Qt^T + U^T M^T.
    {
      uint32_t b[4];
      ldb_nk(b, &it.M[0][0], kLdT, 0, 0);  // B[s][r] = M[r][s]
      mma2(ok, au, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = frag_col(j, e), val = frag_row(e);
        if (tok < n) o[(row0 + tok) * HD + colbase + val] = ok[j][e];
      }
      // S^T <- S^T Diag(El) + U^T Kd.
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float2 el = *reinterpret_cast<const float2*>(&it.El[nt * 8 + 2 * q]);
      S[nt][0] *= el.x;
      S[nt][1] *= el.y;
      S[nt][2] *= el.x;
      S[nt][3] *= el.y;
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b[4];
      ldb_kn(b, &it.Kd[0][0], LD, 0, np * 16);  // B[t][c] = Kd[t][c]
      ptx::mma_bf16_16816(S[2 * np], au, b[0], b[1]);
      ptx::mma_bf16_16816(S[2 * np + 1], au, b[2], b[3]);
    }
    __syncthreads();  // every warp is done with buffer lc & 1 before it is refilled with chunk lc + 2
  }
}

// Backward, sequential part: the forward's grid, chunks in reverse; warp w keeps dS^T (16 values x D keys).
template <int D>
__global__ void __launch_bounds__(kSeqWarps * 32)
    bwd_seq_kernel(KdaTrainParams p, const unsigned char* items, const float* d_o, bf16* dstates, float* dB,
                   float* dv) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SeqSmem<D>& sm = *reinterpret_cast<SeqSmem<D>*>(smem_raw);
  constexpr int LD = ld_of<D>(), NT = kSeqWarps * 32;
  const int b = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = lane_id(), g = lane >> 2, q = lane & 3;
  const int v0 = (blockIdx.z * kSeqWarps + warp) * 16;
  const int64_t begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1], c0 = p.chunk_offsets[b];
  const int64_t nch = (end - begin + C - 1) / C;
  const int64_t HD = int64_t(p.H) * D, colbase = int64_t(h) * D + v0;
  float dS[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dS[nt][e] = 0.f;
  if (nch > 0) load_item_async<D>(sm.st[(nch - 1) & 1], items + ((c0 + nch - 1) * p.H + h) * Item<D>::kBytes, NT);
  for (int64_t lc = nch - 1; lc >= 0; --lc) {
    const int64_t ci = c0 + lc, row0 = begin + C * lc;
    const int n = int(end - row0 < C ? end - row0 : C);
    // dO^T as an A operand: A[val][tok] = dO[tok][val].
    uint32_t ado[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int val = g + (i & 1) * 8, tok = 2 * q + (i >> 1) * 8;
      const float x0 = tok < n ? d_o[(row0 + tok) * HD + colbase + val] : 0.f;
      const float x1 = tok + 1 < n ? d_o[(row0 + tok + 1) * HD + colbase + val] : 0.f;
      ado[i] = ptx::pack_bf16x2(x0, x1);
    }
    if (lc > 0) {
      load_item_async<D>(sm.st[(lc - 1) & 1], items + ((ci - 1) * p.H + h) * Item<D>::kBytes, NT);
      ptx::cp_async_wait<1>();
    } else {
      ptx::cp_async_wait<0>();
    }
    __syncthreads();
    const ItemSmem<D>& it = sm.st[lc & 1];
    // Save dS (the gradient w.r.t. the state leaving this chunk), key-major, bf16.
    bf16* dst = dstates + (ci * p.H + h) * D * D + v0;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dst[(nt * 8 + 2 * q + (e & 1)) * D + g + (e >> 1) * 8] = __float2bfloat16_rn(dS[nt][e]);
    // dU^T = dS^T Kd^T + dO^T M.
    float du[2][4];
    zero2(du);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], bb[4];
      pack_a(a, dS[2 * ks], dS[2 * ks + 1]);
      ldb_nk(bb, &it.Kd[0][0], LD, 0, ks * 16);  // B[c][t] = Kd[t][c]
      mma2(du, a, bb);
    }
    {
      uint32_t bb[4];
      ldb_kn(bb, &it.M[0][0], kLdT, 0, 0);  // B[t][r] = M[t][r]
      mma2(du, ado, bb);
    }
    // dX^T = dU^T Aw; dB^T = dU^T - dX^T A.
    float dx[2][4], ax[2][4];
    zero2(dx);
    zero2(ax);
    {
      uint32_t a[4], bb[4];
      pack_a(a, du[0], du[1]);
      ldb_kn(bb, &it.Aw[0][0], kLdT, 0, 0);  // B[t][r] = Aw[t][r]
      mma2(dx, a, bb);
    }
    uint32_t adx[4], adxn[4];
    pack_a(adx, dx[0], dx[1]);
    pack_a(adxn, dx[0], dx[1], -1.f);
    {
      uint32_t bb[4];
      ldb_kn(bb, &it.A[0][0], kLdT, 0, 0);  // B[t][r] = A[t][r]
      mma2(ax, adx, bb);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = frag_col(j, e), val = frag_row(e);
        if (tok < n) {
          const int64_t off = (row0 + tok) * HD + colbase + val;
          dv[off] = dx[j][e];
          dB[off] = du[j][e] - ax[j][e];
        }
      }
      // dS^T <- dS^T Diag(El) + dO^T Qt - dX^T Kt.
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float2 el = *reinterpret_cast<const float2*>(&it.El[nt * 8 + 2 * q]);
      dS[nt][0] *= el.x;
      dS[nt][1] *= el.y;
      dS[nt][2] *= el.x;
      dS[nt][3] *= el.y;
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t bq[4], bk[4];
      ldb_kn(bq, &it.Qt[0][0], LD, 0, np * 16);  // B[t][c] = Qt[t][c]
      ldb_kn(bk, &it.Kt[0][0], LD, 0, np * 16);
      ptx::mma_bf16_16816(dS[2 * np], ado, bq[0], bq[1]);
      ptx::mma_bf16_16816(dS[2 * np + 1], ado, bq[2], bq[3]);
      ptx::mma_bf16_16816(dS[2 * np], adxn, bk[0], bk[1]);
      ptx::mma_bf16_16816(dS[2 * np + 1], adxn, bk[2], bk[3]);
    }
    __syncthreads();  // buffer lc & 1 free for chunk lc - 2
  }
}

// ---- backward, chunk-parallel part --------------------------------------------------------------------------
template <int D>
struct BwdChunkSmem {
  bf16 S0[D][ld_of<D>()], dS[D][ld_of<D>()];  // key-major [c][j]
  bf16 Kt[C][ld_of<D>()], Qt[C][ld_of<D>()], Kd[C][ld_of<D>()], Qr[C][ld_of<D>()], Kr[C][ld_of<D>()], Ki[C][ld_of<D>()];
  bf16 dO[C][ld_of<D>()], dX[C][ld_of<D>()], Y[C][ld_of<D>()], U[C][ld_of<D>()];
  bf16 Aw[C][kLdT], A[C][kLdT], dA[C][kLdT], dM[C][kLdT];
  float gam[C][D];   // Gamma (padded rows: g = 0)
  float dgam[C][D];  // dGamma, then (per channel) its reverse cumulative sum
  float ykd[C][D];   // dKd * Kd, the terms of dGamma_{n-1} through Kd's P
  float dgl[D];      // rowsum(S0 * dS)
  float part[D / 16][C];
  float dMd[C];  // the diagonal of dO U^T (fp32)
};

// One CTA of 2 D threads (D / 16 warps) per (chunk, head). Warp w owns output columns 16 w .. 16 w + 15 of every
// 16 x D product (value columns for Y, U, X; key channels for the gradients).
template <int D>
__global__ void __launch_bounds__(2 * D)
    bwd_chunk_kernel(KdaTrainParams p, const unsigned char* items, const float* d_o, const float* states,
                     const bf16* dstates, const float* dB, const float* dv, float* dq, float* dk, float* dg,
                     float* dbeta) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  BwdChunkSmem<D>& s = *reinterpret_cast<BwdChunkSmem<D>*>(smem_raw);
  using I = Item<D>;
  constexpr int LD = ld_of<D>(), NT = 2 * D;
  const int64_t ci = blockIdx.x;
  const int h = blockIdx.y, tid = threadIdx.x, warp = tid / 32;
  const ChunkLoc L = locate_chunk(p, ci);
  const int n = L.n;
  const int64_t row0 = L.row0, HD = int64_t(p.H) * D, hD = int64_t(h) * D;
  const unsigned char* it = items + (ci * p.H + h) * I::kBytes;
  const float* S0g = states + (ci * p.H + h) * D * D;
  const bf16* dSg = dstates + (ci * p.H + h) * D * D;

  // Phase 1: the elementwise decays (threads c < D), the state tiles, dO, dX and the item's Aw, A (all).
  if (tid < D) {
    const int c = tid;
    const int64_t base = row0 * HD + hD + c;
    float G = 0.f;
    for (int r = 0; r < C; ++r) {
      G += r < n ? p.g[base + r * HD] : 0.f;
      s.gam[r][c] = G;
    }
    const float Gl = s.gam[n - 1][c], Gm = s.gam[kMid][c];
    for (int r = 0; r < C; ++r) {
      const float qv = r < n ? p.scale * p.q[base + r * HD] : 0.f;
      const float kv = r < n ? p.k[base + r * HD] : 0.f;
      const float gr = s.gam[r][c], E = expf(gr), er = expf(gr - Gm);
      s.Qt[r][c] = __float2bfloat16_rn(qv * E);
      s.Kt[r][c] = __float2bfloat16_rn(kv * E);
      s.Kd[r][c] = __float2bfloat16_rn(kv * expf(Gl - gr));
      s.Qr[r][c] = __float2bfloat16_rn(qv * er);
      s.Kr[r][c] = __float2bfloat16_rn(kv * er);
      s.Ki[r][c] = __float2bfloat16_rn(kv * expf(Gm - gr));
    }
  }
  for (int i = tid; i < D * D / 4; i += NT) {  // S0 (fp32) -> bf16, dS copied; 4 elements per step
    const int c = (4 * i) / D, j = (4 * i) % D;
    const float4 x = *reinterpret_cast<const float4*>(S0g + 4 * i);
    *reinterpret_cast<uint32_t*>(&s.S0[c][j]) = ptx::pack_bf16x2(x.x, x.y);
    *reinterpret_cast<uint32_t*>(&s.S0[c][j + 2]) = ptx::pack_bf16x2(x.z, x.w);
    *reinterpret_cast<uint2*>(&s.dS[c][j]) = *reinterpret_cast<const uint2*>(dSg + 4 * i);
  }
  for (int i = tid; i < C * D / 2; i += NT) {
    const int r = (2 * i) / D, c = (2 * i) % D;
    float2 o = make_float2(0.f, 0.f), x = make_float2(0.f, 0.f);
    if (r < n) {
      o = *reinterpret_cast<const float2*>(d_o + (row0 + r) * HD + hD + c);
      x = *reinterpret_cast<const float2*>(dv + (row0 + r) * HD + hD + c);
    }
    *reinterpret_cast<uint32_t*>(&s.dO[r][c]) = ptx::pack_bf16x2(o.x, o.y);
    *reinterpret_cast<uint32_t*>(&s.dX[r][c]) = ptx::pack_bf16x2(x.x, x.y);
  }
  for (int i = tid; i < C * C; i += NT) {
    const int r = i / C, c = i % C;
    s.Aw[r][c] = reinterpret_cast<const bf16*>(it + I::kAw)[i];
    s.A[r][c] = reinterpret_cast<const bf16*>(it + I::kA)[i];
  }
  __syncthreads();

  const int lane = lane_id(), q = lane & 3;
  const int n0 = warp * 16;
  // rowsum(S0 * dS) per channel (threads c < D; fixed order), from the bf16 tiles.
  if (tid < D) {
    float a = 0.f;
    for (int j = 0; j < D; ++j) a = fmaf(__bfloat162float(s.S0[tid][j]), __bfloat162float(s.dS[tid][j]), a);
    s.dgl[tid] = a;
  }
  // Phase 2 (warp w, value columns n0 ..): Y = V - Kt S0, U = Aw Y, X = Y - A U, dbeta partials dB . X.
  {
    float y[2][4];
    zero2(y);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b[4];
      lda_row(a, &s.Kt[0][0], LD, ks * 16);
      ldb_kn(b, &s.S0[0][0], LD, ks * 16, n0);  // B[c][j] = S0[c][j]
      mma2(y, a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = frag_row(e), col = n0 + frag_col(j, e);
        y[j][e] = (r < n ? p.v[(row0 + r) * HD + hD + col] : 0.f) - y[j][e];
        s.Y[r][col] = __float2bfloat16_rn(y[j][e]);
      }
    __syncwarp();
    float u[2][4];
    zero2(u);
    {
      uint32_t a[4], b[4];
      lda_row(a, &s.Aw[0][0], kLdT, 0);
      ldb_kn(b, &s.Y[0][0], LD, 0, n0);  // B[s][j] = Y[s][j]
      mma2(u, a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s.U[frag_row(e)][n0 + frag_col(j, e)] = __float2bfloat16_rn(u[j][e]);
    __syncwarp();
    float au[2][4];
    zero2(au);
    {
      uint32_t a[4], b[4];
      lda_row(a, &s.A[0][0], kLdT, 0);
      ldb_kn(b, &s.U[0][0], LD, 0, n0);
      mma2(au, a, b);
    }
    float pr[2] = {0.f, 0.f};  // rows g, g + 8
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = frag_row(e), col = n0 + frag_col(j, e);
        const float x = y[j][e] - au[j][e];
        if (r < n) pr[e >> 1] = fmaf(dB[(row0 + r) * HD + hD + col], x, pr[e >> 1]);
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pr[i] += __shfl_xor_sync(0xffffffffu, pr[i], 1);
      pr[i] += __shfl_xor_sync(0xffffffffu, pr[i], 2);
    }
    if (q == 0) {
      s.part[warp][lane >> 2] = pr[0];
      s.part[warp][(lane >> 2) + 8] = pr[1];
    }
  }
  __syncthreads();  // U complete

  // Phase 3 (warp w, key channels n0 ..): dQt = dO S0^T, dKt = -dX S0^T, dKd = U dS^T; warps 0, 1: dM, dA.
  // dM keeps its strictly lower part for the pair chain; its diagonal (M_rr = Q_r . k_r, no decay) goes to dq, dk
  // directly: through Qr Ki its Gamma terms would be two O(1) products that cancel exactly, leaving bf16 noise.
  float dqt[2][4], dkt[2][4], dkd[2][4];
  zero2(dqt);
  zero2(dkt);
  zero2(dkd);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t ao[4], ax[4], au[4], bs[4], bd[4];
    lda_row(ao, &s.dO[0][0], LD, ks * 16);
    lda_row(ax, &s.dX[0][0], LD, ks * 16);
    lda_row(au, &s.U[0][0], LD, ks * 16);
    ldb_nk(bs, &s.S0[0][0], LD, n0, ks * 16);  // B[j][c] = S0[c][j]
    ldb_nk(bd, &s.dS[0][0], LD, n0, ks * 16);
    mma2(dqt, ao, bs);
    mma2(dkt, ax, bs);
    mma2(dkd, au, bd);
  }
  if (warp < 2) {
    float acc[2][4];
    zero2(acc);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b[4];
      lda_row(a, warp == 0 ? &s.dO[0][0] : &s.dX[0][0], LD, ks * 16);
      ldb_nk(b, &s.U[0][0], LD, 0, ks * 16);  // B[j][s] = U[s][j]
      mma2(acc, a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = frag_row(e), sc = frag_col(j, e);
        if (warp == 0) {
          s.dM[r][sc] = __float2bfloat16_rn(r > sc ? acc[j][e] : 0.f);
          if (r == sc) s.dMd[r] = acc[j][e];
        } else s.dA[r][sc] = __float2bfloat16_rn(r > sc ? -acc[j][e] : 0.f);
      }
  }
  __syncthreads();

  // Phase 4 (warp w, key channels n0 ..): dKr = dA Ki, dQr = dM Ki, dKi = dA^T Kr + dM^T Qr.
  float dkr[2][4], dqr[2][4], dki[2][4];
  zero2(dkr);
  zero2(dqr);
  zero2(dki);
  {
    uint32_t aa[4], am[4], aat[4], amt[4], bi[4], br[4], bq[4];
    lda_row(aa, &s.dA[0][0], kLdT, 0);
    lda_row(am, &s.dM[0][0], kLdT, 0);
    lda_trans(aat, &s.dA[0][0], kLdT, 0, 0);  // A[s][r] = dA[r][s]
    lda_trans(amt, &s.dM[0][0], kLdT, 0, 0);
    ldb_kn(bi, &s.Ki[0][0], LD, 0, n0);  // B[s][c] = Ki[s][c]
    ldb_kn(br, &s.Kr[0][0], LD, 0, n0);
    ldb_kn(bq, &s.Qr[0][0], LD, 0, n0);
    mma2(dkr, aa, bi);
    mma2(dqr, am, bi);
    mma2(dki, aat, br);
    mma2(dki, amt, bq);
  }
  // Phase 5: the elementwise chain rule per accumulator element (r, c), in fp32 from the fp32 inputs.
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = frag_row(e), c = n0 + frag_col(j, e);
      float dgam = 0.f, y = 0.f;
      if (r < n) {
        const int64_t off = (row0 + r) * HD + hD + c;
        const float qv = p.scale * p.q[off], kv = p.k[off];
        const float gr = s.gam[r][c], Gm = s.gam[kMid][c], Gl = s.gam[n - 1][c];
        const float E = expf(gr), eP = expf(Gl - gr), eR = expf(gr - Gm), eI = expf(Gm - gr);
        const float gqt = dqt[j][e], gkt = -dkt[j][e], gkd = dkd[j][e], gqr = dqr[j][e], gkr = dkr[j][e],
                    gki = dki[j][e];
        const float dmd = s.dMd[r];
        dq[off] = p.scale * (gqt * E + gqr * eR + dmd * kv);
        dk[off] = gkt * E + gkd * eP + gkr * eR + gki * eI + dmd * qv;
        y = r == n - 1 ? 0.f : gkd * (kv * eP);  // Kd_{n-1} = k_{n-1}: no dependence on Gamma
        dgam = gqt * (qv * E) + gkt * (kv * E) - y + gqr * (qv * eR) + gkr * (kv * eR) - gki * (kv * eI);
      }
      s.dgam[r][c] = dgam;
      s.ykd[r][c] = y;
    }
  __syncthreads();
  // Phase 6: dGamma_{n-1} += sum_r dKd_r Kd_r + El rowsum(S0 dS); dg = reverse cumulative sum (per channel).
  if (tid < D) {
    const int c = tid;
    float ysum = 0.f;
    for (int r = 0; r < n; ++r) ysum += s.ykd[r][c];
    float acc = expf(s.gam[n - 1][c]) * s.dgl[c] + ysum;
    for (int r = n - 1; r >= 0; --r) {
      acc += s.dgam[r][c];
      dg[(row0 + r) * HD + hD + c] = acc;
    }
  } else if (tid - D < n) {
    const int r = tid - D;
    float a = 0.f;
    for (int w = 0; w < D / 16; ++w) a += s.part[w][r];
    dbeta[(row0 + r) * p.H + h] = a;
  }
}

// ---- host side ----------------------------------------------------------------------------------------------
constexpr size_t kMaxSmem = 227 * 1024;
static_assert(sizeof(BwdChunkSmem<128>) <= kMaxSmem && sizeof(SeqSmem<128>) <= kMaxSmem,
              "shared memory over the per-block limit");

size_t item_bytes(int D) { return size_t(100 * D + 1536); }

template <class Kernel, class... Args>
void launch(Kernel kernel, bool& attr_set, dim3 grid, int threads, size_t smem, Args... args) {
  if (!attr_set) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    attr_set = true;
  }
  kernel<<<grid, threads, smem>>>(args...);
  K3_CUDA_LAUNCH_CHECK();
}

template <int D>
void run_prep(const KdaTrainParams& p, unsigned char* items) {
  prep_kernel<D><<<dim3(unsigned(p.chunks), unsigned(p.H)), 2 * D>>>(p, items);
  K3_CUDA_LAUNCH_CHECK();
}

template <int D>
dim3 seq_grid(const KdaTrainParams& p) {
  return dim3(unsigned(p.B), unsigned(p.H), unsigned(D / (16 * kSeqWarps)));
}

template <int D>
void forward(const KdaTrainParams& p, float* o, float* states, void* workspace) {
  auto* items = static_cast<unsigned char*>(workspace);
  run_prep<D>(p, items);
  static bool attr = false;
  launch(fwd_seq_kernel<D>, attr, seq_grid<D>(p), kSeqWarps * 32, sizeof(SeqSmem<D>), p,
         static_cast<const unsigned char*>(items), o, states);
}

template <int D>
void backward(const KdaTrainParams& p, const float* d_o, const float* states, float* dq, float* dk, float* dv,
              float* dg, float* dbeta, void* workspace) {
  auto* items = static_cast<unsigned char*>(workspace);
  const size_t CH = size_t(p.chunks) * size_t(p.H);
  bf16* dstates = reinterpret_cast<bf16*>(items + CH * item_bytes(D));
  float* dB = reinterpret_cast<float*>(dstates + CH * D * D);
  run_prep<D>(p, items);
  static bool attr_seq = false, attr_chunk = false;
  launch(bwd_seq_kernel<D>, attr_seq, seq_grid<D>(p), kSeqWarps * 32, sizeof(SeqSmem<D>), p,
         static_cast<const unsigned char*>(items), d_o, dstates, dB, dv);
  launch(bwd_chunk_kernel<D>, attr_chunk, dim3(unsigned(p.chunks), unsigned(p.H)), 2 * D, sizeof(BwdChunkSmem<D>), p,
         static_cast<const unsigned char*>(items), d_o, states, static_cast<const bf16*>(dstates),
         static_cast<const float*>(dB), static_cast<const float*>(dv), dq, dk, dg, dbeta);
}

}  // namespace

size_t kda_chunk_forward_train_bf16_workspace_bytes(const KdaTrainParams& p) {
  chunk_train::check_params("kda_chunk_forward_train_bf16_workspace_bytes", p);
  return size_t(p.chunks) * size_t(p.H) * item_bytes(p.D);
}

size_t kda_chunk_backward_train_bf16_workspace_bytes(const KdaTrainParams& p) {
  chunk_train::check_params("kda_chunk_backward_train_bf16_workspace_bytes", p);
  const size_t CH = size_t(p.chunks) * size_t(p.H), D = size_t(p.D);
  return CH * item_bytes(p.D) + CH * D * D * 2 + size_t(p.rows) * size_t(p.H) * D * 4;
}

void kda_chunk_forward_train_bf16(const KdaTrainParams& p, float* o, float* states, void* workspace) {
  const char* fn = "kda_chunk_forward_train_bf16";
  if (!chunk_train::check_forward(fn, p, o, states, workspace)) return;
  switch (p.D) {
    case 32: forward<32>(p, o, states, workspace); break;
    case 64: forward<64>(p, o, states, workspace); break;
    default: forward<128>(p, o, states, workspace); break;
  }
}

void kda_chunk_backward_train_bf16(const KdaTrainParams& p, const float* d_o, const float* states, float* dq, float* dk,
                                   float* dv, float* dg, float* dbeta, void* workspace) {
  const char* fn = "kda_chunk_backward_train_bf16";
  if (!chunk_train::check_backward(fn, p, d_o, states, dq, dk, dv, dg, dbeta, workspace)) return;
  switch (p.D) {
    case 32: backward<32>(p, d_o, states, dq, dk, dv, dg, dbeta, workspace); break;
    case 64: backward<64>(p, d_o, states, dq, dk, dv, dg, dbeta, workspace); break;
    default: backward<128>(p, d_o, states, dq, dk, dv, dg, dbeta, workspace); break;
  }
}

}  // namespace k3::kda::cuda
