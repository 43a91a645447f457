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
// Operands come from shared memory through ldmatrix.x4 (four 8 x 8 matrices; lanes 8i .. 8i + 7 give
// the row addresses of matrix i, and thread (g, t) receives row g, columns 2t, 2t + 1 of each; with
// .trans, rows 2t, 2t + 1 of column g):
//   - ld_a: A = rows of a row-major tile X[m][k]: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) in the
//     order a0, a1, a2, a3.
//   - ld_b_nk: B of a product X Yᵀ, Y row-major [n][k] (B[k][n] = Y[n][k]): one x4 gives b0, b1 of the
//     n-tile n0 and b0, b1 of the n-tile n0 + 8.
//   - ld_b_kn: B of a product P Y, Y row-major [k][n]: the same two n-tiles through .trans, so no tile
//     is ever stored transposed.
//   - A from accumulators: the C fragments of n-tiles 2c and 2c+1 (columns 16c .. 16c + 15) are
//     exactly the A fragment of the 16-column chunk c, rounded to bf16 (acc_to_a).
// Shared rows are W + 8 bf16 long with W a multiple of 16: the row stride in 4-byte words is
// 4 (mod 8), so the 8 rows of one ldmatrix matrix start in 8 disjoint groups of 4 banks: every
// ldmatrix is conflict-free, and every row starts on 16 bytes for cp.async.
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
#include "kernels/mla/mla_train_wgmma_cuda.cuh"

namespace k3::mla::cuda {

namespace {

using train_common::allow_smem;
using train_common::check_attention;
using train_common::check_backward;

constexpr int kThreads = 128;            // 4 warps of 16 rows each
constexpr int kFwdBM = 64, kFwdBN = 64;  // forward: queries per block x keys per tile
constexpr int kDkvBN = 64, kDkvBM = 32;  // dK/dV: keys per block x queries per tile
constexpr int kDqBM = 64, kDqBN = 32;    // dQ: queries per block x keys per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The packed operands: bf16, head-major [H][rows][W] with W = dqp (q, k) or dvp (v, dO), the head
// dims rounded up to a multiple of 16 and zero-filled past Dn + Dr or Dv.
struct AttnArgs {
  const uint16_t* q;
  const uint16_t* k;  // [k_nope | k_rot] per head (k_rot repeated for every head)
  const uint16_t* v;
  const uint16_t* d_o;  // backward only
  const float* lse2;    // [H, rows] log2(e)·lse, backward only
  const float* delta;   // [H, rows], backward only
  const int32_t* cu;
  int64_t rows;
  int H, Dn, Dr, Dv;
  int dqp, dvp;  // Dn + Dr and Dv rounded up to a multiple of 16
  float scale, scale_log2;
  bool causal;  // key s seen by query t when s <= t; else every key of the sequence
};

using ptx::cp_async16;
using ptx::cp_async4;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::quad_max;
using ptx::quad_sum;
using ptx::smem_u32;

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Byte address of element (row, col) of a shared bf16 tile at `tile` with rows of ld elements.
__device__ __forceinline__ uint32_t at(uint32_t tile, int ld, int row, int col) {
  return tile + uint32_t(row * ld + col) * 2u;
}
// The A fragment of rows row0 .. row0 + 15, columns k0 .. k0 + 15 of a row-major tile.
__device__ __forceinline__ void ld_a(uint32_t (&a)[4], uint32_t tile, int ld, int row0, int k0, int lane) {
  ptx::ldmatrix_x4(a, at(tile, ld, row0 + (lane & 15), k0 + (lane >> 4) * 8));
}
// B fragments of the n-tiles n0 and n0 + 8 at k0 .. k0 + 15 for X Yᵀ, Y row-major [n][k].
__device__ __forceinline__ void ld_b_nk(uint32_t (&b)[4], uint32_t tile, int ld, int n0, int k0, int lane) {
  ptx::ldmatrix_x4(b, at(tile, ld, n0 + (lane & 7) + ((lane >> 4) << 3), k0 + ((lane >> 3) & 1) * 8));
}
// B fragments of the n-tiles n0 and n0 + 8 at k0 .. k0 + 15 for P Y, Y row-major [k][n].
__device__ __forceinline__ void ld_b_kn(uint32_t (&b)[4], uint32_t tile, int ld, int k0, int n0, int lane) {
  ptx::ldmatrix_x4_trans(b, at(tile, ld, k0 + (lane & 7) + (((lane >> 3) & 1) << 3), n0 + ((lane >> 4) << 3)));
}
// c0 += A · B(n-tile n0), c1 += A · B(n-tile n0 + 8) for b from ld_b_nk / ld_b_kn.
__device__ __forceinline__ void mma2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  ptx::mma_bf16_16816(c0, a, b[0], b[1]);
  ptx::mma_bf16_16816(c1, a, b[2], b[3]);
}
// The A fragment of the 16-column chunk made of accumulator n-tiles c0 and c1, rounded to bf16.
__device__ __forceinline__ void acc_to_a(uint32_t (&af)[4], const float (&c0)[4], const float (&c1)[4]) {
  af[0] = ptx::pack_bf16x2(c0[0], c0[1]);
  af[1] = ptx::pack_bf16x2(c0[2], c0[3]);
  af[2] = ptx::pack_bf16x2(c1[0], c1[1]);
  af[3] = ptx::pack_bf16x2(c1[2], c1[3]);
}
template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int j = 0; j < N; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.0f;
}
// c = X[row0 .. row0 + 15] · Y[0 .. 2N·8 - 1]ᵀ over w columns (a multiple of 16): the scores and
// their gradients (S = Q Kᵀ, dP = dO Vᵀ and their transposes). X, Y row-major shared tiles.
template <int N>
__device__ __forceinline__ void rows_times_rows_t(float (&c)[N][4], uint32_t x, int ldx, int row0, uint32_t y,
                                                  int ldy, int w, int lane) {
  static_assert(N % 2 == 0, "n-tiles come in pairs");
  zero(c);
  for (int kk = 0; kk < w; kk += 16) {
    uint32_t af[4];
    ld_a(af, x, ldx, row0, kk, lane);
#pragma unroll
    for (int jp = 0; jp < N / 2; ++jp) {
      uint32_t bf[4];
      ld_b_nk(bf, y, ldy, 16 * jp, kk, lane);
      mma2(c[2 * jp], c[2 * jp + 1], af, bf);
    }
  }
}
// acc[j] += a · Y[k0 .. k0 + 15][8j .. 8j + 7] for the n-tiles j < ntiles (even; N a bucket >= it):
// one 16-row chunk of P V, dS K, Pᵀ dO or dSᵀ Q, with a from acc_to_a. Y a row-major shared tile.
template <int N>
__device__ __forceinline__ void add_chunk_times_rows(float (&acc)[N][4], const uint32_t (&a)[4], uint32_t y, int ld,
                                                     int k0, int ntiles, int lane) {
#pragma unroll
  for (int jp = 0; jp < N / 2; ++jp)
    if (2 * jp < ntiles) {
      uint32_t bf[4];
      ld_b_kn(bf, y, ld, k0, 16 * jp, lane);
      mma2(acc[2 * jp], acc[2 * jp + 1], a, bf);
    }
}

// Queues the copy of rows [r0, r0 + n) of one sequence's packed operand (src: its row 0; w elements a
// row, a multiple of 8) into the shared tile at dst (rows of ld elements), 16 bytes per cp.async.
// Rows at or past len are zero-filled without a read.
__device__ __forceinline__ void copy_rows(uint32_t dst, int ld, const uint16_t* src, int w, int r0, int n, int len) {
  const int segs = w >> 3;
  for (int i = threadIdx.x; i < n * segs; i += kThreads) {
    const int r = i / segs, s = i - r * segs;
    const bool ok = r0 + r < len;
    cp_async16(at(dst, ld, r, 8 * s), src + int64_t(ok ? r0 + r : 0) * w + 8 * s, ok ? 16 : 0);
  }
}
// Queues log2(e)·lse and Delta of rows [r0, r0 + n) (src: the sequence's row 0 of this head) into
// dst_l[n] and dst_d[n]; 0 past len (those rows are masked wherever they are used).
__device__ __forceinline__ void copy_stats(uint32_t dst_l, uint32_t dst_d, const float* lse2, const float* delta,
                                           int r0, int n, int len) {
  for (int i = threadIdx.x; i < 2 * n; i += kThreads) {
    const bool second = i >= n;
    const int r = second ? i - n : i;
    const bool ok = r0 + r < len;
    cp_async4((second ? dst_d : dst_l) + 4u * r, (second ? delta : lse2) + (ok ? r0 + r : 0), ok ? 4 : 0);
  }
}

// ---------------------------------------------------------------------------------------------
// Packing: one warp per (row, head), lanes over pairs of columns, bf16 round-to-nearest-even.

__device__ __forceinline__ void store_pair(uint16_t* dst, int c, float x0, float x1) {
  *reinterpret_cast<uint32_t*>(dst + c) = ptx::pack_bf16x2(x0, x1);
}

__global__ void __launch_bounds__(256)
    pack_qkv_kernel(uint16_t* __restrict__ qp, uint16_t* __restrict__ kp, uint16_t* __restrict__ vp,
                    const float* __restrict__ q, int64_t ldq, const float* __restrict__ kv, int64_t ldkv,
                    const float* __restrict__ k_rot, int64_t ldr, int64_t rows, int H, int Dn, int Dr, int Dv, int dqp,
                    int dvp) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (w >= rows * H) return;
  const int64_t r = w / H;
  const int h = int(w - r * H), dqk = Dn + Dr;
  const float* qr = q + r * ldq + int64_t(h) * dqk;
  const float* kn = kv + r * ldkv + int64_t(h) * (Dn + Dv);
  const float* kr = k_rot + r * ldr;  // read only for Dr > 0
  const int64_t hr = int64_t(h) * rows + r;
  auto qv = [&](int c) { return c < dqk ? qr[c] : 0.0f; };
  auto kval = [&](int c) { return c < Dn ? kn[c] : c < dqk ? kr[c - Dn] : 0.0f; };
  auto vv = [&](int c) { return c < Dv ? kn[Dn + c] : 0.0f; };
  for (int c = 2 * lane; c < dqp; c += 64) {
    store_pair(qp + hr * dqp, c, qv(c), qv(c + 1));
    store_pair(kp + hr * dqp, c, kval(c), kval(c + 1));
  }
  for (int c = 2 * lane; c < dvp; c += 64) store_pair(vp + hr * dvp, c, vv(c), vv(c + 1));
}

// ---------------------------------------------------------------------------------------------
// Forward: block = 64 queries [m0, m0 + 64) of one (sequence, head), warp w owns queries
// m0 + 16w .. + 15; 64-key tiles 0.. up to the causal end min(len, m0 + 64), double-buffered (the
// next tile's cp.async runs under this tile's products). NV = 8-column n-tiles of O held per thread
// (a bucket >= dvp / 8).

size_t fwd_smem_bytes(int dqp, int dvp) {
  return size_t(kFwdBM * (dqp + 8) + 2 * kFwdBN * (dqp + 8) + 2 * kFwdBN * (dvp + 8)) * sizeof(uint16_t);
}

template <int NV>
__global__ void __launch_bounds__(kThreads, 2)
    attn_fwd_tc_kernel(const AttnArgs a, float* __restrict__ o, int64_t ldo, float* __restrict__ lse) {
  extern __shared__ float4 smem4[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kFwdBM;  // the heaviest (latest) query blocks first
  if (m0 >= len) return;
  const int LQ = a.dqp + 8, LV = a.dvp + 8, nvt = a.dvp / 8;
  const uint32_t sQ = smem_u32(smem4);             // [64 queries][LQ]
  const uint32_t sK0 = sQ + kFwdBM * LQ * 2;       // 2 stages of [64 keys][LQ]
  const uint32_t sV0 = sK0 + 2 * kFwdBN * LQ * 2;  // 2 stages of [64 keys][LV]
  const uint32_t k_stage = kFwdBN * LQ * 2, v_stage = kFwdBN * LV * 2;
  const int64_t hrow = int64_t(h) * a.rows + base;
  const uint16_t *qs = a.q + hrow * a.dqp, *ks = a.k + hrow * a.dqp, *vs = a.v + hrow * a.dvp;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int wq0 = m0 + warp * 16;  // the warp's first query
  const int kv_end = a.causal ? min(len, m0 + kFwdBM) : len, tiles = (kv_end + kFwdBN - 1) / kFwdBN;

  copy_rows(sQ, LQ, qs, a.dqp, m0, kFwdBM, len);
  copy_rows(sK0, LQ, ks, a.dqp, 0, kFwdBN, len);
  copy_rows(sV0, LV, vs, a.dvp, 0, kFwdBN, len);
  cp_async_commit();

  float acc[NV][4];
  zero(acc);
  // Rows g and g + 8 of the warp: running max (log2 units of the scaled scores) and this thread's
  // partial sum of the probabilities (its 16 columns of every tile; the quad's sum at the end).
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  for (int it = 0; it < tiles; ++it) {
    const int n0 = it * kFwdBN;
    const uint32_t sK = sK0 + (it & 1) * k_stage, sV = sV0 + (it & 1) * v_stage;
    if (it + 1 < tiles) {  // the stage it fills was last read before the previous iteration's barrier
      copy_rows(sK0 + ((it + 1) & 1) * k_stage, LQ, ks, a.dqp, n0 + kFwdBN, kFwdBN, len);
      copy_rows(sV0 + ((it + 1) & 1) * v_stage, LV, vs, a.dvp, n0 + kFwdBN, kFwdBN, len);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the tile just queued has landed
    __syncthreads();
    if ((!a.causal || n0 <= wq0 + 15) && wq0 < len) {  // else every (query, key) of the warp is masked
      float s[8][4];
      rows_times_rows_t(s, sQ, LQ, warp * 16, sK, LQ, a.dqp, lane);

      // Online softmax; s[j][e] is (query wq0 + g + 8(e/2), key n0 + 8j + 2t4 + e%2). Masked: -inf.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = wq0 + g + 8 * (e >> 1), key = n0 + 8 * j + 2 * t4 + (e & 1);
          const float x = ((key <= t || !a.causal) && key < len) ? s[j][e] * a.scale_log2 : -INFINITY;
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
        if (a.causal && n0 + 16 * c > wq0 + 15) continue;
        uint32_t pa[4];
        acc_to_a(pa, s[2 * c], s[2 * c + 1]);
        add_chunk_times_rows(acc, pa, sV, LV, 16 * c, nvt, lane);
      }
    }
    __syncthreads();  // this stage is read by no warp any more
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
// stride the columns, a double sum reduced by a fixed xor tree, rounded once. The same warp writes
// lse2 = log2(e)·lse and packs bf16(dO) (AttnArgs::d_o).
__global__ void __launch_bounds__(256)
    attn_delta_tc_kernel(float* __restrict__ delta, float* __restrict__ lse2, uint16_t* __restrict__ dop,
                         const float* __restrict__ d_o, const float* __restrict__ o, int64_t ldo,
                         const float* __restrict__ lse, int64_t rows, int H, int Dv, int dvp) {
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
  const int64_t hr = int64_t(h) * rows + r;
  if (lane == 0) {
    delta[hr] = float(acc);
    lse2[hr] = lse[hr] * kLog2e;
  }
  for (int c = 2 * lane; c < dvp; c += 64)
    store_pair(dop + hr * dvp, c, c < Dv ? x[c] : 0.0f, c + 1 < Dv ? x[c + 1] : 0.0f);
}

size_t dkv_smem_bytes(int dqp, int dvp) {
  return 4 * kDkvBM * sizeof(float) +
         size_t(kDkvBN * (dqp + 8) + kDkvBN * (dvp + 8) + 2 * kDkvBM * (dqp + 8) + 2 * kDkvBM * (dvp + 8)) *
             sizeof(uint16_t);
}

// dK and dV of the keys [n0, n0 + 64) of one (sequence, head), warp w owning keys n0 + 16w .. + 15:
// loops over the 32-query tiles from the one holding key n0 to the sequence's end, double-buffered.
// Per tile, with keys s as rows and queries t as columns: Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (fp32
// accumulators), then Pᵀ_st = exp(scale·Sᵀ_st - lse_t), dSᵀ_st = Pᵀ_st (dPᵀ_st - Delta_t), masked to
// s <= t < len by selection; dV += bf16(Pᵀ) dO and dK += bf16(dSᵀ) Q. dK is scaled once at the end;
// its rot columns go to the per-head scratch dk_rot_h.
// NQ, NV: 8-column n-tiles of dK and dV per thread (buckets >= dqp / 8, dvp / 8).
template <int NQ, int NV>
__global__ void __launch_bounds__(kThreads, 2)
    attn_bwd_dkv_tc_kernel(const AttnArgs a, float* __restrict__ dkv, int64_t lddkv, float* __restrict__ dk_rot_h) {
  extern __shared__ float4 smem4[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int n0 = blockIdx.x * kDkvBN;  // the heaviest (earliest) key blocks first
  if (n0 >= len) return;
  const int dqk = a.Dn + a.Dr, LQ = a.dqp + 8, LV = a.dvp + 8;
  const int nqt = a.dqp / 8, nvt = a.dvp / 8;
  const float* stats = reinterpret_cast<const float*>(smem4);  // 2 stages of {log2(e)·lse [32], Delta [32]}
  const uint32_t sStat0 = smem_u32(smem4);
  const uint32_t sK = sStat0 + 4 * kDkvBM * 4;      // [64 keys][LQ]
  const uint32_t sV = sK + kDkvBN * LQ * 2;         // [64 keys][LV]
  const uint32_t sQ0 = sV + kDkvBN * LV * 2;        // 2 stages of [32 queries][LQ]
  const uint32_t sdO0 = sQ0 + 2 * kDkvBM * LQ * 2;  // 2 stages of [32 queries][LV]
  const uint32_t q_stage = kDkvBM * LQ * 2, o_stage = kDkvBM * LV * 2;
  const int64_t hrow = int64_t(h) * a.rows + base;
  const uint16_t *qs = a.q + hrow * a.dqp, *ks = a.k + hrow * a.dqp, *vs = a.v + hrow * a.dvp,
                 *os = a.d_o + hrow * a.dvp;
  const float *ls = a.lse2 + hrow, *ds = a.delta + hrow;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int wk0 = n0 + warp * 16;  // the warp's first key
  const int m_first = a.causal ? n0 / kDkvBM * kDkvBM : 0, tiles = (len - m_first + kDkvBM - 1) / kDkvBM;

  auto queue_tile = [&](int it) {  // Q, dO and statistics of query tile `it` into stage it & 1
    const int m0 = m_first + it * kDkvBM, st = it & 1;
    copy_rows(sQ0 + st * q_stage, LQ, qs, a.dqp, m0, kDkvBM, len);
    copy_rows(sdO0 + st * o_stage, LV, os, a.dvp, m0, kDkvBM, len);
    copy_stats(sStat0 + st * 2 * kDkvBM * 4, sStat0 + (st * 2 + 1) * kDkvBM * 4, ls, ds, m0, kDkvBM, len);
  };
  copy_rows(sK, LQ, ks, a.dqp, n0, kDkvBN, len);
  copy_rows(sV, LV, vs, a.dvp, n0, kDkvBN, len);
  queue_tile(0);
  cp_async_commit();

  float dk[NQ][4], dv[NV][4];
  zero(dk);
  zero(dv);
  for (int it = 0; it < tiles; ++it) {
    const int m0 = m_first + it * kDkvBM;
    const uint32_t sQ = sQ0 + (it & 1) * q_stage, sdO = sdO0 + (it & 1) * o_stage;
    const float *sL = stats + (it & 1) * 2 * kDkvBM, *sD = sL + kDkvBM;
    if (it + 1 < tiles) queue_tile(it + 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (wk0 < len && (!a.causal || m0 + kDkvBM - 1 >= wk0)) {  // else no key, or every query precedes them
      float st[4][4], dpt[4][4];
      rows_times_rows_t(st, sK, LQ, warp * 16, sQ, LQ, a.dqp, lane);
      rows_times_rows_t(dpt, sV, LV, warp * 16, sdO, LV, a.dvp, lane);
      // st[j][e] is (key wk0 + g + 8(e/2), query m0 + 8j + 2t4 + e%2): Pᵀ into st, dSᵀ into dpt.
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = wk0 + g + 8 * (e >> 1), qi = 8 * j + 2 * t4 + (e & 1), t = m0 + qi;
          const bool seen = (key <= t || !a.causal) && key < len && t < len;
          const float p = seen ? exp2f(st[j][e] * a.scale_log2 - sL[qi]) : 0.0f;
          dpt[j][e] = seen ? p * (dpt[j][e] - sD[qi]) : 0.0f;
          st[j][e] = p;
        }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if (a.causal && m0 + 16 * c + 15 < wk0) continue;  // the chunk's queries precede the keys: P = dS = 0
        uint32_t pa[4], da[4];
        acc_to_a(pa, st[2 * c], st[2 * c + 1]);
        acc_to_a(da, dpt[2 * c], dpt[2 * c + 1]);
        add_chunk_times_rows(dv, pa, sdO, LV, 16 * c, nvt, lane);
        add_chunk_times_rows(dk, da, sQ, LQ, 16 * c, nqt, lane);
      }
    }
    __syncthreads();
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
         size_t(kDqBM * (dqp + 8) + kDqBM * (dvp + 8) + 2 * kDqBN * (dqp + 8) + 2 * kDqBN * (dvp + 8)) *
             sizeof(uint16_t);
}

// dQ of the queries [m0, m0 + 64) of one (sequence, head), warp w owning queries m0 + 16w .. + 15:
// loops over the 32-key tiles up to the causal end, double-buffered. S = Q Kᵀ, dP = dO Vᵀ, dS as in
// the dK/dV kernel, then dQ += bf16(dS) K, scaled at the end.
// NQ: 8-column n-tiles of dQ per thread (a bucket >= dqp / 8).
template <int NQ>
__global__ void __launch_bounds__(kThreads, 2)
    attn_bwd_dq_tc_kernel(const AttnArgs a, float* __restrict__ dq, int64_t lddq) {
  extern __shared__ float4 smem4[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int64_t base = a.cu[b];
  const int len = a.cu[b + 1] - a.cu[b];
  const int m0 = (gridDim.x - 1 - blockIdx.x) * kDqBM;  // the heaviest (latest) query blocks first
  if (m0 >= len) return;
  const int dqk = a.Dn + a.Dr, LQ = a.dqp + 8, LV = a.dvp + 8, nqt = a.dqp / 8;
  const float* sL = reinterpret_cast<const float*>(smem4);  // [64] log2(e)·lse
  const float* sD = sL + kDqBM;                             // [64] Delta
  const uint32_t sStat = smem_u32(smem4);
  const uint32_t sQ = sStat + 2 * kDqBM * 4;      // [64 queries][LQ]
  const uint32_t sdO = sQ + kDqBM * LQ * 2;       // [64 queries][LV]
  const uint32_t sK0 = sdO + kDqBM * LV * 2;      // 2 stages of [32 keys][LQ]
  const uint32_t sV0 = sK0 + 2 * kDqBN * LQ * 2;  // 2 stages of [32 keys][LV]
  const uint32_t k_stage = kDqBN * LQ * 2, v_stage = kDqBN * LV * 2;
  const int64_t hrow = int64_t(h) * a.rows + base;
  const uint16_t *qs = a.q + hrow * a.dqp, *ks = a.k + hrow * a.dqp, *vs = a.v + hrow * a.dvp,
                 *os = a.d_o + hrow * a.dvp;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int wq0 = m0 + warp * 16;  // the warp's first query
  const int kv_end = a.causal ? min(len, m0 + kDqBM) : len, tiles = (kv_end + kDqBN - 1) / kDqBN;

  copy_rows(sQ, LQ, qs, a.dqp, m0, kDqBM, len);
  copy_rows(sdO, LV, os, a.dvp, m0, kDqBM, len);
  copy_stats(sStat, sStat + kDqBM * 4, a.lse2 + hrow, a.delta + hrow, m0, kDqBM, len);
  copy_rows(sK0, LQ, ks, a.dqp, 0, kDqBN, len);
  copy_rows(sV0, LV, vs, a.dvp, 0, kDqBN, len);
  cp_async_commit();

  float acc[NQ][4];
  zero(acc);
  for (int it = 0; it < tiles; ++it) {
    const int n0 = it * kDqBN;
    const uint32_t sK = sK0 + (it & 1) * k_stage, sV = sV0 + (it & 1) * v_stage;
    if (it + 1 < tiles) {
      copy_rows(sK0 + ((it + 1) & 1) * k_stage, LQ, ks, a.dqp, n0 + kDqBN, kDqBN, len);
      copy_rows(sV0 + ((it + 1) & 1) * v_stage, LV, vs, a.dvp, n0 + kDqBN, kDqBN, len);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if ((!a.causal || n0 <= wq0 + 15) && wq0 < len) {  // else every (query, key) of the warp is masked
      float s[4][4], dp[4][4];
      rows_times_rows_t(s, sQ, LQ, warp * 16, sK, LQ, a.dqp, lane);
      rows_times_rows_t(dp, sdO, LV, warp * 16, sV, LV, a.dvp, lane);
      // s[j][e] is (query wq0 + g + 8(e/2), key n0 + 8j + 2t4 + e%2): dS into s.
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = warp * 16 + g + 8 * (e >> 1), t = m0 + qi, key = n0 + 8 * j + 2 * t4 + (e & 1);
          const bool seen = (key <= t || !a.causal) && key < len && t < len;
          const float p = seen ? exp2f(s[j][e] * a.scale_log2 - sL[qi]) : 0.0f;
          s[j][e] = seen ? p * (dp[j][e] - sD[qi]) : 0.0f;
        }
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if (a.causal && n0 + 16 * c > wq0 + 15) continue;  // keys past the warp's last query: dS = 0
        uint32_t da[4];
        acc_to_a(da, s[2 * c], s[2 * c + 1]);
        add_chunk_times_rows(acc, da, sK, LQ, 16 * c, nqt, lane);
      }
    }
    __syncthreads();
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
int pad16(int64_t x) { return int((x + 15) / 16 * 16); }
size_t round256(size_t x) { return (x + 255) / 256 * 256; }

// Byte offsets of the workspaces' parts. Forward: the packed q, k, v. Backward: Delta [H, rows],
// log2(e)·lse [H, rows], the per-head dk_rot [H, rows, Dr] (fp32), then the packed q, k, v, dO.
struct Layout {
  size_t delta, lse2, dk_rot_h, q, k, v, d_o, end;
};
Layout layout(int64_t rows, const Dims& d, bool backward) {
  const size_t hr = size_t(d.H * rows), qk = round256(hr * pad16(d.Dn + d.Dr) * 2), vo = round256(hr * pad16(d.Dv) * 2);
  Layout L{};
  if (backward) {
    L.lse2 = train_common::delta_bytes(rows, d);  // Delta first, then log2(e)·lse
    L.dk_rot_h = 2 * L.lse2;
    L.q = L.dk_rot_h + round256(hr * size_t(d.Dr) * sizeof(float));
  }
  L.k = L.q + qk, L.v = L.k + qk, L.d_o = L.v + vo;
  L.end = L.d_o + (backward ? vo : 0);
  return L;
}
size_t workspace_bytes(const char* fn, int64_t rows, const Dims& d, bool backward) {
  K3_CHECK(rows >= 0 && d.H >= 1 && d.Dn >= 0 && d.Dr >= 0 && d.Dv >= 0, fn, ": bad rows = ", rows, " or dims (H ", d.H,
           ", Dn ", d.Dn, ", Dr ", d.Dr, ", Dv ", d.Dv, ")");
  return layout(rows, d, backward).end;
}
template <class T>
T* part(void* ws, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + offset);
}

template <class Kernel, class... Args>
void launch(Kernel kernel, dim3 grid, size_t smem, Args... args) {
  kernel<<<grid, kThreads, smem>>>(args...);
  K3_CUDA_LAUNCH_CHECK();
}
// Blocks of 256 threads for one warp per (row, head).
unsigned warp_blocks(const char* fn, int64_t rows, int64_t H) {
  const int64_t blocks = (rows * H * 32 + 255) / 256;
  K3_CHECK(blocks <= INT32_MAX, fn, ": rows*H = ", rows * H, " is too large");
  return unsigned(blocks);
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

// Packs q, k = [k_nope | k_rot], v into the workspace at L's offsets and returns the kernels'
// arguments over them.
AttnArgs pack_operands(const char* fn, void* ws, const Layout& L, const float* q, int64_t ldq, const float* kv,
                       int64_t ldkv, const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int64_t rows,
                       const Dims& d, float scale, bool causal) {
  AttnArgs a{};
  a.causal = causal;
  a.cu = cu_seqlens, a.rows = rows;
  a.H = int(d.H), a.Dn = int(d.Dn), a.Dr = int(d.Dr), a.Dv = int(d.Dv);
  a.dqp = pad16(a.Dn + a.Dr), a.dvp = pad16(a.Dv);
  a.scale = scale, a.scale_log2 = scale * kLog2e;
  uint16_t *qp = part<uint16_t>(ws, L.q), *kp = part<uint16_t>(ws, L.k), *vp = part<uint16_t>(ws, L.v);
  pack_qkv_kernel<<<warp_blocks(fn, rows, d.H), 256>>>(qp, kp, vp, q, ldq, kv, ldkv, k_rot, ldr, rows, a.H, a.Dn, a.Dr,
                                                       a.Dv, a.dqp, a.dvp);
  K3_CUDA_LAUNCH_CHECK();
  a.q = qp, a.k = kp, a.v = vp;
  return a;
}

// The Hopper kernels' view of the packed operands.
wgmma::PackedQkv packed_qkv(const AttnArgs& a) { return {a.q, a.k, a.v, a.cu, a.rows, a.H, a.Dv, a.scale_log2}; }

}  // namespace

size_t attention_forward_workspace_bytes_bf16(int64_t rows, const Dims& d) {
  return workspace_bytes("mla::cuda::attention_forward_workspace_bytes_bf16", rows, d, false);
}

void attention_forward_train_bf16(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq, const float* kv,
                                  int64_t ldkv, const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int B,
                                  int64_t max_len, int64_t rows, const Dims& d, float scale, void* workspace,
                                  bool causal) {
  constexpr const char* fn = "mla::cuda::attention_forward_train_bf16";
  check_attention(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale);
  K3_CHECK(ldo >= d.H * d.Dv, fn, ": ldo = ", ldo, " < H*Dv = ", d.H * d.Dv);
  if (rows == 0 || B == 0) return;
  K3_CHECK(o && lse && q && kv && cu_seqlens && (k_rot || d.Dr == 0), fn, ": null device pointer");
  K3_CHECK(workspace, fn, ": workspace is null (attention_forward_workspace_bytes_bf16 = ",
           attention_forward_workspace_bytes_bf16(rows, d), " bytes)");
  const AttnArgs a = pack_operands(fn, workspace, layout(rows, d, false), q, ldq, kv, ldkv, k_rot, ldr, cu_seqlens,
                                   rows, d, scale, causal);
  if (causal && wgmma::dims_fit(a.dqp, a.dvp, a.Dv))  // K3's head dims: the Hopper kernel (causal only)
    return wgmma::attention_forward(packed_qkv(a), o, ldo, lse, B, max_len);
  switch (tiles_bucket(a.dvp)) {
    case 8: return launch_fwd<8>(a, o, ldo, lse, B, max_len);
    case 16: return launch_fwd<16>(a, o, ldo, lse, B, max_len);
    case 24: return launch_fwd<24>(a, o, ldo, lse, B, max_len);
    default: return launch_fwd<32>(a, o, ldo, lse, B, max_len);
  }
}

size_t attention_backward_workspace_bytes_bf16(int64_t rows, const Dims& d) {
  return workspace_bytes("mla::cuda::attention_backward_workspace_bytes_bf16", rows, d, true);
}

void attention_backward_train_bf16(float* dq, int64_t lddq, float* dkv, int64_t lddkv, float* dk_rot, int64_t lddr,
                                   const float* d_o, int64_t ldo, const float* o, const float* q, int64_t ldq,
                                   const float* kv, int64_t ldkv, const float* k_rot, int64_t ldr, const float* lse,
                                   const int32_t* cu_seqlens, int B, int64_t max_len, int64_t rows, const Dims& d,
                                   float scale, void* workspace, bool causal) {
  constexpr const char* fn = "mla::cuda::attention_backward_train_bf16";
  check_backward(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale, ldo, lddq, lddkv, lddr);
  if (rows == 0 || B == 0) return;
  K3_CHECK(dq && dkv && d_o && o && q && kv && lse && cu_seqlens && (d.Dr == 0 || (k_rot && dk_rot)), fn,
           ": null device pointer");
  K3_CHECK(workspace, fn, ": workspace is null (attention_backward_workspace_bytes_bf16 = ",
           attention_backward_workspace_bytes_bf16(rows, d), " bytes)");
  const Layout L = layout(rows, d, true);
  AttnArgs a = pack_operands(fn, workspace, L, q, ldq, kv, ldkv, k_rot, ldr, cu_seqlens, rows, d, scale, causal);
  float *delta = part<float>(workspace, L.delta), *lse2 = part<float>(workspace, L.lse2);
  float* dk_rot_h = part<float>(workspace, L.dk_rot_h);
  uint16_t* dop = part<uint16_t>(workspace, L.d_o);
  attn_delta_tc_kernel<<<warp_blocks(fn, rows, d.H), 256>>>(delta, lse2, dop, d_o, o, ldo, lse, rows, int(d.H),
                                                            int(d.Dv), a.dvp);
  K3_CUDA_LAUNCH_CHECK();
  a.d_o = dop, a.lse2 = lse2, a.delta = delta;
  if (causal && wgmma::dims_fit(a.dqp, a.dvp, a.Dv)) {  // K3's head dims: the Hopper kernels (causal only)
    wgmma::attention_backward(packed_qkv(a), wgmma::PackedGrad{dop, lse2, delta, a.Dn, a.Dr, a.scale}, dq, lddq, dkv,
                              lddkv, dk_rot_h, B, max_len);
  } else {
    switch (tiles_bucket(a.dqp)) {
      case 8: dispatch_bwd<8>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
      case 16: dispatch_bwd<16>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
      case 24: dispatch_bwd<24>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
      default: dispatch_bwd<32>(a, dq, lddq, dkv, lddkv, dk_rot_h, B, max_len); break;
    }
  }
  if (d.Dr > 0) {
    const int64_t n = rows * d.Dr;
    const unsigned grid = unsigned(std::min<int64_t>((n + 255) / 256, 65535));
    train_common::dk_rot_sum(grid, dk_rot, lddr, dk_rot_h, rows, int(d.H), int(d.Dr));
  }
}

}  // namespace k3::mla::cuda
