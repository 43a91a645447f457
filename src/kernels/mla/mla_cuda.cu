// Gated MLA attention on the GPU: flash prefill (expanded form) and split-K absorbed decode.
// See mla_cuda.h for the API and shapes; the CPU twin is mla_cpu.cpp.
//
// Both kernels are warp-level tensor-core code (mma.sync.m16n8k16 bf16 -> fp32, ldmatrix from
// padded shared memory, cp.async double buffering). A row stride of D+8 bf16 (D a multiple of 64,
// or of 16 for the decode tiles) puts the 8 rows of every ldmatrix in 8 distinct 16-byte bank
// groups, so the loads are conflict-free without a swizzle.
//
// Numerics (the CPU side: docs/NUMERICS.md, "MLA"): scores, running max, sums and outputs in fp32;
// the probabilities are rounded to bf16 for the P·V product (the FlashAttention-2 choice), the sum
// l uses the unrounded fp32 values; ex2.approx with log2(e)*scale folded into the score scaling. Masked scores
// are -inf by selection, and a row with nothing seen yet keeps max -inf and uses 0 as its
// subtrahend, so exp2(-inf) = 0 and no inf-inf NaN appears. Tiles past T are zero-filled (not
// left stale), since a masked p = 0 times a stale NaN would still be NaN.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "core/cuda_check.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/mla/mla_cuda.h"

namespace k3::mla::cuda {

namespace {

// ---------------------------------------------------------------------------------------------
// Warp-level primitives.

// Shared PTX wrappers: kernels/common/mma_sm80.cuh. When !pred the destination is zero-filled
// and nothing is read.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  ptx::cp_async16(dst, src, pred ? 16 : 0);
}

using ptx::quad_max;
using ptx::quad_sum;

// 2^x by the SFU (ex2.approx.ftz: ~2 ulp; 2^-inf = +0, which the masking relies on).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// Prefill: one block = 64 queries of one (sequence, head), 4 warps of 16 query rows each; loops
// over 64-key tiles up to the block's causal end. Q stays in registers (A fragments), K and V go
// through two shared-memory stages; the next tile's cp.async overlaps the current tile's math.
//
// Accumulator layout (mma C fragment): thread (g = lane/4, t = lane%4) holds rows g and g+8 of the
// warp's 16, columns 8j+2t and 8j+2t+1 of n-tile j. The C fragments of two adjacent key n-tiles
// are exactly the A fragment of a 16-key chunk, so P goes from S to the P·V product in registers.

constexpr int kPfBM = 64, kPfBN = 64, kPfThreads = 128;

struct PrefillArgs {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  void* o;
  int o_f32;
  int n, p0, T, H, dqk, dv;
  float scale_log2;
};

template <int DQK, int DV>
struct PrefillSmem {
  static constexpr int LQ = DQK + 8, LV = DV + 8;  // padded row lengths in bf16
  static constexpr int kQ = kPfBM * LQ, kK = kPfBN * LQ, kV = kPfBN * LV;
  static constexpr size_t bytes = size_t(kQ + 2 * kK + 2 * kV) * 2;
};

// kExact: the runtime dims equal the template's (DQK, DV), so every guard folds away.
template <int DQK, int DV, bool kExact>
__global__ void __launch_bounds__(kPfThreads, 2) mla_prefill_kernel(const PrefillArgs a) {
  using S = PrefillSmem<DQK, DV>;
  constexpr int KK = DQK / 16, DP = DV / 16;  // 16-wide chunks of the qk dim, 16-wide pairs of the v dim
  constexpr int CQ = DQK / 8, CV = DV / 8;    // 16-byte chunks per row (bucket)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* sK = sQ + S::kQ;
  __nv_bfloat16* sV = sK + 2 * S::kK;

  const int dqk = kExact ? DQK : a.dqk, dv = kExact ? DV : a.dv;
  const int nkk = dqk / 16, ndp = dv / 16, ncq = dqk / 8, ncv = dv / 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (latest) query blocks first
  const int h = blockIdx.y, b = blockIdx.z;
  const int m0 = m_block * kPfBM;
  const int kv_end = min(a.T, a.p0 + m0 + kPfBM);  // keys 0..kv_end-1 are seen by some row here
  const int n_tiles = (kv_end + kPfBN - 1) / kPfBN;
  const int64_t H = a.H;

  // Loads of one 64-row tile: rows past `rows` are zero-filled.
  auto load_rows = [&](__nv_bfloat16* dst, int ld, const __nv_bfloat16* src, int64_t row_stride, int row0, int rows,
                       int nchunk_bucket, int nchunk) {
    for (int idx = tid; idx < 64 * nchunk_bucket; idx += kPfThreads) {
      const int r = idx / nchunk_bucket, c = idx % nchunk_bucket;
      if (c < nchunk) {
        const bool ok = row0 + r < rows;
        const __nv_bfloat16* s = ok ? src + int64_t(row0 + r) * row_stride + c * 8 : src;
        cp_async16(ptx::smem_u32(dst + r * ld + c * 8), s, ok);
      }
    }
  };
  const __nv_bfloat16* qg = a.q + (int64_t(b) * a.n * H + h) * dqk;  // row i at qg + i*H*dqk
  const __nv_bfloat16* kg = a.k + (int64_t(b) * a.T * H + h) * dqk;
  const __nv_bfloat16* vg = a.v + (int64_t(b) * a.T * H + h) * dv;
  auto load_kv = [&](int tile, int stage) {
    load_rows(sK + stage * S::kK, S::LQ, kg, H * dqk, tile * kPfBN, a.T, CQ, ncq);
    load_rows(sV + stage * S::kV, S::LV, vg, H * dv, tile * kPfBN, a.T, CV, ncv);
  };
  load_rows(sQ, S::LQ, qg, H * dqk, m0, a.n, CQ, ncq);
  load_kv(0, 0);
  ptx::cp_async_commit();

  uint32_t qf[KK][4];
  float o[2 * DP][4];
#pragma unroll
  for (int j = 0; j < 2 * DP; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  const int row_w = m0 + warp * 16;                    // first query row (index within the n) of this warp
  const int pos0 = a.p0 + row_w + g, pos1 = pos0 + 8;  // positions of this thread's two rows

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    ptx::cp_async_wait<0>();
    __syncthreads();  // tile's K/V (and Q) visible to all; everyone done with the other stage
    if (tile + 1 < n_tiles) load_kv(tile + 1, stage ^ 1);
    ptx::cp_async_commit();
    if (tile == 0) {
#pragma unroll
      for (int kk = 0; kk < KK; ++kk)
        if (kExact || kk < nkk)
          ptx::ldmatrix_x4(qf[kk], ptx::smem_u32(sQ + (warp * 16 + (lane & 15)) * S::LQ + kk * 16 + (lane >> 4) * 8));
    }

    // S = Q K^T for this warp's 16 rows x 64 keys.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const __nv_bfloat16* k_st = sK + stage * S::kK;
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      if (kExact || kk < nkk) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bf[4];
          ptx::ldmatrix_x4(bf, ptx::smem_u32(k_st + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * S::LQ + kk * 16 +
                                             ((lane >> 3) & 1) * 8));
          ptx::mma_bf16_16816(s[2 * np], qf[kk], bf[0], bf[1]);
          ptx::mma_bf16_16816(s[2 * np + 1], qf[kk], bf[2], bf[3]);
        }
      }
    }

    // Scale into the log2 domain and mask (causal and past T) by selection.
    const int key0 = tile * kPfBN;
    const bool need_mask = key0 + kPfBN - 1 > a.p0 + row_w || key0 + kPfBN > a.T;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * a.scale_log2;
        if (need_mask) {
          const int key = key0 + j * 8 + 2 * t + (e & 1), pos = e < 2 ? pos0 : pos1;
          if (key > pos || key >= a.T) x = -INFINITY;
        }
        s[j][e] = x;
      }
    }
    // Online softmax: new running max, rescale of O and l, probabilities.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m_r[r], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = fast_exp2(m_r[r] - m_use);
      m_r[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[j][2 * r] = fast_exp2(s[j][2 * r] - m_use);
        s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] - m_use);
        sum += s[j][2 * r] + s[j][2 * r + 1];
      }
      l_r[r] = l_r[r] * alpha + sum;
#pragma unroll
      for (int j = 0; j < 2 * DP; ++j) {
        o[j][2 * r] *= alpha;
        o[j][2 * r + 1] *= alpha;
      }
    }

    // O += P V: P from registers (bf16), V^T fragments by ldmatrix.trans.
    const __nv_bfloat16* v_st = sV + stage * S::kV;
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      uint32_t pa[4];
      pa[0] = ptx::pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
      pa[1] = ptx::pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
      pa[2] = ptx::pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      pa[3] = ptx::pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DP; ++dp) {
        if (kExact || dp < ndp) {
          uint32_t bf[4];
          ptx::ldmatrix_x4_trans(bf, ptx::smem_u32(v_st + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::LV +
                                                   dp * 16 + (lane >> 4) * 8));
          ptx::mma_bf16_16816(o[2 * dp], pa, bf[0], bf[1]);
          ptx::mma_bf16_16816(o[2 * dp + 1], pa, bf[2], bf[3]);
        }
      }
    }
  }

  // Epilogue: O / l for the rows that exist.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_r[r]);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int i = row_w + g + 8 * r;
    if (i >= a.n) continue;
    const int64_t base = ((int64_t(b) * a.n + i) * H + h) * dv;
#pragma unroll
    for (int j = 0; j < 2 * DP; ++j) {
      const int col = j * 8 + 2 * t;
      if (!kExact && col >= dv) continue;
      const float x0 = o[j][2 * r] * inv, x1 = o[j][2 * r + 1] * inv;
      if (a.o_f32) *reinterpret_cast<float2*>(static_cast<float*>(a.o) + base + col) = make_float2(x0, x1);
      else *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(a.o) + base + col) = ptx::pack_bf16x2(x0, x1);
    }
  }
}

template <int DQK, int DV, bool kExact>
void launch_prefill(const PrefillArgs& a, int B) {
  constexpr size_t smem = PrefillSmem<DQK, DV>::bytes;
  static bool configured = false;  // once per instantiation (one device)
  if (!configured) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(mla_prefill_kernel<DQK, DV, kExact>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       int(smem)));
    configured = true;
  }
  const dim3 grid((a.n + kPfBM - 1) / kPfBM, a.H, B);
  mla_prefill_kernel<DQK, DV, kExact><<<grid, kPfThreads, smem>>>(a);
  K3_CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------------
// Decode (absorbed): one block = 64 (token, head) rows of one sequence x one split of the keys.
// Row r of the tile is token i = r / H, head h = r % H; its causal limit is key <= p0 + i. The
// Q tile [64, R+Dr] (q_lat | q_rot, bf16) sits in shared memory; cache tiles of 32 rows go through
// two cp.async stages. 8 warps: warp w works on row group rg = w % 4 (16 rows) and half c = w / 4:
//   scores:  warp (rg, c) computes S for its 16 rows x keys 16c..16c+15 of the tile (K = R+Dr);
//   softmax: the two halves exchange their row maxima through shared memory, so both hold the
//            same running max; P (bf16) goes to shared memory;
//   P·V:     warp (rg, c) accumulates O for its 16 rows x the 16-column groups dp with dp % 2 == c
//            (V = the latent columns of the same cache rows), so O is 16 x R/2 per warp.
// Each half keeps its own partial l (the same alphas scale both); they are summed at the end.
// With one split the block writes o_lat = O / l; else it writes O, m, l of its split to the
// workspace and mla_decode_combine merges the splits.

constexpr int kDcBM = 64, kDcBN = 32, kDcThreads = 256;

struct DecodeArgs {
  const void* q_lat;
  const void* q_rot;
  int q_f32;
  const __nv_bfloat16* cache;
  int64_t ldc, cache_stride_b;
  float* o_lat;
  float* ws_o;   // [splits][B*n*H][R]
  float* ws_ml;  // [splits][B*n*H][2]
  const __nv_bfloat16* const* seq_cache;  // [B] or nullptr
  const int32_t* seq_p0;                  // [B] or nullptr
  int n, p0, T, H, R, Dr, splits, chunk;
  float scale_log2;
};

template <int R_T, int DR_T>
struct DecodeSmem {
  static constexpr int LD = R_T + DR_T + 8, LP = kDcBN + 8;
  static constexpr int kQ = kDcBM * LD, kC = kDcBN * LD, kP = kDcBM * LP;
  static constexpr size_t bytes = size_t(kQ + 2 * kC + kP) * 2 + 2 * 2 * kDcBM * sizeof(float);
};

template <int R_T, int DR_T, bool kExact>
__global__ void __launch_bounds__(kDcThreads, 1) mla_decode_kernel(const DecodeArgs a) {
  pdl::wait_then_release();
  using S = DecodeSmem<R_T, DR_T>;
  constexpr int KD_T = R_T + DR_T, KK = KD_T / 16, CC = KD_T / 8, JD = R_T / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* sC = sQ + S::kQ;
  __nv_bfloat16* sP = sC + 2 * S::kC;
  float* red_max = reinterpret_cast<float*>(sP + S::kP);  // [2][64]
  float* red_l = red_max + 2 * kDcBM;                     // [2][64]

  const int R = kExact ? R_T : a.R, Dr = kExact ? DR_T : a.Dr, KD = R + Dr;
  const int nkk = KD / 16, ncc = KD / 8;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int rg = warp & 3, half = warp >> 2;
  const int split = blockIdx.x, mt = blockIdx.y, b = blockIdx.z;
  const int rows = a.n * a.H;  // (token, head) rows of one sequence
  const int r0 = mt * kDcBM;
  const int64_t R64 = R;
  // This sequence's cached length and rows (per sequence when the lists are given).
  const int p0 = a.seq_p0 ? a.seq_p0[b] : a.p0, T = p0 + a.n;

  // Keys of this split that some row of the tile can see.
  const int last_row = min(rows, r0 + kDcBM) - 1;
  const int ks = split * a.chunk;
  const int ke = min(min(T, ks + a.chunk), p0 + last_row / a.H + 1);
  const int n_tiles = ke > ks ? (ke - ks + kDcBN - 1) / kDcBN : 0;

  const __nv_bfloat16* cg = a.seq_cache ? a.seq_cache[b] : a.cache + int64_t(b) * a.cache_stride_b;
  auto load_tile = [&](int tile, int stage) {
    __nv_bfloat16* dst = sC + stage * S::kC;
    const int key0 = ks + tile * kDcBN;
    for (int idx = tid; idx < kDcBN * CC; idx += kDcThreads) {
      const int r = idx / CC, c = idx % CC;
      if (c < ncc) {
        const bool ok = key0 + r < ke;
        const __nv_bfloat16* s = ok ? cg + int64_t(key0 + r) * a.ldc + c * 8 : cg;
        cp_async16(ptx::smem_u32(dst + r * S::LD + c * 8), s, ok);
      }
    }
  };
  if (n_tiles > 0) load_tile(0, 0);
  ptx::cp_async_commit();

  // Q tile: [q_lat | q_rot] of each row as bf16; rows past the end are zero.
  for (int idx = tid; idx < kDcBM * CC; idx += kDcThreads) {
    const int r = idx / CC, c = idx % CC;
    if (c >= ncc) continue;
    const int row = r0 + r;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row < rows) {
      const int64_t grow = int64_t(b) * rows + row;  // (b, i, h) flattened = b*n*H + i*H + h
      const bool lat = c * 8 < R;
      const int64_t off = lat ? grow * R64 + c * 8 : grow * Dr + (c * 8 - R);
      const void* src = lat ? a.q_lat : a.q_rot;
      if (a.q_f32) {
        const float4 x0 = *reinterpret_cast<const float4*>(static_cast<const float*>(src) + off);
        const float4 x1 = *reinterpret_cast<const float4*>(static_cast<const float*>(src) + off + 4);
        val = make_uint4(ptx::pack_bf16x2(x0.x, x0.y), ptx::pack_bf16x2(x0.z, x0.w), ptx::pack_bf16x2(x1.x, x1.y),
                         ptx::pack_bf16x2(x1.z, x1.w));
      } else {
        val = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(src) + off);
      }
    }
    *reinterpret_cast<uint4*>(sQ + r * S::LD + c * 8) = val;
  }

  float o[JD][2][4];
#pragma unroll
  for (int jd = 0; jd < JD; ++jd)
#pragma unroll
    for (int u = 0; u < 2; ++u) o[jd][u][0] = o[jd][u][1] = o[jd][u][2] = o[jd][u][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  const int lrow0 = rg * 16 + g;  // this thread's rows in the tile: lrow0, lrow0 + 8
  int lim[2];                     // causal limit (last visible key) of each row; -1 for absent rows
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = r0 + lrow0 + 8 * r;
    lim[r] = row < rows ? p0 + row / a.H : -1;
  }

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    ptx::cp_async_wait<0>();
    __syncthreads();  // tile (and Q) visible; the other stage, P and the reductions are free
    if (tile + 1 < n_tiles) load_tile(tile + 1, stage ^ 1);
    ptx::cp_async_commit();
    const __nv_bfloat16* c_st = sC + stage * S::kC;

    // Scores: 16 rows x 16 keys (two n-tiles) over K = R + Dr.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll 4
    for (int kk = 0; kk < KK; ++kk) {
      if (kExact || kk < nkk) {
        uint32_t qa[4], bf[4];
        ptx::ldmatrix_x4(qa, ptx::smem_u32(sQ + (rg * 16 + (lane & 15)) * S::LD + kk * 16 + (lane >> 4) * 8));
        ptx::ldmatrix_x4(bf, ptx::smem_u32(c_st + (half * 16 + (lane & 7) + ((lane >> 4) << 3)) * S::LD + kk * 16 +
                                           ((lane >> 3) & 1) * 8));
        ptx::mma_bf16_16816(s[0], qa, bf[0], bf[1]);
        ptx::mma_bf16_16816(s[1], qa, bf[2], bf[3]);
      }
    }
    const int key0 = ks + tile * kDcBN + half * 16;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + j * 8 + 2 * t + (e & 1), r = e >> 1;
        const float x = key < ke && key <= lim[r] ? s[j][e] * a.scale_log2 : -INFINITY;
        s[j][e] = x;
        mx[r] = fmaxf(mx[r], x);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = quad_max(mx[r]);
      if (t == 0) red_max[half * kDcBM + lrow0 + 8 * r] = mx[r];
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int lr = lrow0 + 8 * r;
      const float m_new = fmaxf(m_r[r], fmaxf(red_max[lr], red_max[kDcBM + lr]));
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;
      const float alpha = fast_exp2(m_r[r] - m_use);
      m_r[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float p0 = fast_exp2(s[j][2 * r] - m_use), p1 = fast_exp2(s[j][2 * r + 1] - m_use);
        sum += p0 + p1;
        *reinterpret_cast<uint32_t*>(sP + lr * S::LP + half * 16 + j * 8 + 2 * t) = ptx::pack_bf16x2(p0, p1);
      }
      l_r[r] = l_r[r] * alpha + sum;
#pragma unroll
      for (int jd = 0; jd < JD; ++jd)
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          o[jd][u][2 * r] *= alpha;
          o[jd][u][2 * r + 1] *= alpha;
        }
    }
    __syncthreads();  // P complete

    // O += P V over the tile's 32 keys, for this warp's column groups.
#pragma unroll
    for (int kc = 0; kc < kDcBN / 16; ++kc) {
      uint32_t pa[4];
      ptx::ldmatrix_x4(pa, ptx::smem_u32(sP + (rg * 16 + (lane & 15)) * S::LP + kc * 16 + (lane >> 4) * 8));
#pragma unroll
      for (int jd = 0; jd < JD; ++jd) {
        const int dp = 2 * jd + half;
        if (kExact || dp * 16 < R) {
          uint32_t bf[4];
          ptx::ldmatrix_x4_trans(bf, ptx::smem_u32(c_st + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::LD +
                                                   dp * 16 + (lane >> 4) * 8));
          ptx::mma_bf16_16816(o[jd][0], pa, bf[0], bf[1]);
          ptx::mma_bf16_16816(o[jd][1], pa, bf[2], bf[3]);
        }
      }
    }
  }

  // Epilogue: total l of each row = the two halves' sums.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_r[r]);
    if (t == 0) red_l[half * kDcBM + lrow0 + 8 * r] = l;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int lr = lrow0 + 8 * r, row = r0 + lr;
    if (row >= rows) continue;
    const float l = red_l[lr] + red_l[kDcBM + lr];
    const int64_t grow = int64_t(b) * rows + row;
    float* dst;
    float mul;
    if (a.splits == 1) {
      dst = a.o_lat + grow * R64;
      mul = l > 0.0f ? 1.0f / l : 0.0f;
    } else {
      const int64_t all_rows = int64_t(gridDim.z) * rows;
      dst = a.ws_o + (int64_t(split) * all_rows + grow) * R64;
      mul = 1.0f;
      if (half == 0 && t == 0)
        *reinterpret_cast<float2*>(a.ws_ml + (int64_t(split) * all_rows + grow) * 2) = make_float2(m_r[r], l);
    }
#pragma unroll
    for (int jd = 0; jd < JD; ++jd)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int col = (2 * jd + half) * 16 + u * 8 + 2 * t;
        if (!kExact && col >= R) continue;
        *reinterpret_cast<float2*>(dst + col) = make_float2(o[jd][u][2 * r] * mul, o[jd][u][2 * r + 1] * mul);
      }
  }
}

// o_lat[row] = Σ_s 2^(m_s - M) O_s / Σ_s 2^(m_s - M) l_s, M = max_s m_s. One block per row.
__global__ void mla_decode_combine(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                   float* __restrict__ o_lat, int64_t all_rows, int R, int splits) {
  pdl::wait_then_release();
  const int64_t row = blockIdx.x;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ws_ml[(s * all_rows + row) * 2]);
  const float m_use = M == -INFINITY ? 0.0f : M;
  float L = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float2 ml = *reinterpret_cast<const float2*>(ws_ml + (s * all_rows + row) * 2);
    L += fast_exp2(ml.x - m_use) * ml.y;
  }
  const float inv = L > 0.0f ? 1.0f / L : 0.0f;
  for (int col = threadIdx.x; col < R; col += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float w = fast_exp2(ws_ml[(s * all_rows + row) * 2] - m_use);
      acc += w * ws_o[(s * all_rows + row) * R + col];
    }
    o_lat[row * R + col] = acc * inv;
  }
}

template <int R_T, int DR_T, bool kExact>
void launch_decode(const DecodeArgs& a, int m_tiles, int B) {
  constexpr size_t smem = DecodeSmem<R_T, DR_T>::bytes;
  static bool configured = false;
  if (!configured) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(mla_decode_kernel<R_T, DR_T, kExact>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
  const dim3 grid(a.splits, m_tiles, B);
  pdl::launch(mla_decode_kernel<R_T, DR_T, kExact>, grid, kDcThreads, smem, a);
  K3_CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------------
// Host side: checks, planning, dispatch.

std::string misaligned(const char* name, const void* p) {
  if (p == nullptr) return std::string(name) + " is null";
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return std::string(name) + " is not 16-byte aligned";
  return "";
}

constexpr int64_t kIntMax = 2147483647;

struct SplitPlan {
  int splits, chunk;
};

SplitPlan plan_splits(const DecodeParams& p) {
  const int64_t T = p.p0 + p.n;
  if (p.split_keys > 0) {  // fixed splits: a sequence's arithmetic is independent of the others' lengths
    const int64_t chunk = (p.split_keys + kDcBN - 1) / kDcBN * kDcBN;
    return {int((T + chunk - 1) / chunk), int(chunk)};
  }
  const int64_t m_tiles = (p.n * p.d.H + kDcBM - 1) / kDcBM;
  int64_t splits = p.num_splits;
  if (splits <= 0) {
    int dev = 0, sms = 0;
    K3_CUDA_CHECK(cudaGetDevice(&dev));
    K3_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    // One wave of blocks (one block per SM fits: ~150 KB of shared memory), each split at least
    // 128 keys (4 tiles) so its fixed costs (the Q tile, the partial output) stay small.
    splits = std::max<int64_t>(1, (sms + p.B * m_tiles - 1) / (p.B * m_tiles));
    splits = std::min<int64_t>(splits, (T + 127) / 128);
  }
  splits = std::clamp<int64_t>(splits, 1, std::max<int64_t>(1, (T + kDcBN - 1) / kDcBN));
  int64_t chunk = (T + splits - 1) / splits;
  chunk = (chunk + kDcBN - 1) / kDcBN * kDcBN;
  splits = (T + chunk - 1) / chunk;  // no empty trailing split
  return {int(splits), int(chunk)};
}

}  // namespace

std::string can_run(const PrefillParams& p) {
  const Dims& d = p.d;
  if (d.H <= 0 || d.H > 65535) return "H = " + std::to_string(d.H) + ": must be in 1..65535";
  if (d.Dn < 0 || d.Dr < 0 || d.Dn + d.Dr <= 0)
    return "Dn = " + std::to_string(d.Dn) + ", Dr = " + std::to_string(d.Dr) + ": need Dn + Dr > 0";
  if (d.Dn % 16 != 0) return "Dn = " + std::to_string(d.Dn) + ": the CUDA prefill needs a multiple of 16";
  if (d.Dr % 16 != 0) return "Dr = " + std::to_string(d.Dr) + ": the CUDA prefill needs a multiple of 16";
  if (d.Dn + d.Dr > 256) return "Dn + Dr = " + std::to_string(d.Dn + d.Dr) + ": the CUDA prefill takes at most 256";
  if (d.Dv <= 0 || d.Dv % 16 != 0)
    return "Dv = " + std::to_string(d.Dv) + ": the CUDA prefill needs a positive multiple of 16";
  if (d.Dv > 128) return "Dv = " + std::to_string(d.Dv) + ": the CUDA prefill takes at most 128";
  if (p.B <= 0 || p.B > 65535) return "B = " + std::to_string(p.B) + ": must be in 1..65535";
  if (p.n < 0 || p.p0 < 0) return "n = " + std::to_string(p.n) + ", p0 = " + std::to_string(p.p0) + ": must be >= 0";
  if (p.p0 + p.n > kIntMax / 2) return "T = p0 + n = " + std::to_string(p.p0 + p.n) + ": too long";
  if (p.n == 0) return "";
  const std::pair<const char*, const void*> ptrs[] = {{"q", p.q}, {"k", p.k}, {"v", p.v}, {"o", p.o}};
  for (const auto& [name, ptr] : ptrs) {
    const std::string e = misaligned(name, ptr);
    if (!e.empty()) return e;
  }
  return "";
}

void prefill(const PrefillParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("mla::cuda::prefill: ", why);
  if (p.n == 0) return;
  const Dims& d = p.d;
  PrefillArgs a{};
  a.q = reinterpret_cast<const __nv_bfloat16*>(p.q);
  a.k = reinterpret_cast<const __nv_bfloat16*>(p.k);
  a.v = reinterpret_cast<const __nv_bfloat16*>(p.v);
  a.o = p.o;
  a.o_f32 = p.o_type == Dtype::F32;
  a.n = int(p.n);
  a.p0 = int(p.p0);
  a.T = int(p.p0 + p.n);
  a.H = int(d.H);
  a.dqk = int(d.Dn + d.Dr);
  a.dv = int(d.Dv);
  a.scale_log2 = float(double(kLog2e) / std::sqrt(double(a.dqk)));
  const int B = int(p.B);
  if (a.dqk == 192 && a.dv == 128) launch_prefill<192, 128, true>(a, B);
  else if (a.dqk <= 64 && a.dv <= 64) launch_prefill<64, 64, false>(a, B);
  else if (a.dqk <= 128) launch_prefill<128, 128, false>(a, B);
  else launch_prefill<256, 128, false>(a, B);
}

std::string can_run(const DecodeParams& p) {
  const Dims& d = p.d;
  if (d.H <= 0) return "H = " + std::to_string(d.H) + ": must be positive";
  if (d.R <= 0 || d.R % 16 != 0)
    return "R = " + std::to_string(d.R) + ": the CUDA decode needs a positive multiple of 16";
  if (d.R > 512) return "R = " + std::to_string(d.R) + ": the CUDA decode takes at most 512";
  if (d.Dr < 0 || d.Dr % 16 != 0) return "Dr = " + std::to_string(d.Dr) + ": the CUDA decode needs a multiple of 16";
  if (d.Dr > 64) return "Dr = " + std::to_string(d.Dr) + ": the CUDA decode takes at most 64";
  if (d.Dn < 0 || d.Dn + d.Dr <= 0)
    return "Dn = " + std::to_string(d.Dn) + ": the scale 1/sqrt(Dn + Dr) needs Dn + Dr > 0";
  if (p.ldc < d.R + d.Dr || p.ldc % 8 != 0)
    return "ldc = " + std::to_string(p.ldc) + ": must be >= R + Dr = " + std::to_string(d.R + d.Dr) +
           " and a multiple of 8";
  if (p.B <= 0 || p.B > 65535) return "B = " + std::to_string(p.B) + ": must be in 1..65535";
  if (p.n <= 0 || p.p0 < 0)
    return "n = " + std::to_string(p.n) + ", p0 = " + std::to_string(p.p0) + ": need n >= 1, p0 >= 0";
  const int64_t T = p.p0 + p.n;
  if (T > kIntMax / 2) return "T = p0 + n = " + std::to_string(T) + ": too long";
  if (p.n * d.H > kIntMax / 2) return "n * H = " + std::to_string(p.n * d.H) + ": too many rows";
  if ((p.n * d.H + kDcBM - 1) / kDcBM > 65535) return "n * H = " + std::to_string(p.n * d.H) + ": too many rows";
  if (p.cache_stride_b != 0 && (p.cache_stride_b < T * p.ldc || p.cache_stride_b % 8 != 0))
    return "cache_stride_b = " + std::to_string(p.cache_stride_b) + ": must be 0 or >= T * ldc and a multiple of 8";
  if (p.num_splits < 0) return "num_splits = " + std::to_string(p.num_splits) + ": must be >= 0";
  if (p.split_keys < 0 || p.split_keys > kIntMax / 2)
    return "split_keys = " + std::to_string(p.split_keys) + ": must be in 0..2^30";
  if ((p.seq_p0 != nullptr) != (p.seq_cache != nullptr)) return "seq_p0 and seq_cache go together";
  // Per-sequence rows come as a device list of pointers (8-byte aligned; each row buffer is the start of a
  // DeviceBuffer, 256-byte aligned); else the rows themselves are read by 16 bytes.
  if (p.seq_cache && reinterpret_cast<uintptr_t>(p.seq_cache) % 8 != 0) return "seq_cache is not 8-byte aligned";
  const std::pair<const char*, const void*> ptrs[] = {{"q_lat", p.q_lat}, {"o_lat", p.o_lat}, {"cache", p.cache}};
  const size_t checked = p.seq_cache ? 2 : 3;  // (cache is unused with seq_cache)
  for (size_t i = 0; i < checked; ++i) {
    const std::string e = misaligned(ptrs[i].first, ptrs[i].second);
    if (!e.empty()) return e;
  }
  if (d.Dr > 0) {
    const std::string e = misaligned("q_rot", p.q_rot);
    if (!e.empty()) return e;
  }
  return "";
}

int decode_splits(const DecodeParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("mla::cuda::decode_splits: ", why);
  return plan_splits(p).splits;
}

size_t decode_workspace_bytes(const DecodeParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("mla::cuda::decode_workspace_bytes: ", why);
  const SplitPlan sp = plan_splits(p);
  if (sp.splits == 1) return 0;
  return size_t(sp.splits) * size_t(p.B * p.n * p.d.H) * size_t(p.d.R + 2) * sizeof(float);
}

void decode(const DecodeParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("mla::cuda::decode: ", why);
  const Dims& d = p.d;
  const SplitPlan sp = plan_splits(p);
  const int64_t all_rows = p.B * p.n * d.H;
  const size_t need = sp.splits == 1 ? 0 : size_t(sp.splits) * size_t(all_rows) * size_t(d.R + 2) * sizeof(float);
  if (need > 0 && (p.workspace == nullptr || p.workspace_bytes < need))
    fail("mla::cuda::decode: workspace of ", p.workspace_bytes, " bytes given, ", need, " needed for ", sp.splits,
         " splits (decode_workspace_bytes)");
  if (need > 0 && reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0)
    fail("mla::cuda::decode: workspace is not 16-byte aligned");
  DecodeArgs a{};
  a.q_lat = p.q_lat;
  a.q_rot = d.Dr > 0 ? p.q_rot : p.q_lat;
  a.q_f32 = p.q_type == Dtype::F32;
  a.cache = reinterpret_cast<const __nv_bfloat16*>(p.cache);
  a.ldc = p.ldc;
  a.cache_stride_b = p.cache_stride_b != 0 ? p.cache_stride_b : (p.p0 + p.n) * p.ldc;
  a.o_lat = p.o_lat;
  a.seq_cache = reinterpret_cast<const __nv_bfloat16* const*>(p.seq_cache);
  a.seq_p0 = p.seq_p0;
  a.ws_o = static_cast<float*>(p.workspace);
  a.ws_ml = a.ws_o ? a.ws_o + size_t(sp.splits) * size_t(all_rows) * size_t(d.R) : nullptr;
  a.n = int(p.n);
  a.p0 = int(p.p0);
  a.T = int(p.p0 + p.n);
  a.H = int(d.H);
  a.R = int(d.R);
  a.Dr = int(d.Dr);
  a.splits = sp.splits;
  a.chunk = sp.chunk;
  a.scale_log2 = float(double(kLog2e) / std::sqrt(double(d.Dn + d.Dr)));
  const int m_tiles = int((p.n * d.H + kDcBM - 1) / kDcBM), B = int(p.B);
  if (d.R == 512 && d.Dr == 64) launch_decode<512, 64, true>(a, m_tiles, B);
  else if (d.R <= 128) launch_decode<128, 64, false>(a, m_tiles, B);
  else launch_decode<512, 64, false>(a, m_tiles, B);
  if (sp.splits > 1) {
    pdl::launch(mla_decode_combine, unsigned(all_rows), 128, 0, a.ws_o, a.ws_ml, p.o_lat, all_rows, a.R, sp.splits);
    K3_CUDA_LAUNCH_CHECK();
  }
}

namespace {
__global__ void append_rows_kernel(__nv_bfloat16* const* seq_rows, int64_t ldc, const int32_t* seq_p0, const float* src,
                                   int64_t width, int64_t B) {
  pdl::wait_then_release();
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= B * width) return;
  const int64_t b = i / width, c = i % width;
  seq_rows[b][int64_t(seq_p0[b]) * ldc + c] = __float2bfloat16_rn(src[i]);
}
}  // namespace

void append_rows(uint16_t* const* seq_rows, int64_t ldc, const int32_t* seq_p0, const float* src, int64_t width,
                 int64_t B) {
  K3_CHECK(B >= 0 && width >= 0 && width <= ldc, "mla::cuda::append_rows: bad shape B=", B, " width=", width,
           " ldc=", ldc);
  if (B == 0 || width == 0) return;
  const int64_t n = B * width;
  pdl::launch(append_rows_kernel, unsigned((n + 255) / 256), 256, 0, reinterpret_cast<__nv_bfloat16* const*>(seq_rows),
              ldc, seq_p0, src, width, B);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::mla::cuda
