// KDA chunked forward on tensor cores (sm_90a): the prepare kernel and the recurrence kernel.
// Contract, algebra and numerics: kda_cuda.h. Fragment layouts (mma.sync.m16n8k16, lane = 4 r + q):
//   A (16x16, row): reg0 = A[r][2q..2q+1]  reg1 = A[r+8][2q..]  reg2 = A[r][2q+8..]  reg3 = A[r+8][2q+8..]
//   B (16x8, col):  reg0 = B[2q..2q+1][r]  reg1 = B[2q+8..2q+9][r]
//   C (16x8):       c0,c1 = C[r][2q..2q+1]  c2,c3 = C[r+8][2q..2q+1]
// The C tiles of a 16x16 block, packed in pairs, are exactly the A operand of the next product (the
// FlashAttention P -> A trick); the recurrence keeps the state transposed (S^T) to use it.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/cuda.h"
#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/kda/kda_cuda.h"

namespace k3::kda::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;  // 16
// Every kernel and layout below is templated on the head dim D (Dk = Dv = D) in {32, 64, 128}.

// ---- small device helpers -------------------------------------------------------------------------------
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }

// x0, x1 -> hi pair and lo pair (x = hi + lo to ~2^-17 relative).
__device__ __forceinline__ void split_pack(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<uint32_t*>(&h);
  lo = *reinterpret_cast<uint32_t*>(&l);
}

// Shared PTX wrappers (kernels/common/mma_sm80.cuh) take 32-bit shared-window addresses.
using ptx::cp_async_commit;
using ptx::cp_async_wait;

// ---- workspace layout ------------------------------------------------------------------------------------
// One item per (b, chunk, h), item index (b*NC + n)*H + h. P = 1 (bf16 inputs) or 2 (fp32 inputs: a hi and
// a lo plane of every bf16 tile). Offsets in bf16 elements unless named _B (bytes):
//   Qw  [P][16][D]   Kw [P][16][D]   Krn [P][16][D] (= -Kr)   Awn [P][16][16] (= -Aw)   Mw [P][16][16]
//   gamma [D] fp32   (P = 2 only) V [2][16][D]
template <int P, int D>
struct Ws {
  static constexpr int kQW = 0;
  static constexpr int kKW = P * C * D;
  static constexpr int kKR = 2 * P * C * D;
  static constexpr int kAW = 3 * P * C * D;
  static constexpr int kMW = kAW + P * C * C;
  static constexpr int kGM_B = (kMW + P * C * C) * 2;
  static constexpr int kV_B = kGM_B + D * 4;
  static constexpr int kItem_B = kV_B + (P == 2 ? 2 * C * D * 2 : 0);
  static_assert(kGM_B % 16 == 0 && kV_B % 16 == 0 && kItem_B % 16 == 0, "workspace tiles must be 16-byte aligned");
};
static_assert(Ws<1, 128>::kItem_B == 13824 && Ws<2, 128>::kItem_B == 35328, "kda_cuda.h documents these sizes");
static_assert(Ws<1, 64>::kItem_B == 7424 && Ws<2, 64>::kItem_B == 18688, "kda_cuda.h documents these sizes");
static_assert(Ws<1, 32>::kItem_B == 4224 && Ws<2, 32>::kItem_B == 10368, "kda_cuda.h documents these sizes");

template <int P>
__device__ __forceinline__ void put(bf16* plane0, int plane_stride, int idx, float x) {
  const bf16 h = __float2bfloat16_rn(x);
  plane0[idx] = h;
  if constexpr (P == 2) plane0[plane_stride + idx] = __float2bfloat16_rn(x - __bfloat162float(h));
}
template <int P>
__device__ __forceinline__ void put2(bf16* plane0, int plane_stride, int idx, float x0, float x1) {
  uint32_t hi, lo;
  split_pack(x0, x1, hi, lo);
  *reinterpret_cast<uint32_t*>(plane0 + idx) = hi;
  if constexpr (P == 2) *reinterpret_cast<uint32_t*>(plane0 + plane_stride + idx) = lo;
}

struct Args {
  int64_t B, T, H, NC;
  float scale;
  const void* q;
  const void* k;
  const void* v;
  const float* g;
  const float* beta;
  const float* state_in;
  float* state_out;
  void* o;
  unsigned char* ws;
};

// =========================================================================================================
// Kernel 1: prepare. One CTA of NT = max(D, 64) threads per (b, chunk, h) (phases 2 and 4 need two warps);
// thread c < D owns key channel c in phase 1. Shared memory (fp32, rows padded to D + 8 floats, i.e. a row
// shift of 8 banks, so the float2 fragment reads of 8 rows x 4 lanes hit 32 distinct banks): Qd, Kd, Ki
// [16][D+8]; L, M, Aw, Mw [16][17]. All MMAs use split operands (3 products).
template <int D>
constexpr int prep_threads() {
  return D < 64 ? 64 : D;
}

struct FragF {  // builds bf16 fragments (hi, lo) from fp32 shared memory
  // A operand from row-major X[16][ld], k-step at column k0.
  __device__ __forceinline__ static void a_rows(uint32_t (&hi)[4], uint32_t (&lo)[4], const float* X, int ld, int k0,
                                                int r, int q) {
    const float2 x0 = *reinterpret_cast<const float2*>(X + r * ld + k0 + 2 * q);
    const float2 x1 = *reinterpret_cast<const float2*>(X + (r + 8) * ld + k0 + 2 * q);
    const float2 x2 = *reinterpret_cast<const float2*>(X + r * ld + k0 + 8 + 2 * q);
    const float2 x3 = *reinterpret_cast<const float2*>(X + (r + 8) * ld + k0 + 8 + 2 * q);
    split_pack(x0.x, x0.y, hi[0], lo[0]);
    split_pack(x1.x, x1.y, hi[1], lo[1]);
    split_pack(x2.x, x2.y, hi[2], lo[2]);
    split_pack(x3.x, x3.y, hi[3], lo[3]);
  }
  // A operand from a [16][17] scalar tile (unaligned rows): the same fragment, element by element.
  __device__ __forceinline__ static void a_small(uint32_t (&hi)[4], uint32_t (&lo)[4], const float* X, int r, int q) {
    constexpr int ld = 17;
    split_pack(X[r * ld + 2 * q], X[r * ld + 2 * q + 1], hi[0], lo[0]);
    split_pack(X[(r + 8) * ld + 2 * q], X[(r + 8) * ld + 2 * q + 1], hi[1], lo[1]);
    split_pack(X[r * ld + 2 * q + 8], X[r * ld + 2 * q + 9], hi[2], lo[2]);
    split_pack(X[(r + 8) * ld + 2 * q + 8], X[(r + 8) * ld + 2 * q + 9], hi[3], lo[3]);
  }
  // B operand where B[k][n] = Y[n0 + n][k0 + k] (Y stored [n][k], k contiguous): B = Y^T.
  __device__ __forceinline__ static void b_nk(uint32_t (&hi)[2], uint32_t (&lo)[2], const float* Y, int ld, int n0,
                                              int k0, int r, int q) {
    const float2 y0 = *reinterpret_cast<const float2*>(Y + (n0 + r) * ld + k0 + 2 * q);
    const float2 y1 = *reinterpret_cast<const float2*>(Y + (n0 + r) * ld + k0 + 8 + 2 * q);
    split_pack(y0.x, y0.y, hi[0], lo[0]);
    split_pack(y1.x, y1.y, hi[1], lo[1]);
  }
  // B operand where B[k][n] = Y[k][n0 + n] (Y stored [k][n], n contiguous), k over all 16 rows.
  __device__ __forceinline__ static void b_kn(uint32_t (&hi)[2], uint32_t (&lo)[2], const float* Y, int ld, int n0,
                                              int r, int q) {
    split_pack(Y[(2 * q) * ld + n0 + r], Y[(2 * q + 1) * ld + n0 + r], hi[0], lo[0]);
    split_pack(Y[(2 * q + 8) * ld + n0 + r], Y[(2 * q + 9) * ld + n0 + r], hi[1], lo[1]);
  }
};

// d += a * b with split operands: hi*hi + lo*hi + hi*lo.
__device__ __forceinline__ void mma_split(float (&d)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
  ptx::mma_bf16_16816(d, ah, bh[0], bh[1]);
  ptx::mma_bf16_16816(d, al, bh[0], bh[1]);
  ptx::mma_bf16_16816(d, ah, bl[0], bl[1]);
}

// Resident CTAs of the prepare kernel asked of the compiler (a register cap). The kernel is latency-
// bound: each CTA runs five phases separated by barriers, two to four of its warps idle in phases
// 2-4, so the SM hides that latency only with other CTAs. Uncapped, D = 128 takes 80 registers (6 CTAs
// of 128 threads per SM); 64 registers (a small spill) and the shared Ki space below fit 8, which was
// the fastest of 6, 7 and 8 (docs/CUDA.md, "The prepare kernel's occupancy").
// KdaParams::prepare_cap keeps the other two for the comparison in bench_cuda_kda.
template <int D>
constexpr int prep_min_blocks() {
  return D == 128 ? 8 : 1;
}

template <class TI, int P, int D, int MinBlocks>
__global__ void __launch_bounds__(prep_threads<D>(), MinBlocks) kda_prepare_kernel(Args a) {
  static_assert(D == 32 || D == 64 || D == 128, "head dim");
  using W = Ws<P, D>;
  constexpr int kLdF = D + 8;
  constexpr int NT = prep_threads<D>();
  constexpr int kTilesPerWarp = (D / 8) / (NT / 32);  // phase 5: 8-channel column tiles per warp (4, 4, 2)
  static_assert(kTilesPerWarp * (NT / 32) * 8 == D, "phase 5 covers every channel once");
  __shared__ __align__(16) float sQd[C][kLdF];
  __shared__ __align__(16) float sKd[C][kLdF];
  // Ki is read only in phase 2; the four 16x16 tiles L, M, Aw, Mw are written from the end of phase 2
  // on (after a barrier), so they share its space: 4.25 KB less per CTA, which with the register cap
  // (prep_min_blocks) lets 8 CTAs share an SM at D = 128.
  constexpr int kKiFloats = C * kLdF > 4 * C * 17 ? C * kLdF : 4 * C * 17;
  __shared__ __align__(16) float sKiU[kKiFloats];
  float(*sKi)[kLdF] = reinterpret_cast<float(*)[kLdF]>(sKiU);
  float(*sL)[17] = reinterpret_cast<float(*)[17]>(sKiU);
  float(*sM)[17] = sL + C;
  float(*sAw)[17] = sL + 2 * C;
  float(*sMw)[17] = sL + 3 * C;
  __shared__ float sBeta[C];

  const int64_t item = blockIdx.x;
  const int64_t h = item % a.H;
  const int64_t n = (item / a.H) % a.NC;
  const int64_t b = item / (a.H * a.NC);
  const int64_t t0 = n * C;
  const int nv = a.T - t0 < C ? static_cast<int>(a.T - t0) : C;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, q = lane & 3;
  unsigned char* wsb = a.ws + item * W::kItem_B;
  bf16* ws = reinterpret_cast<bf16*>(wsb);

  // Phase 1: thread = channel c. Gamma (inclusive cumsum of g), the decayed q/k, Kr, gamma; padded rows
  // (t >= nv) get g = q = k = v = 0 and beta = 0, which makes their rows of every tile exactly zero.
  if (NT == D || tid < D) {
    const int c = tid;
    const TI* qp = static_cast<const TI*>(a.q);
    const TI* kp = static_cast<const TI*>(a.k);
    // Element (token t0 + i, channel c) is at base + i * H D.
    const int64_t base = ((b * a.T + t0) * a.H + h) * D + c;
    const int64_t tstride = a.H * D;
    float gam[C];
    float G = 0.0f;
#pragma unroll
    for (int i = 0; i < C; ++i) {
      G += i < nv ? a.g[base + i * tstride] : 0.0f;
      gam[i] = G;
    }
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const int64_t off = base + i * tstride;
      const float qv = i < nv ? to_f(qp[off]) : 0.0f;
      const float kv = i < nv ? to_f(kp[off]) : 0.0f;
      const float e = expf(gam[i]);       // in [e^-80, 1]
      const float ei = expf(-gam[i]);     // in [1, e^80]
      const float er = expf(G - gam[i]);  // in [e^-80, 1]
      sQd[i][c] = a.scale * qv * e;
      sKd[i][c] = kv * e;
      sKi[i][c] = kv * ei;
      put<P>(ws + W::kKR, C * D, kda_ws_tile_index(i, c, D), -kv * er);
      if constexpr (P == 2) {
        const float vv = i < nv ? to_f(static_cast<const TI*>(a.v)[off]) : 0.0f;
        put<P>(reinterpret_cast<bf16*>(wsb + W::kV_B), C * D, kda_ws_tile_index(i, c, D), vv);
      }
    }
    reinterpret_cast<float*>(wsb + W::kGM_B)[c] = expf(G);
    if (c < C) sBeta[c] = c < nv ? a.beta[(b * a.T + t0 + c) * a.H + h] : 0.0f;  // C <= 32 <= D
  }
  __syncthreads();

  // Phase 2: warp 0: A = Kd Ki^T -> L = Diag(beta) StrictLower(A); warp 1: M = Lower(Qd Ki^T). Masks by select.
  // L and M overwrite Ki's space, so both warps finish reading Ki (the barrier) before either stores.
  float acc[2][4] = {};
  if (warp < 2) {
    const float* X = warp == 0 ? &sKd[0][0] : &sQd[0][0];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ah[4], al[4];
      FragF::a_rows(ah, al, X, kLdF, ks * 16, r, q);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t bh[2], bl[2];
        FragF::b_nk(bh, bl, &sKi[0][0], kLdF, nt * 8, ks * 16, r, q);
        mma_split(acc[nt], ah, al, bh, bl);
      }
    }
  }
  __syncthreads();
  if (warp < 2) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = r + (e >> 1) * 8, j = nt * 8 + 2 * q + (e & 1);
        if (warp == 0) sL[i][j] = i > j ? sBeta[i] * acc[nt][e] : 0.0f;
        else sM[i][j] = i >= j ? acc[nt][e] : 0.0f;
      }
  }
  __syncthreads();

  // Phase 3: Aw = (I + L)^-1 Diag(beta) by forward substitution, column `col` per lane:
  //   Aw[i][col] = beta_i [i == col] - sum_{j<i} L[i][j] Aw[j][col]
  if (warp == 0) {
    const int col = lane & 15;
    float x[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float s = i == col ? sBeta[i] : 0.0f;
#pragma unroll
      for (int j = 0; j < i; ++j) s = fmaf(-sL[i][j], x[j], s);
      x[i] = s;
    }
    if (lane < 16) {
#pragma unroll
      for (int i = 0; i < C; ++i) sAw[i][col] = x[i];
    }
  }
  __syncthreads();

  // Phase 4: warp 0: Mw = M Aw; warp 1: -Aw to the workspace.
  if (warp == 0) {
    uint32_t ah[4], al[4];
    FragF::a_small(ah, al, &sM[0][0], r, q);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      uint32_t bh[2], bl[2];
      FragF::b_kn(bh, bl, &sAw[0][0], 17, nt * 8, r, q);
      float acc[4] = {};
      mma_split(acc, ah, al, bh, bl);
      const int j = nt * 8 + 2 * q;
      sMw[r][j] = acc[0];
      sMw[r][j + 1] = acc[1];
      sMw[r + 8][j] = acc[2];
      sMw[r + 8][j + 1] = acc[3];
      put2<P>(ws + W::kMW, C * C, kda_ws_tile_index(r, j, C), acc[0], acc[1]);
      put2<P>(ws + W::kMW, C * C, kda_ws_tile_index(r + 8, j, C), acc[2], acc[3]);
    }
  } else if (warp == 1) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int idx = e * 32 + lane;
      put<P>(ws + W::kAW, C * C, kda_ws_tile_index(idx / C, idx % C, C), -sAw[idx / C][idx % C]);
    }
  }
  __syncthreads();

  // Phase 5: Kw = Aw Kd and Qw = Qd - Mw Kd, kTilesPerWarp column tiles of 8 channels per warp.
  {
    uint32_t awh[4], awl[4], mwh[4], mwl[4];
    FragF::a_small(awh, awl, &sAw[0][0], r, q);
    FragF::a_small(mwh, mwl, &sMw[0][0], r, q);
#pragma unroll
    for (int t = 0; t < kTilesPerWarp; ++t) {
      const int n0 = (warp * kTilesPerWarp + t) * 8;
      uint32_t bh[2], bl[2];
      FragF::b_kn(bh, bl, &sKd[0][0], kLdF, n0, r, q);
      float kw[4] = {}, mk[4] = {};
      mma_split(kw, awh, awl, bh, bl);
      mma_split(mk, mwh, mwl, bh, bl);
      const int c = n0 + 2 * q;
      put2<P>(ws + W::kKW, C * D, kda_ws_tile_index(r, c, D), kw[0], kw[1]);
      put2<P>(ws + W::kKW, C * D, kda_ws_tile_index(r + 8, c, D), kw[2], kw[3]);
      put2<P>(ws + W::kQW, C * D, kda_ws_tile_index(r, c, D), sQd[r][c] - mk[0], sQd[r][c + 1] - mk[1]);
      put2<P>(ws + W::kQW, C * D, kda_ws_tile_index(r + 8, c, D), sQd[r + 8][c] - mk[2], sQd[r + 8][c + 1] - mk[3]);
    }
  }
}

// =========================================================================================================
// Kernel 2: the recurrence. One CTA of NW x KW warps per (b, h, slice of NV = 16 NW value columns). The KW
// warps of value group w (warps w KW .. w KW + KW-1, consecutive, so they land on different SM
// sub-partitions) share S^T rows v0 = slice*NV + 16 w .. +15 and split the D key columns: warp (w, kk)
// holds S^T[v0 .. v0+15][kk DK .. kk DK + DK-1], DK = D / KW, in DK/2 fp32 registers per thread:
//   S[nt][0..3] = S^T[v0 + r (+8)][kk DK + 8 nt + 2q (+1)]  (C layout of DK/8 tiles 16x8).
// Per chunk each warp forms its partial [O^T | Y] over its DK keys (the V term goes to key warp 0); with
// KW > 1 the partials meet in shared memory (fp32, one barrier), every warp sums the KW partials of Y in
// the same order (so all of them update with the same Y), and key warp j (j < 2) sums and stores the
// O^T tile of tokens 8j .. 8j+7. The key split shortens the serial chain of MMAs per warp by KW and
// spreads a value group over KW of the SM's four tensor-core sub-partitions: with few CTAs (B H slices
// below the SM count) one warp per SM otherwise issues every MMA of the chunk alone.
//
// Loading a chunk. The workspace item is stored in the byte order shared memory wants (kda_ws_tile_index's
// swizzle instead of padded rows), so a stage's copy is one contiguous run of 16-byte cp.async pieces with
// compile-time offsets, and the bf16 path's V tile (NV columns of 16 token rows of the input) follows.
// Shared memory is addressed through 32-bit shared-window offsets computed once (a generic pointer per
// ldmatrix/cp.async costs a conversion each). Both cut the instructions of a chunk step, and at few CTAs
// (one CTA of 4 warps per SM, one warp per scheduler) the step's time follows its instruction count
// (docs/CUDA.md, KDA: the profile, the figures, and the bulk-copy and deeper-pipeline loaders that did
// not pay).
// Shared memory per stage: the item (Ws layout, swizzled tiles), then (bf16 path) V [16][NV+8] bf16, its
// rows padded to an odd multiple of 16 bytes mod 128 so that ldmatrix reads 8 rows from 8 distinct bank
// groups. Then (KW > 1) the partials, float4 [NW][KW][4 tiles][32 lanes]. Every read of a stage happens
// before the mid-chunk barrier (Krn goes to registers early), so that barrier also frees the stage for
// the next load: two barriers per chunk.
template <int P, int NW, int KW, int D>
struct Smem2 {
  static constexpr int NV = 16 * NW;
  static_assert(NV <= D && D % NV == 0, "the slices tile the value columns");
  static_assert(KW >= 1 && D % (16 * KW) == 0, "the key warps tile the key columns in 16-wide k-steps");
  static constexpr int kLdV = NV + 8;
  static constexpr int kStages = P == 1 ? 4 : 2;
  static constexpr int kV = Ws<P, D>::kItem_B;  // bytes within a stage: the item at 0, then V (P == 1)
  static constexpr int kStage = kV + (P == 1 ? C * kLdV * 2 : 0);
  static constexpr int kRed = kStages * kStage;
  static constexpr int kBytes = kRed + (KW > 1 ? NW * KW * 4 * 32 * 16 : 0);
  static_assert(kV % 16 == 0 && kStage % 16 == 0 && kRed % 16 == 0, "alignment");
};

__device__ __forceinline__ void store_o(float* o, float x) { *o = x; }
__device__ __forceinline__ void store_o(bf16* o, float x) { *o = __float2bfloat16_rn(x); }

template <int P, int NW, int KW, class TO, int D>
// (clang-format would write `NW* KW`: it reads a product inside the attribute as a pointer type)
// clang-format off
__global__ void __launch_bounds__(NW * KW * 32, 1) kda_recurrence_kernel(Args a) {
  // clang-format on
  static_assert(D == 32 || D == 64 || D == 128, "head dim");
  using W = Ws<P, D>;
  using L = Smem2<P, NW, KW, D>;
  constexpr int NV = L::NV, kSlices = D / NV, kStages = L::kStages;
  constexpr int kThreads = NW * KW * 32;
  constexpr int DK = D / KW;    // key columns per warp
  constexpr int kNT = DK / 8;   // 16x8 state tiles per warp (key columns / 8)
  constexpr int kKS = DK / 16;  // 16-wide k-steps over the warp's key columns
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_u = ptx::smem_u32(smem);

  const int slice = blockIdx.x % kSlices;
  const int64_t h = (blockIdx.x / kSlices) % a.H;
  const int64_t b = blockIdx.x / (kSlices * a.H);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, r = lane >> 2, q = lane & 3;
  const int vw = warp / KW, kw = warp % KW;  // value group, key warp within it
  const int vs = slice * NV;                 // the CTA's first value column
  const int v0 = vs + vw * 16;               // the warp's first value column
  const int k0 = kw * DK;                    // the warp's first key column
  const int64_t NC = a.NC;

  // The head's first workspace item and (bf16 path) first V row (token 0, column vs).
  const unsigned char* ws_head = a.ws + (b * NC * a.H + h) * W::kItem_B;
  const int64_t item_stride = a.H * W::kItem_B;  // bytes from chunk n's item to chunk n+1's
  [[maybe_unused]] const bf16* v_head = nullptr;
  if constexpr (P == 1) v_head = static_cast<const bf16*>(a.v) + (b * a.T * a.H + h) * D + vs;
  const int64_t tok_stride = a.H * D;  // elements between consecutive tokens of v and o

  // Issue the async copies of chunk n into stage s (always commits a group, possibly empty); V rows past
  // the end of the sequence are zero-filled.
  auto load_chunk = [&](int64_t n, int s) {
    if (n < NC) {
      const uint32_t st = smem_u + s * L::kStage;
      const unsigned char* src = ws_head + n * item_stride;
      constexpr int kPieces = W::kItem_B / 16;
#pragma unroll
      for (int k = 0; k < (kPieces + kThreads - 1) / kThreads; ++k) {
        const int i = tid + k * kThreads;
        if (kPieces % kThreads == 0 || i < kPieces) ptx::cp_async16(st + i * 16, src + i * 16, 16);
      }
      if constexpr (P == 1) {
        constexpr int kSegs = NV / 8;
        const bf16* vsrc = v_head + n * C * tok_stride;
#pragma unroll
        for (int k = 0; k < (C * kSegs + kThreads - 1) / kThreads; ++k) {
          const int i = tid + k * kThreads;
          const int row = i / kSegs, seg = i % kSegs;
          const bool ok = n * C + row < a.T;
          if ((C * kSegs) % kThreads == 0 || i < C * kSegs)
            ptx::cp_async16(st + L::kV + row * L::kLdV * 2 + seg * 16, vsrc + (ok ? row * tok_stride : 0) + seg * 8,
                            ok ? 16 : 0);
        }
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load_chunk(s, s);

  // The warp's block of the state, transposed, into registers.
  float S[kNT][4];
  {
    const float* sin = a.state_in ? a.state_in + (b * a.H + h) * D * D : nullptr;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int c = k0 + nt * 8 + 2 * q;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int cc = c + (e & 1), vv = v0 + r + (e >> 1) * 8;
        S[nt][e] = sin ? sin[cc * D + vv] : 0.0f;
      }
    }
  }

  // The thread's output elements of token 0 (tile j = 0, element e: token 2q + (e&1), column v0 + r + 8 (e>>1)).
  TO* const out_head = static_cast<TO*>(a.o) + (b * a.T * a.H + h) * D + v0 + r;

  float4* red = reinterpret_cast<float4*>(smem + L::kRed) + vw * KW * 4 * 32;  // the value group's partials

  // Stage s holds chunk n (s = n mod kStages); the load issued with chunk n goes to stage sl = (n + kStages
  // - 1) mod kStages, the one chunk n-1 used.
  int s = 0, sl = kStages - 1;
  for (int64_t n = 0; n < NC; ++n) {
    load_chunk(n + kStages - 1, sl);
    cp_async_wait<kStages - 1>();
    __syncthreads();  // stage n has landed; every warp is done with the previous chunk's partials
    // Shared-window byte addresses of the stage's tiles (bf16 elements are 2 bytes).
    const uint32_t st = smem_u + s * L::kStage;
    const uint32_t sQ = st + W::kQW * 2, sK = st + W::kKW * 2, sR = st + W::kKR * 2, sA = st + W::kAW * 2,
                   sM = st + W::kMW * 2, sV = st + (P == 1 ? L::kV : W::kV_B);
    const float* sG = reinterpret_cast<const float*>(smem + s * L::kStage + W::kGM_B);

    // ldmatrix lane roles: matrix m = lane / 8, row rr = lane % 8.
    const int m = lane >> 3, rr = lane & 7;

    // [O^T | Y] = S^T [Qw^T | Kw^T] + V^T [Mw^T | Awn^T] over the warp's keys; acc[0..1] = O^T (tokens
    // 0-7, 8-15), acc[2..3] = Y. The bf16 path multiplies the state rounded once to bf16 (kda_cuda.h,
    // numerics); the parity path splits it, S = hi + lo, and also multiplies the lo planes of the tiles.
    float acc[4][4] = {};
    [[maybe_unused]] float accl[4][4] = {};
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      uint32_t sh[4];
      [[maybe_unused]] uint32_t sl[4];
      if constexpr (P == 1) {
        sh[0] = ptx::pack_bf16x2(S[2 * ks][0], S[2 * ks][1]);
        sh[1] = ptx::pack_bf16x2(S[2 * ks][2], S[2 * ks][3]);
        sh[2] = ptx::pack_bf16x2(S[2 * ks + 1][0], S[2 * ks + 1][1]);
        sh[3] = ptx::pack_bf16x2(S[2 * ks + 1][2], S[2 * ks + 1][3]);
      } else {
        split_pack(S[2 * ks][0], S[2 * ks][1], sh[0], sl[0]);
        split_pack(S[2 * ks][2], S[2 * ks][3], sh[1], sl[1]);
        split_pack(S[2 * ks + 1][0], S[2 * ks + 1][1], sh[2], sl[2]);
        split_pack(S[2 * ks + 1][2], S[2 * ks + 1][3], sh[3], sl[3]);
      }
      // B tiles: rows (tokens) (m>>1)*8 + rr, columns (channels) k0 + 16 ks + (m&1)*8.
      const int boff = kda_ws_tile_index((m >> 1) * 8 + rr, k0 + ks * 16 + (m & 1) * 8, D);
      uint32_t bq[4], bk[4];
      ptx::ldmatrix_x4(bq, sQ + boff * 2);
      ptx::ldmatrix_x4(bk, sK + boff * 2);
      ptx::mma_bf16_16816(acc[0], sh, bq[0], bq[1]);
      ptx::mma_bf16_16816(acc[1], sh, bq[2], bq[3]);
      ptx::mma_bf16_16816(acc[2], sh, bk[0], bk[1]);
      ptx::mma_bf16_16816(acc[3], sh, bk[2], bk[3]);
      if constexpr (P == 2) {
        ptx::mma_bf16_16816(accl[0], sl, bq[0], bq[1]);
        ptx::mma_bf16_16816(accl[1], sl, bq[2], bq[3]);
        ptx::mma_bf16_16816(accl[2], sl, bk[0], bk[1]);
        ptx::mma_bf16_16816(accl[3], sl, bk[2], bk[3]);
        ptx::ldmatrix_x4(bq, sQ + (C * D + boff) * 2);
        ptx::ldmatrix_x4(bk, sK + (C * D + boff) * 2);
        ptx::mma_bf16_16816(accl[0], sh, bq[0], bq[1]);
        ptx::mma_bf16_16816(accl[1], sh, bq[2], bq[3]);
        ptx::mma_bf16_16816(accl[2], sh, bk[0], bk[1]);
        ptx::mma_bf16_16816(accl[3], sh, bk[2], bk[3]);
      }
    }
    if (kw == 0) {
      // V^T (A operand, transposed load of V[t][v]): rows t = rr + (m>>1)*8, columns v = 16 vw + (m&1)*8 of
      // the slice (the bf16 path's padded V tile holds only the slice; the parity path's item holds all D).
      const int voff = P == 1 ? (rr + (m >> 1) * 8) * L::kLdV + vw * 16 + (m & 1) * 8
                              : kda_ws_tile_index(rr + (m >> 1) * 8, v0 + (m & 1) * 8, D);
      // Mw, Awn (B operands, stored [i][j] = [n][k]): rows (m>>1)*8 + rr, columns (m&1)*8.
      const int soff = kda_ws_tile_index((m >> 1) * 8 + rr, (m & 1) * 8, C);
      uint32_t av[4], bm[4], ba[4];
      ptx::ldmatrix_x4_trans(av, sV + voff * 2);
      ptx::ldmatrix_x4(bm, sM + soff * 2);
      ptx::ldmatrix_x4(ba, sA + soff * 2);
      if constexpr (P == 1) {
        ptx::mma_bf16_16816(acc[0], av, bm[0], bm[1]);
        ptx::mma_bf16_16816(acc[1], av, bm[2], bm[3]);
        ptx::mma_bf16_16816(acc[2], av, ba[0], ba[1]);
        ptx::mma_bf16_16816(acc[3], av, ba[2], ba[3]);
      } else {
        ptx::mma_bf16_16816(accl[0], av, bm[0], bm[1]);
        ptx::mma_bf16_16816(accl[1], av, bm[2], bm[3]);
        ptx::mma_bf16_16816(accl[2], av, ba[0], ba[1]);
        ptx::mma_bf16_16816(accl[3], av, ba[2], ba[3]);
        uint32_t avl[4], bml[4], bal[4];
        ptx::ldmatrix_x4_trans(avl, sV + (C * D + voff) * 2);
        ptx::ldmatrix_x4(bml, sM + (C * C + soff) * 2);
        ptx::ldmatrix_x4(bal, sA + (C * C + soff) * 2);
        ptx::mma_bf16_16816(accl[0], avl, bm[0], bm[1]);
        ptx::mma_bf16_16816(accl[1], avl, bm[2], bm[3]);
        ptx::mma_bf16_16816(accl[2], avl, ba[0], ba[1]);
        ptx::mma_bf16_16816(accl[3], avl, ba[2], ba[3]);
        ptx::mma_bf16_16816(accl[0], av, bml[0], bml[1]);
        ptx::mma_bf16_16816(accl[1], av, bml[2], bml[3]);
        ptx::mma_bf16_16816(accl[2], av, bal[0], bal[1]);
        ptx::mma_bf16_16816(accl[3], av, bal[2], bal[3]);
      }
    }
    if constexpr (P == 2) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += accl[nt][e];
    }

    // The rest of the stage this warp needs, read before the barrier below frees the stage: Krn (the B
    // operand of the state update, stored [k][n] = [t][c]: transposed loads, rows t = rr + (m&1)*8,
    // columns c = k0 + 8 (2np + (m>>1))) into registers, and gamma, applied now (the state's bf16 copy for
    // this chunk's products is already taken): S^T <- S^T Diag(gamma).
    uint32_t br[kKS][P][4];
#pragma unroll
    for (int np = 0; np < kKS; ++np) {
      const int roff = kda_ws_tile_index(rr + (m & 1) * 8, k0 + (2 * np + (m >> 1)) * 8, D);
      ptx::ldmatrix_x4_trans(br[np][0], sR + roff * 2);
      if constexpr (P == 2) ptx::ldmatrix_x4_trans(br[np][1], sR + (C * D + roff) * 2);
    }
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const float2 gm = *reinterpret_cast<const float2*>(sG + k0 + nt * 8 + 2 * q);
      S[nt][0] *= gm.x;
      S[nt][1] *= gm.y;
      S[nt][2] *= gm.x;
      S[nt][3] *= gm.y;
    }

    // KW > 1: partials to shared memory (float4 per lane and tile: conflict-free), one barrier, then the sums.
    if constexpr (KW > 1) {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        red[(kw * 4 + j) * 32 + lane] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    }
    __syncthreads();  // partials visible; every read of stage n is done (the next load may refill it)
    if constexpr (KW > 1) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (j < 2 && j % KW != kw) continue;  // O^T tile j is summed (and stored) by key warp j % KW only
        float4 s4 = red[j * 32 + lane];
#pragma unroll
        for (int w = 1; w < KW; ++w) {
          const float4 x = red[(w * 4 + j) * 32 + lane];
          s4.x += x.x;
          s4.y += x.y;
          s4.z += x.z;
          s4.w += x.w;
        }
        acc[j][0] = s4.x;
        acc[j][1] = s4.y;
        acc[j][2] = s4.z;
        acc[j][3] = s4.w;
      }
    }

    // Output: O^T tile j (tokens 8j + 2q, +1; value columns v0 + r, +8) straight from the C fragment to
    // o[t][v], rows t < T only; per store instruction the warp writes 4 rows of 8 consecutive columns.
    TO* const out_chunk = out_head + n * C * tok_stride;
    const int64_t rows_left = a.T - n * C;  // tokens of this chunk that exist (>= 16 but in the last chunk)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (j % KW != kw) continue;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = 8 * j + 2 * q + (e & 1);
        if (rows_left >= C || t < rows_left) store_o(out_chunk + t * tok_stride + (e >> 1) * 8, acc[j][e]);
      }
    }

    // State: S^T += Y Krn over the warp's keys. Y (C layout, tokens 0-7 | 8-15) is already the A operand:
    // rounded once to bf16 in the bf16 path, split hi + lo in the parity path.
    uint32_t yh[4];
    [[maybe_unused]] uint32_t yl[4];
    if constexpr (P == 1) {
      yh[0] = ptx::pack_bf16x2(acc[2][0], acc[2][1]);
      yh[1] = ptx::pack_bf16x2(acc[2][2], acc[2][3]);
      yh[2] = ptx::pack_bf16x2(acc[3][0], acc[3][1]);
      yh[3] = ptx::pack_bf16x2(acc[3][2], acc[3][3]);
    } else {
      split_pack(acc[2][0], acc[2][1], yh[0], yl[0]);
      split_pack(acc[2][2], acc[2][3], yh[1], yl[1]);
      split_pack(acc[3][0], acc[3][1], yh[2], yl[2]);
      split_pack(acc[3][2], acc[3][3], yh[3], yl[3]);
    }
#pragma unroll
    for (int np = 0; np < kKS; ++np) {
      ptx::mma_bf16_16816(S[2 * np], yh, br[np][0][0], br[np][0][1]);
      ptx::mma_bf16_16816(S[2 * np + 1], yh, br[np][0][2], br[np][0][3]);
      if constexpr (P == 2) {
        ptx::mma_bf16_16816(S[2 * np], yl, br[np][0][0], br[np][0][1]);
        ptx::mma_bf16_16816(S[2 * np + 1], yl, br[np][0][2], br[np][0][3]);
        ptx::mma_bf16_16816(S[2 * np], yh, br[np][1][0], br[np][1][1]);
        ptx::mma_bf16_16816(S[2 * np + 1], yh, br[np][1][2], br[np][1][3]);
      }
    }
    sl = s;
    s = s + 1 == kStages ? 0 : s + 1;
  }
  cp_async_wait<0>();

  if (a.state_out) {
    float* so = a.state_out + (b * a.H + h) * D * D;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int c = k0 + nt * 8 + 2 * q;
#pragma unroll
      for (int e = 0; e < 4; ++e) so[(c + (e & 1)) * D + v0 + r + (e >> 1) * 8] = S[nt][e];
    }
  }
}

// ---- host side ---------------------------------------------------------------------------------------------
int sm_count() {
  static int n = [] {
    int dev = 0, v = 0;
    K3_CUDA_CHECK(cudaGetDevice(&dev));
    K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// The recurrence's CTA shape: NW value groups (16 columns each) of KW key warps.
struct RecShape {
  int nw, kw;
};

// Warps per SM the key split fills up to: 4, one per tensor-core sub-partition. The split pays while it
// puts a warp on an idle sub-partition; past one warp per sub-partition its partial sums and wider
// barrier cost more than the shorter chains save (docs/CUDA.md, KDA, "The key split").
constexpr int64_t kKeySplitWarpsPerSm = 4;

// bf16 path. NW in {8, 4, 2, 1} with 16 NW <= D: the busiest SM holds the fewest value groups
// (ceil(CTAs / SMs) * NW), the larger NW on a tie (fewer CTAs re-reading the same chunk tiles). Then KW in
// {4, 2, 1} with 16 KW <= D: the largest that keeps the busiest SM within kKeySplitWarpsPerSm warps (a lone
// value group per SM gets KW = 4, two get KW = 2, more get KW = 1).
RecShape choose_shape(int64_t B, int64_t H, int sms, int D) {
  const int max_nw = D / 16;  // 8, 4 or 2
  int nw = max_nw;
  int64_t best_load = INT64_MAX;
  for (int w : {8, 4, 2, 1}) {
    if (w > max_nw) continue;
    const int64_t ctas = B * H * (max_nw / w);
    const int64_t load = (ctas + sms - 1) / sms * w;
    if (load < best_load) {
      best_load = load;
      nw = w;
    }
  }
  for (int kw : {4, 2}) {
    if (16 * kw <= D && best_load * kw <= kKeySplitWarpsPerSm) return {nw, kw};
  }
  return {nw, 1};
}

// The parity path (fp32 inputs): 4 value warps, or D / 16 when that is fewer; no key split.
constexpr int p2_nw(int D) { return D / 16 < 4 ? D / 16 : 4; }

RecShape rec_shape(int64_t B, int64_t H, DType in_dtype, int D) {
  if (in_dtype == DType::F32) return {p2_nw(D), 1};
  return choose_shape(B, H, sm_count(), D);
}

template <int P, int NW, int KW, class TO, int D>
void launch_recurrence(const Args& a) {
  using L = Smem2<P, NW, KW, D>;
  static bool attr_set = false;
  if (!attr_set) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(kda_recurrence_kernel<P, NW, KW, TO, D>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, L::kBytes));
    attr_set = true;
  }
  const int64_t grid = a.B * a.H * (D / L::NV);
  kda_recurrence_kernel<P, NW, KW, TO, D><<<static_cast<unsigned>(grid), NW * KW * 32, L::kBytes>>>(a);
  K3_CUDA_LAUNCH_CHECK();
}

// bf16 path, NW fixed: KW in {4, 2, 1}, only the pairs choose_shape can pick (16 KW <= D, NW KW within
// kKeySplitWarpsPerSm).
template <int NW, class TO, int D>
void launch_recurrence_kw(const Args& a, int kw) {
  if constexpr (D >= 64 && NW * 4 <= kKeySplitWarpsPerSm) {
    if (kw >= 4) return launch_recurrence<1, NW, 4, TO, D>(a);
  }
  if constexpr (NW * 2 <= kKeySplitWarpsPerSm) {
    if (kw >= 2) return launch_recurrence<1, NW, 2, TO, D>(a);
  }
  launch_recurrence<1, NW, 1, TO, D>(a);
}

template <int P, class TO, int D>
void launch_recurrence_shape(const Args& a, RecShape s) {
  if constexpr (P == 2) {
    launch_recurrence<2, p2_nw(D), 1, TO, D>(a);  // the parity path: one configuration per D
  } else {
    if constexpr (D >= 128) {
      if (s.nw >= 8) return launch_recurrence_kw<8, TO, D>(a, s.kw);
    }
    if constexpr (D >= 64) {
      if (s.nw >= 4) return launch_recurrence_kw<4, TO, D>(a, s.kw);
    }
    if (s.nw >= 2) return launch_recurrence_kw<2, TO, D>(a, s.kw);
    launch_recurrence_kw<1, TO, D>(a, s.kw);
  }
}

template <int D>
void chunk_forward_d(const KdaParams& p, const Args& a) {
  const unsigned items = static_cast<unsigned>(a.B * a.NC * a.H);
  const bool f32_in = p.in_dtype == DType::F32;
  constexpr int NT = prep_threads<D>();
  if (p.stage != KdaParams::Stage::kRecurrenceOnly) {
    constexpr int MB = prep_min_blocks<D>();
    using Cap = KdaParams::PrepareCap;
    const Cap cap = p.prepare_cap;
    if (f32_in) {
      if (cap == Cap::kUncapped) kda_prepare_kernel<float, 2, D, 1><<<items, NT>>>(a);
      else if (cap == Cap::k7Ctas && MB > 7) kda_prepare_kernel<float, 2, D, 7><<<items, NT>>>(a);
      else kda_prepare_kernel<float, 2, D, MB><<<items, NT>>>(a);
    } else {
      if (cap == Cap::kUncapped) kda_prepare_kernel<bf16, 1, D, 1><<<items, NT>>>(a);
      else if (cap == Cap::k7Ctas && MB > 7) kda_prepare_kernel<bf16, 1, D, 7><<<items, NT>>>(a);
      else kda_prepare_kernel<bf16, 1, D, MB><<<items, NT>>>(a);
    }
    K3_CUDA_LAUNCH_CHECK();
  }
  if (p.stage == KdaParams::Stage::kPrepareOnly) return;
  const RecShape s = rec_shape(a.B, a.H, p.in_dtype, D);
  if (f32_in) {
    if (p.out_dtype == DType::F32) launch_recurrence_shape<2, float, D>(a, s);
    else launch_recurrence_shape<2, bf16, D>(a, s);
  } else {
    if (p.out_dtype == DType::F32) launch_recurrence_shape<1, float, D>(a, s);
    else launch_recurrence_shape<1, bf16, D>(a, s);
  }
}

bool is_act(DType t) { return t == DType::BF16 || t == DType::F32; }
bool is_head_dim(int64_t D) { return D == 32 || D == 64 || D == 128; }

template <int P>
size_t item_bytes(int64_t D) {
  return D == 32 ? Ws<P, 32>::kItem_B : D == 64 ? Ws<P, 64>::kItem_B : Ws<P, 128>::kItem_B;
}

}  // namespace

size_t kda_chunk_workspace_bytes(int64_t B, int64_t T, int64_t H, DType in_dtype, int64_t D) {
  K3_CHECK(is_head_dim(D), "kda_chunk_workspace_bytes: head dim D must be 32, 64 or 128, got ", D);
  const int64_t NC = (T + C - 1) / C;
  const size_t item = in_dtype == DType::F32 ? item_bytes<2>(D) : item_bytes<1>(D);
  return static_cast<size_t>(B * NC * H) * item;
}

int kda_chunk_value_slices(int64_t B, int64_t H, DType in_dtype, int64_t D) {
  K3_CHECK(is_head_dim(D), "kda_chunk_value_slices: head dim D must be 32, 64 or 128, got ", D);
  return static_cast<int>(D) / (16 * rec_shape(B, H, in_dtype, static_cast<int>(D)).nw);
}

int kda_chunk_key_warps(int64_t B, int64_t H, DType in_dtype, int64_t D) {
  K3_CHECK(is_head_dim(D), "kda_chunk_key_warps: head dim D must be 32, 64 or 128, got ", D);
  return rec_shape(B, H, in_dtype, static_cast<int>(D)).kw;
}

std::string kda_chunk_can_run(const KdaParams& p) {
  std::string why;
  if (!k3::cuda::available(&why)) return why;
  if (p.B < 1 || p.H < 1 || p.T < 0) return "kda_chunk_forward: need B >= 1, H >= 1, T >= 0";
  if (p.state_slot) return "kda_chunk_forward: state_slot is taken by kda_recurrent_forward only";
  if (!is_head_dim(p.D))
    return "kda_chunk_forward: head dim D must be 32, 64 or 128 (Dk = Dv = D), got D = " + std::to_string(p.D);
  if (!is_act(p.in_dtype) || !is_act(p.out_dtype)) return "kda_chunk_forward: q/k/v and o must be BF16 or F32";
  if (p.B * ((p.T + C - 1) / C) * p.H >= (int64_t(1) << 31)) return "kda_chunk_forward: B * chunks * H exceeds 2^31";
  if (p.T > 0) {
    if (!p.q || !p.k || !p.v || !p.g || !p.beta || !p.o)
      return "kda_chunk_forward: q, k, v, g, beta and o are required";
    if (!p.workspace) return "kda_chunk_forward: no workspace (kda_chunk_workspace_bytes)";
    const size_t need = kda_chunk_workspace_bytes(p.B, p.T, p.H, p.in_dtype, p.D);
    if (p.workspace_bytes < need)
      return "kda_chunk_forward: workspace has " + std::to_string(p.workspace_bytes) + " bytes, needs " +
             std::to_string(need);
    if (reinterpret_cast<uintptr_t>(p.workspace) % 16 != 0 || reinterpret_cast<uintptr_t>(p.v) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(p.o) % 16 != 0)
      return "kda_chunk_forward: v, o and the workspace must be 16-byte aligned";
  }
  return {};
}

void kda_chunk_forward(const KdaParams& p) {
  const std::string why = kda_chunk_can_run(p);
  K3_CHECK(why.empty(), why);
  if (p.T == 0) {
    // No tokens: the state passes through.
    if (p.state_out && p.state_out != p.state_in) {
      const size_t bytes = static_cast<size_t>(p.B * p.H) * p.D * p.D * sizeof(float);
      if (p.state_in) K3_CUDA_CHECK(cudaMemcpy(p.state_out, p.state_in, bytes, cudaMemcpyDeviceToDevice));
      else K3_CUDA_CHECK(cudaMemset(p.state_out, 0, bytes));
    }
    return;
  }
  Args a{p.B, p.T, p.H,    (p.T + C - 1) / C, p.scale,     p.q, p.k,
         p.v, p.g, p.beta, p.state_in,        p.state_out, p.o, static_cast<unsigned char*>(p.workspace)};
  switch (p.D) {
    case 32: chunk_forward_d<32>(p, a); break;
    case 64: chunk_forward_d<64>(p, a); break;
    default: chunk_forward_d<128>(p, a); break;
  }
}

}  // namespace k3::kda::cuda
