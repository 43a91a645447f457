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

#include <algorithm>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/sm90_ptx.cuh"
#include "kernels/kda/kda_chunk_train_tc_cuda.h"
#include "kernels/kda/kda_train_common.cuh"

namespace k3::kda::cuda {
namespace {

using chunk_train::C;
using chunk_train::ChunkLoc;
using chunk_train::locate_chunk;

using bf16 = __nv_bfloat16;
using Params = KdaTrainBf16Params;  // q, k, v bf16 (as bf16 on the device), g, beta fp32
constexpr int kMid = 7;       // the re-reference position of A and M (Gamma_m)
constexpr int kLdT = 24;      // row stride (bf16) of a 16x16 tile in shared memory: 48 bytes, conflict-free ldmatrix

template <int D>
constexpr int ld_of() {  // row stride (bf16) of [16][D] and [D][D] tiles: D + 8 (a 16-byte shift per row)
  return D + 8;
}

// bf16 inputs arrive as uint16_t bits (the host side's type): element i, and the pair i, i + 1 widened.
__device__ __forceinline__ float ld_bf16(const uint16_t* x, int64_t i) {
  return __bfloat162float(reinterpret_cast<const bf16*>(x)[i]);
}
__device__ __forceinline__ float2 ld_bf16x2(const uint16_t* x, int64_t i) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(x + i));
}
__device__ __forceinline__ void st_bf16x2(uint16_t* x, int64_t i, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(x + i) = __floats2bfloat162_rn(a, b);
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
// The per-(chunk, head) item in the tape, stored exactly as the kernels hold it in shared memory (ItemSmem), so a
// copy is one flat run of 16-byte pieces: bf16 Kt, Qt, Kd [16][D + 8], Aw, A, M [16][kLdT], fp32 El [D] (bytes
// 100 D + 3072). Rows >= n of every tile are zero; the pad columns are zero.
template <int D>
struct ItemSmem {
  bf16 Kt[C][ld_of<D>()], Qt[C][ld_of<D>()], Kd[C][ld_of<D>()];
  bf16 Aw[C][kLdT], A[C][kLdT], M[C][kLdT];
  float El[D];
};
template <int D>
struct Item {
  static constexpr int kBig = C * ld_of<D>() * 2, kSmall = C * kLdT * 2;  // bytes of one tile
  static constexpr int kKt = 0, kQt = kBig, kKd = 2 * kBig, kAw = 3 * kBig, kA = kAw + kSmall, kM = kA + kSmall,
                       kEl = kM + kSmall, kBytes = kEl + 4 * D;
  static_assert(kBytes % 16 == 0 && kEl % 16 == 0 && kAw % 16 == 0, "item tiles are copied in 16-byte pieces");
  static_assert(sizeof(ItemSmem<D>) == kBytes, "the item is stored as ItemSmem holds it");
};

// ---- prep ---------------------------------------------------------------------------------------------------
template <int D>
struct PrepSmem {
  bf16 Qr[C][ld_of<D>()], Kr[C][ld_of<D>()], Ki[C][ld_of<D>()];
  float A[C][C + 1];
  float beta[C];
};

// One CTA of max(D, 64) threads per (chunk, head) (the products need two warps). Threads < D run the elementwise
// phase, where most of the time goes: no thread idles there, and the SM hides the phases' latency with other CTAs
// (8 of them at D = 128).
template <int D>
constexpr int prep_threads() {
  return D < 64 ? 64 : D;
}

template <int D>
__global__ void __launch_bounds__(prep_threads<D>(), D == 128 ? 8 : 1) prep_kernel(Params p, unsigned char* items) {
  __shared__ __align__(16) PrepSmem<D> s;
  using I = Item<D>;
  constexpr int LD = ld_of<D>();
  const int64_t ci = chunk_train::grid_chunk();
  if (ci >= p.chunks) return;
  const int h = chunk_train::grid_head(), tid = threadIdx.x, warp = tid / 32;
  const ChunkLoc L = locate_chunk(p, ci);
  const int n = L.n;
  const int64_t HD = int64_t(p.H) * D;
  unsigned char* it = items + (ci * p.H + h) * I::kBytes;
  bf16* Kt = reinterpret_cast<bf16*>(it + I::kKt);
  bf16* Qt = reinterpret_cast<bf16*>(it + I::kQt);
  bf16* Kd = reinterpret_cast<bf16*>(it + I::kKd);
  for (int i = tid; i < 6 * C; i += prep_threads<D>()) {  // the pad columns of the six tiles: 16 bytes of zeros per row
    const int t = i / C, r = i % C;
    const int off = t < 3 ? I::kKt + t * I::kBig + (r * LD + D) * 2 : I::kAw + (t - 3) * I::kSmall + (r * kLdT + C) * 2;
    *reinterpret_cast<uint4*>(it + off) = make_uint4(0u, 0u, 0u, 0u);
  }
  // Phase 1, threads < D: a channel pair (c, c + 1) over half the rows each: lanes 0-15 of a warp rows 0-7, lanes
  // 16-31 rows 8-15 of the same 16 pairs (paired loads and stores; the halves' sums meet by shuffles). Padded
  // rows: g = q = k = 0, so Gamma stays Gamma_{n-1} after the last row.
  if (tid < D) {
    const int l = tid & 31, half = l >> 4, c = 2 * ((tid >> 5) * 16 + (l & 15));
    const int64_t base = (L.row0 + half * 8) * HD + int64_t(h) * D + c;
    float2 gin[C / 2], qv[C / 2], kv[C / 2];
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      const bool ok = half * 8 + i < n;
      const int64_t off = base + i * HD;
      gin[i] = ok ? *reinterpret_cast<const float2*>(p.g + off) : make_float2(0.f, 0.f);
      qv[i] = ok ? ld_bf16x2(p.q, off) : make_float2(0.f, 0.f);
      kv[i] = ok ? ld_bf16x2(p.k, off) : make_float2(0.f, 0.f);
    }
    float2 gam[C / 2], G = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      G.x += gin[i].x;
      G.y += gin[i].y;
      gam[i] = G;
    }
    // Gm = Gamma_7 (the first half's total), Gl = Gamma_15 = Gamma_{n-1} (the second half's, after adding Gm).
    const float2 Gm = make_float2(__shfl_sync(0xffffffffu, G.x, l & 15), __shfl_sync(0xffffffffu, G.y, l & 15));
    if (half) {
#pragma unroll
      for (int i = 0; i < C / 2; ++i) gam[i].x += Gm.x, gam[i].y += Gm.y;
    }
    const float2 Gl = make_float2(__shfl_sync(0xffffffffu, gam[C / 2 - 1].x, (l & 15) + 16),
                                  __shfl_sync(0xffffffffu, gam[C / 2 - 1].y, (l & 15) + 16));
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      const int r = half * 8 + i;
      const float qx = p.scale * qv[i].x, qy = p.scale * qv[i].y, kx = kv[i].x, ky = kv[i].y;
      const float Ex = expf(gam[i].x), Ey = expf(gam[i].y);
      const float Px = expf(Gl.x - gam[i].x), Py = expf(Gl.y - gam[i].y);
      const float Rx = expf(gam[i].x - Gm.x), Ry = expf(gam[i].y - Gm.y);
      const float Ix = expf(Gm.x - gam[i].x), Iy = expf(Gm.y - gam[i].y);
      *reinterpret_cast<uint32_t*>(Qt + r * LD + c) = ptx::pack_bf16x2(qx * Ex, qy * Ey);
      *reinterpret_cast<uint32_t*>(Kt + r * LD + c) = ptx::pack_bf16x2(kx * Ex, ky * Ey);
      *reinterpret_cast<uint32_t*>(Kd + r * LD + c) = ptx::pack_bf16x2(kx * Px, ky * Py);
      *reinterpret_cast<uint32_t*>(&s.Qr[r][c]) = ptx::pack_bf16x2(qx * Rx, qy * Ry);
      *reinterpret_cast<uint32_t*>(&s.Kr[r][c]) = ptx::pack_bf16x2(kx * Rx, ky * Ry);
      *reinterpret_cast<uint32_t*>(&s.Ki[r][c]) = ptx::pack_bf16x2(kx * Ix, ky * Iy);
    }
    if (half) *reinterpret_cast<float2*>(it + I::kEl + c * 4) = make_float2(expf(Gl.x), expf(Gl.y));
  }
  if (tid < C) s.beta[tid] = tid < n ? p.beta[(L.row0 + tid) * p.H + h] : 0.f;
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
        out[r * kLdT + sc] = __float2bfloat16_rn(v);
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
      Aw[i * kLdT + col] = __float2bfloat16_rn(x[i]);
    }
  }
}

// ---- sequential kernels ---------------------------------------------------------------------------------------
// One CTA of seq_warps<D>() warps per (sequence, head, NV = 16 * warps value columns). The chunk's item and its
// bf16 [16][NV] tile of V (forward) or dO (backward) arrive by cp.async kStages - 1 chunks ahead, so a step waits
// on neither: at a few CTAs per SM the step's latency is the kernels' time (docs/CUDA.md, KDA: the inference
// recurrence's measurements), and a load issued in the step that uses it costs a memory round trip each step.
template <int D>
constexpr int seq_warps() {
  return D >= 64 ? 4 : 2;
}
constexpr int kStages = 4;

template <int D>
struct SeqStage {
  // +8 bf16 (16 bytes): rows 2 apart are 8 banks apart, so the fragment reads of 4 token rows x 8 values hit 16
  // distinct banks, and each row stays a run of 16-byte pieces for cp.async.
  static constexpr int NV = 16 * seq_warps<D>(), kLdX = NV + 8;
  ItemSmem<D> it;
  bf16 X[C][kLdX];  // V or dO: token rows, the CTA's value columns
};
template <int D>
struct SeqSmem {
  SeqStage<D> st[kStages];
  alignas(16) bf16 out[2][seq_warps<D>()][C * D];  // StateOut's staging rows, two per warp
};

// Queues the copies of chunk (item `item`, token rows from `x` with row stride HD, n of them valid) into stage `st`;
// rows >= n of X are zero-filled. Every thread of the CTA takes part; one commit group.
template <int D>
__device__ __forceinline__ void load_stage(SeqStage<D>& st, const unsigned char* item, const bf16* x, int64_t HD,
                                           int n) {
  constexpr int NT = 32 * seq_warps<D>(), kPieces = Item<D>::kBytes / 16, NV = SeqStage<D>::NV, RP = NV / 8;
  const uint32_t dst = ptx::smem_u32(&st.it);
#pragma unroll
  for (int k = 0; k < (kPieces + NT - 1) / NT; ++k) {
    const int i = threadIdx.x + k * NT;
    if (kPieces % NT == 0 || i < kPieces) ptx::cp_async16(dst + i * 16, item + i * 16, 16);
  }
#pragma unroll
  for (int k = 0; k < (C * RP + NT - 1) / NT; ++k) {
    const int i = threadIdx.x + k * NT, r = i / RP, pc = i % RP;
    if ((C * RP) % NT == 0 || i < C * RP)
      ptx::cp_async16(ptx::smem_u32(&st.X[r][pc * 8]), x + (r < n ? r * HD + pc * 8 : 0), r < n ? 16 : 0);
  }
}

// Where step i of a sequence's walk reads and writes: its chunk (forward: i, backward: nch - 1 - i).
struct SeqWalk {
  int64_t begin, end, c0, nch;

  __device__ int64_t chunk(int64_t i, bool reverse) const { return reverse ? nch - 1 - i : i; }
  __device__ int rows(int64_t lc) const {
    const int64_t left = end - (begin + C * lc);
    return int(left < C ? left : C);
  }
};

// The saved states (S0^T, dS^T: value rows j, key columns c, bf16) are stored with the 16-byte pieces of each row
// permuted: logical piece c / 8 of row j at piece (c / 8) ^ (j & mask), mask = min(8, D / 8) - 1. That is the
// layout StateOut writes without bank conflicts and copies out in one piece; readers undo it (state_col).
__host__ __device__ constexpr int state_swizzle(int D) { return (D / 8 >= 8 ? 8 : D / 8) - 1; }
__host__ __device__ constexpr int state_col(int j, int c, int swizzle) {
  return (((c >> 3) ^ (j & swizzle)) << 3) | (c & 7);
}

// A warp's 16 rows of a D x D state (S^T or dS^T) leave through shared memory: the A operand of each k-step of the
// step's first product (the state's bf16 pairs, keys 16 ks .. 16 ks + 15) is also written by stmatrix into the
// warp's staging rows (dense, pieces permuted as above: the 8 rows of a matrix land in 8 distinct bank groups), and
// lane 0 copies the 16 rows, contiguous in the tape, to global memory in one bulk copy. Two staging buffers, so a
// step's copy overlaps the next step. Stored from the fragments, the state would take 32 scattered 4-byte stores per
// lane and step, whose queue delays the ldmatrix loads behind them; one copy from one lane keeps the issue cost
// off the walk (docs/BENCHMARKS.md has the measurements).
template <int D>
struct StateOut {
  static constexpr int kSwz = state_swizzle(D);
  uint32_t rows;  // this step's staging rows [16][D] (shared window)
  // Waits until the copy that last read `buf` (two steps ago) is done with it.
  __device__ __forceinline__ void begin(uint32_t buf) {
    rows = buf;
    if (lane_id() == 0) ptx::bulk_wait_read<1>();
    __syncwarp();
  }
  __device__ __forceinline__ void put(int ks, const uint32_t (&a)[4]) {
    const int l = lane_id();  // row (l & 7) of matrix l / 8: rows + 8 (bit 0 of the matrix), keys + 8 (bit 1)
    const int row = (l & 7) + ((l >> 3) & 1) * 8;
    ptx::stmatrix_x4(rows + (row * D + state_col(row, ks * 16 + (l >> 4) * 8, kSwz)) * 2, a);
  }
  __device__ __forceinline__ void end(bf16* global_rows) {
    ptx::fence_proxy_async_shared();
    __syncwarp();
    if (lane_id() == 0) {
      ptx::bulk_store(global_rows, rows, C * D * 2);
      ptx::bulk_commit();
    }
  }
  // Before the CTA exits: its copies have read their shared source.
  __device__ __forceinline__ static void drain() {
    if (lane_id() == 0) ptx::bulk_wait<0>();
  }
};

// The walk's pipeline: stages for steps 0 .. kStages - 2 queued before the loop; step i queues step i + kStages - 1
// into stage (i + kStages - 1) mod kStages and waits for its own. `x` is V (forward) or dO (backward), at the CTA's
// first value column.
template <int D, bool kReverse>
__device__ __forceinline__ void queue_step(SeqSmem<D>& sm, const SeqWalk& w, int64_t i, int stage,
                                           const unsigned char* items, const bf16* x, int H, int h) {
  if (i < w.nch) {
    const int64_t lc = w.chunk(i, kReverse);
    load_stage<D>(sm.st[stage], items + ((w.c0 + lc) * H + h) * Item<D>::kBytes,
                  x + (w.begin + C * lc) * int64_t(H) * D, int64_t(H) * D, w.rows(lc));
  }
  ptx::cp_async_commit();  // possibly empty: the wait below counts groups
}

// This lane's part of an ldmatrix row address (bytes) into a tile of row stride ld elements, for ldb_nk and ldb_kn
// (the same formulas): the sequential kernels add it to a tile's 32-bit shared address once per step, and the k/n
// offsets are compile-time constants, so a load costs no address arithmetic (the step's time follows its
// instruction count).
struct LaneOff {
  uint32_t nk, kn;
  __device__ __forceinline__ explicit LaneOff(int ld) {
    const int l = lane_id();
    nk = uint32_t((((l & 7) + (l >> 4) * 8) * ld + ((l >> 3) & 1) * 8) * 2);
    kn = uint32_t((((l & 7) + ((l >> 3) & 1) * 8) * ld + (l >> 4) * 8) * 2);
  }
};

// The shared addresses of a stage's tiles (bytes).
template <int D>
struct StageAddr {
  uint32_t Kt, Qt, Kd, Aw, A, M;
  const float* El;
  const bf16* X;
  __device__ __forceinline__ StageAddr(const SeqStage<D>& st) {
    const uint32_t base = ptx::smem_u32(&st);
    Kt = base + Item<D>::kKt, Qt = base + Item<D>::kQt, Kd = base + Item<D>::kKd;
    Aw = base + Item<D>::kAw, A = base + Item<D>::kA, M = base + Item<D>::kM;
    El = st.it.El;
    X = &st.X[0][0];
  }
};

// Forward: warp w keeps the state columns v0 .. v0 + 15 as S^T (16 values x D keys): S[nt] is the accumulator
// tile of keys 8 nt .. 8 nt + 7.
template <int D>
__global__ void __launch_bounds__(seq_warps<D>() * 32, 1)
    fwd_seq_kernel(Params p, const unsigned char* items, float* o, bf16* states) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SeqSmem<D>& sm = *reinterpret_cast<SeqSmem<D>*>(smem_raw);
  constexpr int LD = ld_of<D>(), NV = SeqStage<D>::NV, kLdX = SeqStage<D>::kLdX;
  const int b = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = lane_id(), g = lane >> 2, q = lane & 3;
  const int wv = warp * 16, v0 = blockIdx.z * NV + wv;
  const SeqWalk w{p.cu_seqlens[b], p.cu_seqlens[b + 1], p.chunk_offsets[b],
                  (p.cu_seqlens[b + 1] - p.cu_seqlens[b] + C - 1) / C};
  const int64_t HD = int64_t(p.H) * D;
  const bf16* x = reinterpret_cast<const bf16*>(p.v) + int64_t(h) * D + blockIdx.z * NV;
  const LaneOff big(LD), small(kLdT);
  const int xo = 2 * q * kLdX + wv + g;  // X[2q][wv + g]: this lane's first V^T element
  // o's element (token row0 + 2q, column v0 + g); (8 j + (e & 1)) HD + 8 (e >> 1) from there.
  float* o_lane = o + (w.begin + 2 * q) * HD + int64_t(h) * D + v0 + g;
  bf16* st_rows = states + ((w.c0 * p.H + h) * D + v0) * D;  // chunk c0's S0^T rows of this warp
  const int64_t st_step = int64_t(p.H) * D * D;
  float S[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) S[nt][e] = 0.f;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) queue_step<D, false>(sm, w, i, i, items, x, p.H, h);
  int stage = 0;
  for (int64_t lc = 0; lc < w.nch; ++lc) {
    const int n = w.rows(lc);
    queue_step<D, false>(sm, w, lc + kStages - 1, (stage + kStages - 1) % kStages, items, x, p.H, h);
    ptx::cp_async_wait<kStages - 1>();
    __syncthreads();  // stage lc visible to every warp
    const StageAddr<D> sa(sm.st[stage]);
    // S0^T leaves (value-major, bf16) from the A operands of the first product.
    StateOut<D> so;
    so.begin(ptx::smem_u32(&sm.out[lc & 1][warp][0]));
    // V^T (accumulator layout: value row, token column).
    float y[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] = __bfloat162float(sa.X[xo + (8 * j + (e & 1)) * kLdX + 8 * (e >> 1)]);
    // S0^T as A operands (keys 16 ks .. 16 ks + 15), for Y^T and O^T.
    float pk[2][4], ok[2][4];
    zero2(pk);
    zero2(ok);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b0[4], b1[4];
      pack_a(a, S[2 * ks], S[2 * ks + 1]);
      so.put(ks, a);
      ptx::ldmatrix_x4(b0, sa.Kt + big.nk + ks * 32);  // B[c][t] = Kt[t][c]
      ptx::ldmatrix_x4(b1, sa.Qt + big.nk + ks * 32);
      mma2(pk, a, b0);
      mma2(ok, a, b1);
    }
    so.end(st_rows);
    st_rows += st_step;
    // Y^T = V^T - S0^T Kt^T; U^T = Y^T Aw^T.
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] -= pk[j][e];
    float u[2][4];
    zero2(u);
    {
      uint32_t a[4], bb[4];
      pack_a(a, y[0], y[1]);
      ptx::ldmatrix_x4(bb, sa.Aw + small.nk);  // B[s][r] = Aw[r][s]
      mma2(u, a, bb);
    }
    uint32_t au[4];
    pack_a(au, u[0], u[1]);
    // O^T = S0^T Qt^T + U^T M^T.
    {
      uint32_t bb[4];
      ptx::ldmatrix_x4(bb, sa.M + small.nk);  // B[s][r] = M[r][s]
      mma2(ok, au, bb);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (8 * j + 2 * q + (e & 1) < n) o_lane[(8 * j + (e & 1)) * HD + 8 * (e >> 1)] = ok[j][e];
    o_lane += C * HD;
    // S^T <- S^T Diag(El) + U^T Kd.
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float2 el = *reinterpret_cast<const float2*>(sa.El + nt * 8 + 2 * q);
      S[nt][0] *= el.x;
      S[nt][1] *= el.y;
      S[nt][2] *= el.x;
      S[nt][3] *= el.y;
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t bb[4];
      ptx::ldmatrix_x4_trans(bb, sa.Kd + big.kn + np * 32);  // B[t][c] = Kd[t][c]
      ptx::mma_bf16_16816(S[2 * np], au, bb[0], bb[1]);
      ptx::mma_bf16_16816(S[2 * np + 1], au, bb[2], bb[3]);
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
    __syncthreads();  // every warp is done with stage lc before step lc + 1 refills it
  }
  ptx::cp_async_wait<0>();  // no copy outlives the CTA's shared memory
  StateOut<D>::drain();
}

// Backward, sequential part: the forward's grid, chunks in reverse; warp w keeps dS^T (16 values x D keys).
template <int D>
__global__ void __launch_bounds__(seq_warps<D>() * 32, 1)
    bwd_seq_kernel(Params p, const unsigned char* items, const bf16* d_o, bf16* dstates, bf16* dB, bf16* dv) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SeqSmem<D>& sm = *reinterpret_cast<SeqSmem<D>*>(smem_raw);
  constexpr int LD = ld_of<D>(), NV = SeqStage<D>::NV, kLdX = SeqStage<D>::kLdX;
  const int b = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = lane_id(), g = lane >> 2, q = lane & 3;
  const int wv = warp * 16, v0 = blockIdx.z * NV + wv;
  const SeqWalk w{p.cu_seqlens[b], p.cu_seqlens[b + 1], p.chunk_offsets[b],
                  (p.cu_seqlens[b + 1] - p.cu_seqlens[b] + C - 1) / C};
  const int64_t HD = int64_t(p.H) * D;
  const bf16* x = d_o + int64_t(h) * D + blockIdx.z * NV;
  const LaneOff big(LD), small(kLdT);
  const int xo = 2 * q * kLdX + wv + g;  // X[2q][wv + g]: this lane's first dO^T element
  // dv's and dB's element (token 2q of the last chunk, column v0 + g); (8 j + (e & 1)) HD + 8 (e >> 1) from there.
  const int64_t lane_off = (w.begin + C * (w.nch - 1) + 2 * q) * HD + int64_t(h) * D + v0 + g;
  bf16* dv_lane = dv + lane_off;
  bf16* dB_lane = dB + lane_off;
  const int64_t st_step = int64_t(p.H) * D * D;
  bf16* st_rows = dstates + (((w.c0 + w.nch - 1) * p.H + h) * D + v0) * D;  // the last chunk's dS^T rows
  float dS[D / 8][4];
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dS[nt][e] = 0.f;
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) queue_step<D, true>(sm, w, i, i, items, x, p.H, h);
  int stage = 0;
  for (int64_t i = 0; i < w.nch; ++i) {
    const int n = w.rows(w.chunk(i, true));
    queue_step<D, true>(sm, w, i + kStages - 1, (stage + kStages - 1) % kStages, items, x, p.H, h);
    ptx::cp_async_wait<kStages - 1>();
    __syncthreads();
    const StageAddr<D> sa(sm.st[stage]);
    // dS^T (the gradient w.r.t. the state leaving this chunk) leaves as S0^T does in the forward.
    StateOut<D> so;
    so.begin(ptx::smem_u32(&sm.out[i & 1][warp][0]));
    // dO^T as an A operand: A[val][tok] = dO[tok][val] (rows past the chunk's end are zero).
    uint32_t ado[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int off = xo + (k & 1) * 8 + (k >> 1) * 8 * kLdX;  // value g + 8 (k & 1), token 2q + 8 (k >> 1)
      ado[k] = uint32_t(__bfloat16_as_ushort(sa.X[off])) | uint32_t(__bfloat16_as_ushort(sa.X[off + kLdX])) << 16;
    }
    // dU^T = dS^T Kd^T + dO^T M.
    float du[2][4];
    zero2(du);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], bb[4];
      pack_a(a, dS[2 * ks], dS[2 * ks + 1]);
      so.put(ks, a);
      ptx::ldmatrix_x4(bb, sa.Kd + big.nk + ks * 32);  // B[c][t] = Kd[t][c]
      mma2(du, a, bb);
    }
    so.end(st_rows);
    st_rows -= st_step;
    {
      uint32_t bb[4];
      ptx::ldmatrix_x4_trans(bb, sa.M + small.kn);  // B[t][r] = M[t][r]
      mma2(du, ado, bb);
    }
    // dX^T = dU^T Aw; dB^T = dU^T - dX^T A.
    float dx[2][4], ax[2][4];
    zero2(dx);
    zero2(ax);
    {
      uint32_t a[4], bb[4];
      pack_a(a, du[0], du[1]);
      ptx::ldmatrix_x4_trans(bb, sa.Aw + small.kn);  // B[t][r] = Aw[t][r]
      mma2(dx, a, bb);
    }
    uint32_t adx[4], adxn[4];
    pack_a(adx, dx[0], dx[1]);
    pack_a(adxn, dx[0], dx[1], -1.f);
    {
      uint32_t bb[4];
      ptx::ldmatrix_x4_trans(bb, sa.A + small.kn);  // B[t][r] = A[t][r]
      mma2(ax, adx, bb);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (8 * j + 2 * q + (e & 1) < n) {
          const int64_t off = (8 * j + (e & 1)) * HD + 8 * (e >> 1);
          dv_lane[off] = __float2bfloat16_rn(dx[j][e]);
          dB_lane[off] = __float2bfloat16_rn(du[j][e] - ax[j][e]);
        }
    dv_lane -= C * HD;
    dB_lane -= C * HD;
    // dS^T <- dS^T Diag(El) + dO^T Qt - dX^T Kt.
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      const float2 el = *reinterpret_cast<const float2*>(sa.El + nt * 8 + 2 * q);
      dS[nt][0] *= el.x;
      dS[nt][1] *= el.y;
      dS[nt][2] *= el.x;
      dS[nt][3] *= el.y;
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t bq[4], bk[4];
      ptx::ldmatrix_x4_trans(bq, sa.Qt + big.kn + np * 32);  // B[t][c] = Qt[t][c]
      ptx::ldmatrix_x4_trans(bk, sa.Kt + big.kn + np * 32);
      ptx::mma_bf16_16816(dS[2 * np], ado, bq[0], bq[1]);
      ptx::mma_bf16_16816(dS[2 * np + 1], ado, bq[2], bq[3]);
      ptx::mma_bf16_16816(dS[2 * np], adxn, bk[0], bk[1]);
      ptx::mma_bf16_16816(dS[2 * np + 1], adxn, bk[2], bk[3]);
    }
    stage = stage == kStages - 1 ? 0 : stage + 1;
    __syncthreads();  // stage i free for step i + 1's refill
  }
  ptx::cp_async_wait<0>();
  StateOut<D>::drain();
}

// ---- backward, chunk-parallel part --------------------------------------------------------------------------
// Shared memory of bwd_chunk. `big` holds S0^T and dS^T (value-major [j][c], bf16, rows padded) through phase 3;
// then Qr, Kr, Ki (bf16 [C][LD] each) and dGamma, dKd*Kd (fp32 [C][D] each, after the three tiles).
template <int D>
struct BwdChunkSmem {
  static constexpr int LD = ld_of<D>();
  static constexpr int kStateElems = D * LD;                           // one padded D x D bf16 tile
  static constexpr int kTileElems = C * LD;                            // one padded 16 x D bf16 tile
  static constexpr int kF32Off = (3 * kTileElems * 2 + 15) / 16 * 16;  // bytes: dgam, ykd after Qr, Kr, Ki
  static constexpr int kRawOff = kF32Off + 2 * C * D * 4;  // bytes: q, k (bf16 [C][LD] each) after dgam, ykd
  static constexpr int kBigBytes =
      2 * kStateElems * 2 > kRawOff + 2 * kTileElems * 2 ? 2 * kStateElems * 2 : kRawOff + 2 * kTileElems * 2;
  alignas(16) unsigned char big[kBigBytes];
  bf16 Kt[C][LD], dO[C][LD], dX[C][LD], V[C][LD], dBt[C][LD];
  bf16 UT[D][kLdT];  // U^T [value][token]
  bf16 Aw[C][kLdT], A[C][kLdT], dA[C][kLdT], dM[C][kLdT];
  float gam[C][D];  // Gamma (padded rows: g = 0)
  float dgl[D];     // sum_j S0[c][j] dS[c][j] per key channel c
  float part[D / 16][C];
  float dMd[C];  // the diagonal of dO U^T (fp32)

  __device__ bf16* S0T() { return reinterpret_cast<bf16*>(big); }
  __device__ bf16* dST() { return reinterpret_cast<bf16*>(big) + kStateElems; }
  __device__ bf16* Qr() { return reinterpret_cast<bf16*>(big); }
  __device__ bf16* Kr() { return reinterpret_cast<bf16*>(big) + kTileElems; }
  __device__ bf16* Ki() { return reinterpret_cast<bf16*>(big) + 2 * kTileElems; }
  __device__ float (*dgam())[D] { return reinterpret_cast<float(*)[D]>(big + kF32Off); }
  __device__ float (*ykd())[D] { return reinterpret_cast<float(*)[D]>(big + kF32Off + C * D * 4); }
  __device__ bf16* Qraw() { return reinterpret_cast<bf16*>(big + kRawOff); }
  __device__ bf16* Kraw() { return reinterpret_cast<bf16*>(big + kRawOff) + kTileElems; }
};

// One CTA of 2 D threads (D / 16 warps) per (chunk, head). Warp w owns value rows 16 w .. 16 w + 15 of Y^T, U^T,
// X^T (phase 2) and key channels 16 w .. 16 w + 15 of the gradients (phases 3-5).
template <int D>
__global__ void __launch_bounds__(2 * D, 2)
    bwd_chunk_kernel(Params p, const unsigned char* items, const bf16* states, const bf16* d_o, const bf16* dstates,
                     const bf16* dB, const bf16* dv, uint16_t* dq, uint16_t* dk, float* dg, float* dbeta) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using Sm = BwdChunkSmem<D>;
  Sm& s = *reinterpret_cast<Sm*>(smem_raw);
  using I = Item<D>;
  constexpr int LD = ld_of<D>(), NT = 2 * D, RP = D / 8;  // RP: 16-byte pieces per bf16 row of D
  const int64_t ci = chunk_train::grid_chunk();
  if (ci >= p.chunks) return;
  const int h = chunk_train::grid_head(), tid = threadIdx.x, warp = tid / 32, lane = lane_id(), g = lane >> 2,
            q = lane & 3;
  const ChunkLoc L = locate_chunk(p, ci);
  const int n = L.n;
  const int64_t row0 = L.row0, HD = int64_t(p.H) * D, hD = int64_t(h) * D;
  const unsigned char* it = items + (ci * p.H + h) * I::kBytes;
  const bf16* S0g = states + (ci * p.H + h) * D * D;
  const bf16* dSg = dstates + (ci * p.H + h) * D * D;
  bf16* const S0T = s.S0T();
  bf16* const dST = s.dST();

  // Phase 1: S0^T, Kt, Aw, A, V and dB by cp.async (one group), dS^T, dO, dX and g (a second group, not needed
  // before phase 3); meanwhile this thread's q, k into registers (phase 3b). Every global read but q, k's is a
  // cp.async, so no warp waits on memory before phase 2. The tape's permuted state pieces go back in order; token
  // rows >= n are zero-filled.
  auto load_state = [&](bf16* dst, const bf16* src) {
    for (int i = tid; i < D * RP; i += NT) {
      const int r = i / RP, pc = i % RP;
      ptx::cp_async16(ptx::smem_u32(dst + r * LD + state_col(r, pc * 8, state_swizzle(D))), src + r * D + pc * 8, 16);
    }
  };
  load_state(S0T, S0g);
  // Kt, then Aw and A (adjacent in the item and in shared memory): flat runs of 16-byte pieces.
  for (int i = tid; i < I::kBig / 16; i += NT) ptx::cp_async16(ptx::smem_u32(&s.Kt[0][0]) + i * 16, it + I::kKt + i * 16, 16);
  for (int i = tid; i < 2 * I::kSmall / 16; i += NT)
    ptx::cp_async16(ptx::smem_u32(&s.Aw[0][0]) + i * 16, it + I::kAw + i * 16, 16);
  // Token rows of D bf16 (RP pieces) from x into tile t; rows >= n zero-filled.
  auto load_rows = [&](bf16(*t)[LD], const bf16* x) {
    for (int i = tid; i < C * RP; i += NT) {
      const int r = i / RP, pc = i % RP;
      ptx::cp_async16(ptx::smem_u32(&t[r][pc * 8]), x + (r < n ? (row0 + r) * HD + hD + pc * 8 : 0), r < n ? 16 : 0);
    }
  };
  load_rows(s.V, reinterpret_cast<const bf16*>(p.v));
  load_rows(s.dBt, dB);
  ptx::cp_async_commit();
  load_state(dST, dSg);
  load_rows(s.dO, d_o);
  load_rows(s.dX, dv);
  for (int i = tid; i < C * D / 4; i += NT) {  // g: D fp32 (D / 4 pieces) per row
    const int r = i / (D / 4), pc = i % (D / 4);
    ptx::cp_async16(ptx::smem_u32(&s.gam[r][pc * 4]), p.g + (r < n ? (row0 + r) * HD + hD + pc * 4 : 0),
                    r < n ? 16 : 0);
  }
  ptx::cp_async_commit();
  const int v0 = warp * 16;                    // phase 2: value rows; phases 3-5: key channels (n0)
  const int c_own = tid % D, r_own = tid / D;  // phase 3b: channel c_own of rows r_own, r_own + 2, ..
  float qv[C / 2], kv[C / 2];                  // bf16 q, k widened (rows >= n: 0)
#pragma unroll
  for (int i = 0; i < C / 2; ++i) {
    const int r = r_own + 2 * i;
    const int64_t off = (row0 + r) * HD + hD + c_own;
    qv[i] = r < n ? ld_bf16(p.q, off) : 0.f;
    kv[i] = r < n ? ld_bf16(p.k, off) : 0.f;
  }
  ptx::cp_async_wait<1>();  // S0^T, the item's tiles, V, dB
  __syncthreads();
  float y[2][4], db[2][4];  // V^T, dB^T (value row, token column)
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int tok = frag_col(j, e), val = v0 + frag_row(e);
      y[j][e] = __bfloat162float(s.V[tok][val]);
      db[j][e] = __bfloat162float(s.dBt[tok][val]);
    }

  // Phase 2 (warp w, value rows v0 ..): Y^T = V^T - S0^T Kt^T, U^T = Y^T Aw^T (to shared memory), X^T = Y^T - U^T
  // A^T, and the dbeta partials sum_j dB[r][j] X[r][j] over the warp's 16 values.
  {
    float acc[2][4];
    zero2(acc);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b[4];
      lda_row(a, S0T + v0 * LD, LD, ks * 16);  // A[j][c] = S0^T[v0 + j][c]
      ldb_nk(b, &s.Kt[0][0], LD, 0, ks * 16);  // B[c][t] = Kt[t][c]
      mma2(acc, a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) y[j][e] -= acc[j][e];
    float u[2][4];
    zero2(u);
    {
      uint32_t a[4], b[4];
      pack_a(a, y[0], y[1]);
      ldb_nk(b, &s.Aw[0][0], kLdT, 0, 0);  // B[s][r] = Aw[r][s]
      mma2(u, a, b);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      *reinterpret_cast<uint32_t*>(&s.UT[v0 + g][8 * j + 2 * q]) = ptx::pack_bf16x2(u[j][0], u[j][1]);
      *reinterpret_cast<uint32_t*>(&s.UT[v0 + g + 8][8 * j + 2 * q]) = ptx::pack_bf16x2(u[j][2], u[j][3]);
    }
    float ax[2][4];
    zero2(ax);
    {
      uint32_t a[4], b[4];
      pack_a(a, u[0], u[1]);
      ldb_nk(b, &s.A[0][0], kLdT, 0, 0);  // B[s][r] = A[r][s]
      mma2(ax, a, b);
    }
    float pt[2][2];  // token 8 j + 2 q + i
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        pt[j][i] = db[j][i] * (y[j][i] - ax[j][i]) + db[j][i + 2] * (y[j][i + 2] - ax[j][i + 2]);
#pragma unroll
        for (int m = 4; m < 32; m *= 2) pt[j][i] += __shfl_xor_sync(0xffffffffu, pt[j][i], m);
      }
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s.part[warp][8 * j + 2 * q] = pt[j][0];
        s.part[warp][8 * j + 2 * q + 1] = pt[j][1];
      }
    }
  }
  ptx::cp_async_wait<0>();  // dS^T
  __syncthreads();          // U^T and dS^T complete

  // Phase 3 (warp w, key channels n0 ..): dQt = dO S0^T, dKt = -dX S0^T, dKd = U dS^T, and rowsum(S0 * dS) from the
  // same B fragments; warps 0, 1: dM, dA. dM keeps its strictly lower part for the pair chain; its diagonal (M_rr =
  // Q_r . k_r, no decay) goes to dq, dk directly: through Qr Ki its Gamma terms would be two O(1) products that
  // cancel exactly, leaving bf16 noise.
  const int n0 = v0;
  float dqt[2][4], dkt[2][4], dkd[2][4];
  zero2(dqt);
  zero2(dkt);
  zero2(dkd);
  {
    float gl[2] = {0.f, 0.f};  // keys n0 + g, n0 + 8 + g
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ao[4], ax[4], au[4], bs[4], bd[4];
      lda_row(ao, &s.dO[0][0], LD, ks * 16);
      lda_row(ax, &s.dX[0][0], LD, ks * 16);
      lda_trans(au, &s.UT[0][0], kLdT, ks * 16, 0);  // A[t][j] = U^T[j][t]
      ldb_kn(bs, S0T, LD, ks * 16, n0);              // B[j][c] = S0^T[j][c]
      ldb_kn(bd, dST, LD, ks * 16, n0);
      mma2(dqt, ao, bs);
      mma2(dkt, ax, bs);
      mma2(dkd, au, bd);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 a = ptx::unpack_bf16x2(bs[i]), b = ptx::unpack_bf16x2(bd[i]);
        gl[i >> 1] = fmaf(a.x, b.x, fmaf(a.y, b.y, gl[i >> 1]));
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      gl[i] += __shfl_xor_sync(0xffffffffu, gl[i], 1);
      gl[i] += __shfl_xor_sync(0xffffffffu, gl[i], 2);
    }
    if (q == 0) {
      s.dgl[n0 + g] = gl[0];
      s.dgl[n0 + 8 + g] = gl[1];
    }
  }
  if (warp < 2) {
    float acc[2][4];
    zero2(acc);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], b[4];
      lda_row(a, warp == 0 ? &s.dO[0][0] : &s.dX[0][0], LD, ks * 16);
      ldb_kn(b, &s.UT[0][0], kLdT, ks * 16, 0);  // B[j][s] = U^T[j][s]
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
  if (tid >= NT - D) {  // Gamma = the cumulative sum of g over the chunk, in place (channel tid - (NT - D))
    const int c = tid - (NT - D);
    float G = 0.f;
#pragma unroll
    for (int r = 0; r < C; ++r) {
      G += s.gam[r][c];
      s.gam[r][c] = G;
    }
  }
  __syncthreads();  // S0^T, dS^T read for the last time; Gamma complete

  // Phase 3b: Qr, Kr, Ki where S0^T was (channel c_own of rows r_own, r_own + 2, ..), and q, k as they came, for
  // phase 5.
  {
    bf16 *Qr = s.Qr(), *Kr = s.Kr(), *Ki = s.Ki();
    const float Gm = s.gam[kMid][c_own];
#pragma unroll
    for (int i = 0; i < C / 2; ++i) {
      const int r = r_own + 2 * i;
      const float gr = s.gam[r][c_own], er = expf(gr - Gm), ei = expf(Gm - gr);
      s.Qraw()[r * LD + c_own] = __float2bfloat16_rn(qv[i]);  // exact: qv is a widened bf16
      s.Kraw()[r * LD + c_own] = __float2bfloat16_rn(kv[i]);
      Qr[r * LD + c_own] = __float2bfloat16_rn(p.scale * qv[i] * er);
      Kr[r * LD + c_own] = __float2bfloat16_rn(kv[i] * er);
      Ki[r * LD + c_own] = __float2bfloat16_rn(kv[i] * ei);
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
    ldb_kn(bi, s.Ki(), LD, 0, n0);  // B[s][c] = Ki[s][c]
    ldb_kn(br, s.Kr(), LD, 0, n0);
    ldb_kn(bq, s.Qr(), LD, 0, n0);
    mma2(dkr, aa, bi);
    mma2(dqr, am, bi);
    mma2(dki, aat, br);
    mma2(dki, amt, bq);
  }
  // Phase 5: the elementwise chain rule per accumulator pair (r, c), (r, c + 1), in fp32 from the inputs (bf16 q, k
  // widened exactly; fp32 decays); dq, dk rounded to bf16 once, at the store.
  float(*dgam)[D] = s.dgam();
  float(*ykd)[D] = s.ykd();
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = g + 8 * hh, c = n0 + 8 * j + 2 * q;
      float2 dgam2 = make_float2(0.f, 0.f), y2 = make_float2(0.f, 0.f);
      if (r < n) {
        const int64_t off = (row0 + r) * HD + hD + c;
        const float2 q2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s.Qraw() + r * LD + c)),
                     k2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(s.Kraw() + r * LD + c));
        float dq2[2], dk2[2], dgm[2], yy[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int e = 2 * hh + i;
          const float qv_ = p.scale * (i == 0 ? q2.x : q2.y), kv_ = i == 0 ? k2.x : k2.y;
          const float gr = s.gam[r][c + i], Gm = s.gam[kMid][c + i], Gl = s.gam[n - 1][c + i];
          const float E = expf(gr), eP = expf(Gl - gr), eR = expf(gr - Gm), eI = expf(Gm - gr);
          const float gqt = dqt[j][e], gkt = -dkt[j][e], gkd = dkd[j][e], gqr = dqr[j][e], gkr = dkr[j][e],
                      gki = dki[j][e];
          const float dmd = s.dMd[r];
          dq2[i] = p.scale * (gqt * E + gqr * eR + dmd * kv_);
          dk2[i] = gkt * E + gkd * eP + gkr * eR + gki * eI + dmd * qv_;
          yy[i] = r == n - 1 ? 0.f : gkd * (kv_ * eP);  // Kd_{n-1} = k_{n-1}: no dependence on Gamma
          dgm[i] = gqt * (qv_ * E) + gkt * (kv_ * E) - yy[i] + gqr * (qv_ * eR) + gkr * (kv_ * eR) - gki * (kv_ * eI);
        }
        st_bf16x2(dq, off, dq2[0], dq2[1]);
        st_bf16x2(dk, off, dk2[0], dk2[1]);
        dgam2 = make_float2(dgm[0], dgm[1]);
        y2 = make_float2(yy[0], yy[1]);
      }
      *reinterpret_cast<float2*>(&dgam[r][c]) = dgam2;
      *reinterpret_cast<float2*>(&ykd[r][c]) = y2;
    }
  __syncthreads();
  // Phase 6: dGamma_{n-1} += sum_r dKd_r Kd_r + El rowsum(S0 dS); dg = reverse cumulative sum (per channel).
  if (tid < D) {
    const int c = tid;
    float ysum = 0.f;
    for (int r = 0; r < n; ++r) ysum += ykd[r][c];
    float acc = expf(s.gam[n - 1][c]) * s.dgl[c] + ysum;
    for (int r = n - 1; r >= 0; --r) {
      acc += dgam[r][c];
      dg[(row0 + r) * HD + hD + c] = acc;
    }
  } else if (tid - D < n) {
    const int r = tid - D;
    float a = 0.f;
    for (int w = 0; w < D / 16; ++w) a += s.part[w][r];
    dbeta[(row0 + r) * p.H + h] = a;
  }
}

// The tape's bf16 S0^T [chunks, H, D, D] (value-major) as fp32 key-major states.
__global__ void states_to_f32_kernel(const bf16* st, float* out, int64_t mats, int D, int swizzle) {
  const int64_t DD = int64_t(D) * D;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < mats * DD;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / DD;
    const int c = int((i % DD) / D), j = int(i % D);  // out[m][c][j] = S^T[m][j][c]
    out[i] = __bfloat162float(st[m * DD + int64_t(j) * D + state_col(j, c, swizzle)]);
  }
}

// ---- host side ----------------------------------------------------------------------------------------------
constexpr size_t kMaxSmem = 227 * 1024;
static_assert(sizeof(BwdChunkSmem<128>) <= kMaxSmem / 2 - 1024 && sizeof(SeqSmem<128>) <= kMaxSmem,
              "bwd_chunk runs two CTAs per SM at D = 128");

size_t item_bytes(int D) {
  return size_t(D == 32 ? Item<32>::kBytes : D == 64 ? Item<64>::kBytes : Item<128>::kBytes);
}
size_t states_bytes(const Params& p) { return size_t(p.chunks) * size_t(p.H) * size_t(p.D) * size_t(p.D) * 2; }

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
dim3 seq_grid(const Params& p) {
  return dim3(unsigned(p.B), unsigned(p.H), unsigned(D / SeqStage<D>::NV));
}

template <int D>
void forward(const Params& p, float* o, void* saved) {
  auto* states = static_cast<bf16*>(saved);
  auto* items = static_cast<unsigned char*>(saved) + states_bytes(p);
  prep_kernel<D><<<chunk_train::chunk_head_grid(p.chunks, p.H), prep_threads<D>()>>>(p, items);
  K3_CUDA_LAUNCH_CHECK();
  static bool attr = false;
  launch(fwd_seq_kernel<D>, attr, seq_grid<D>(p), seq_warps<D>() * 32, sizeof(SeqSmem<D>), p,
         static_cast<const unsigned char*>(items), o, states);
}

template <int D>
void backward(const Params& p, const bf16* d_o, const void* saved, uint16_t* dq, uint16_t* dk, bf16* dv, float* dg,
              float* dbeta, void* workspace) {
  const auto* states = static_cast<const bf16*>(saved);
  const auto* items = static_cast<const unsigned char*>(saved) + states_bytes(p);
  auto* dstates = static_cast<bf16*>(workspace);
  bf16* dB = reinterpret_cast<bf16*>(static_cast<unsigned char*>(workspace) + states_bytes(p));
  static bool attr_seq = false, attr_chunk = false;
  launch(bwd_seq_kernel<D>, attr_seq, seq_grid<D>(p), seq_warps<D>() * 32, sizeof(SeqSmem<D>), p, items, d_o, dstates, dB,
         dv);
  launch(bwd_chunk_kernel<D>, attr_chunk, chunk_train::chunk_head_grid(p.chunks, p.H), 2 * D, sizeof(BwdChunkSmem<D>),
         p, items, states, d_o, static_cast<const bf16*>(dstates), static_cast<const bf16*>(dB),
         static_cast<const bf16*>(dv), dq, dk, dg, dbeta);
}

}  // namespace

size_t kda_chunk_train_bf16_saved_bytes(const KdaTrainBf16Params& p) {
  chunk_train::check_params("kda_chunk_train_bf16_saved_bytes", p);
  return states_bytes(p) + size_t(p.chunks) * size_t(p.H) * item_bytes(p.D);
}

size_t kda_chunk_backward_train_bf16_workspace_bytes(const KdaTrainBf16Params& p) {
  chunk_train::check_params("kda_chunk_backward_train_bf16_workspace_bytes", p);
  return states_bytes(p) + size_t(p.rows) * size_t(p.H) * size_t(p.D) * 2;
}

void kda_chunk_forward_train_bf16(const KdaTrainBf16Params& p, float* o, void* saved) {
  const char* fn = "kda_chunk_forward_train_bf16";
  chunk_train::check_params(fn, p);
  if (p.rows == 0) return;
  chunk_train::check_pointers(fn, p);
  K3_CHECK(o != nullptr, fn, ": o must be non-null");
  chunk_train::check_workspace(fn, saved, "the tape (saved)");
  K3_CHECK(reinterpret_cast<uintptr_t>(p.v) % 16 == 0, fn, ": v must be 16-byte aligned");
  switch (p.D) {
    case 32: forward<32>(p, o, saved); break;
    case 64: forward<64>(p, o, saved); break;
    default: forward<128>(p, o, saved); break;
  }
}

void kda_chunk_backward_train_bf16(const KdaTrainBf16Params& p, const uint16_t* d_o, const void* saved, uint16_t* dq,
                                   uint16_t* dk, uint16_t* dv, float* dg, float* dbeta, void* workspace) {
  const char* fn = "kda_chunk_backward_train_bf16";
  if (!chunk_train::check_backward(fn, p, d_o, saved, dq, dk, dv, dg, dbeta, workspace)) return;
  chunk_train::check_workspace(fn, saved, "the tape (saved)");
  K3_CHECK(reinterpret_cast<uintptr_t>(d_o) % 16 == 0 && reinterpret_cast<uintptr_t>(dv) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(p.v) % 16 == 0 && reinterpret_cast<uintptr_t>(p.g) % 16 == 0,
           fn, ": d_o, dv, v and g must be 16-byte aligned");
  const auto* o16 = reinterpret_cast<const bf16*>(d_o);
  auto* dv16 = reinterpret_cast<bf16*>(dv);
  switch (p.D) {
    case 32: backward<32>(p, o16, saved, dq, dk, dv16, dg, dbeta, workspace); break;
    case 64: backward<64>(p, o16, saved, dq, dk, dv16, dg, dbeta, workspace); break;
    default: backward<128>(p, o16, saved, dq, dk, dv16, dg, dbeta, workspace); break;
  }
}

void kda_chunk_train_bf16_states(const KdaTrainBf16Params& p, const void* saved, float* states) {
  const char* fn = "kda_chunk_train_bf16_states";
  chunk_train::check_params(fn, p);
  if (p.chunks == 0) return;
  chunk_train::check_workspace(fn, saved, "the tape (saved)");
  K3_CHECK(states != nullptr, fn, ": states must be non-null");
  const int64_t mats = p.chunks * int64_t(p.H);
  const int64_t blocks = std::min<int64_t>((mats * p.D * p.D + 255) / 256, 65536);
  states_to_f32_kernel<<<unsigned(blocks), 256>>>(static_cast<const bf16*>(saved), states, mats, p.D,
                                                  state_swizzle(p.D));
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::kda::cuda
