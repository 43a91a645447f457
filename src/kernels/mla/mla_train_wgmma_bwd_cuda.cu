// The training attention's backward on Hopper's warpgroup MMA at K3's head dims (qk 192, v 128).
// mla_train_wgmma_cuda.cuh has the contract; mla_train_tc_cuda.h the semantics and numerics, which these
// kernels keep (operands bf16: q, k, v, dO packed once; products accumulated in fp32; P =
// exp2(log2(e)·scale·S − log2(e)·lse) in fp32 from the unrounded scores, masked entries 0 by selection;
// dK and dQ scaled once at the end) with one difference: dS = P (dP − Delta) takes P as rounded to bf16
// for dV += Pᵀ dO, not the fp32 P. That rounding (2^-9 relative) is the one dS gets anyway as an MMA
// operand, and it lets the scores' registers go before dP's arrive (below).
//
// Two kernels, as the mma.sync backward: one owns dK and dV of 128 keys and walks the query tiles that
// see them, the other owns dQ of 128 queries and walks the key tiles they see. Each recomputes S and dP
// (1.44x the backward's nominal products at these dims) and in exchange writes every output element
// once, from one thread, after a fixed sequence of MMAs: no atomics, so results are bitwise the same
// run to run and a sequence's gradients do not depend on what else is packed with it.
//
// The two are one kernel over a symmetry. A CTA holds RESIDENT operands X [128 rows][192] and Y [128
// rows][128] and streams TILES X' [64][192] and Y' [64][128]:
//   - dK/dV: X = K, Y = V of the CTA's keys; X' = Q, Y' = dO of a query tile. Sᵀ = X X'ᵀ, dPᵀ = Y Y'ᵀ,
//     dV += Pᵀ Y', dK += dSᵀ X'; the queries' log2(e)·lse and Delta come with the tile.
//   - dQ: X = Q, Y = dO of the CTA's queries; X' = K, Y' = V of a key tile. S = X X'ᵀ, dP = Y Y'ᵀ,
//     dQ += dS X'; the rows' statistics are read once into registers.
// Warpgroup 2 produces: one thread loads X and Y once and each tile into a ring of two stages by TMA
// (3-D maps over the packed [H][rows][W] operands, 64-column boxes, 128-byte swizzle; rows past the
// packed buffer arrive as zeros, rows of the next sequence are masked by selection); in dK/dV its first
// warp also copies the tile's statistics into the stage. Warpgroups 0 and 1 consume, 64 resident rows
// each, per tile: (1) S by wgmma m64n64k16 with both operands K-major in shared memory; (2) P in
// registers, rounded to bf16 A fragments (the thread layout of the forward); (3) dV += Pᵀ dO by
// register-A m64n128k16 with dO read MN-major, batched with dP by m64n64k16; (4) dS into bf16 A
// fragments; (5) dK or dQ by register-A m64n192k16 with the tile read MN-major.
// Registers: dK 96 + dV 64 fp32 a thread stay live, beside S (32) in steps 1-2 or P's 16 bf16 pairs and
// dP (32) in steps 3-4: at most 208, under the consumers' 240 (S and dP live together would not fit).
// Heaviest blocks first: dK/dV's earliest keys (they see the most queries), dQ's latest queries.
// Shared memory: X 48 KB + Y 32 KB + 2 × (X' 24 KB + Y' 16 KB + 512 B statistics) = 163 KB.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/sm90_ptx.cuh"
#include "kernels/common/tensor_map_cuda.h"
#include "kernels/mla/mla_train_common.cuh"
#include "kernels/mla/mla_train_wgmma_cuda.cuh"

namespace k3::mla::cuda::wgmma {
namespace {

constexpr int kRows = 128;  // resident rows a CTA: two consumer warpgroups of 64
constexpr int kTile = 64;   // rows of a streamed tile
constexpr int kDq = 192, kDv = 128;
constexpr int kResBox = kRows * 128;                         // a resident box: 128 rows × 64 bf16 (16 KB)
constexpr int kTileBox = kTile * 128;                        // a tile box: 64 rows × 64 bf16 (8 KB)
constexpr int kResX = 3 * kResBox, kResY = 2 * kResBox;      // 48 KB, 32 KB
constexpr int kTileX = 3 * kTileBox, kTileY = 2 * kTileBox;  // 24 KB, 16 KB
constexpr int kStatBytes = 2 * kTile * 4;                    // a tile's log2(e)·lse and Delta (dK/dV)
constexpr int kStages = 2;
constexpr int kThreads = 384;                           // consumers 0, 1; producer 2
constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 2·128·240 + 128·24 = 168·384, the launch's
constexpr size_t kSmemBytes =
    size_t(kResX + kResY) + kStages * size_t(kTileX + kTileY + kStatBytes) + 1024 + 8 * (1 + 2 * kStages);

// A consumer's stage wait. The consumers may not trap (ptxas then holds a region raised by setmaxnreg to
// the launch's 168 registers and spills), so after ptx::kWaitTrapNs a consumer thread exits instead;
// the producer, which waits for the consumers to release every stage before it leaves, then traps,
// and the launch fails rather than hangs.
__device__ __forceinline__ void wait_or_exit(uint32_t bar, uint32_t parity) {
  if (ptx::mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = ptx::global_ns();
  for (uint32_t n = 1; !ptx::mbar_try_wait(bar, parity); ++n)
    if ((n & 1023u) == 0 && ptx::global_ns() - t0 > ptx::kWaitTrapNs) asm volatile("exit;");
}

// d[64][64] = R Tᵀ over W columns: R the warpgroup's 64 rows of a resident operand (boxes kResBox
// apart), T a tile's 64 rows (boxes kTileBox apart), both K-major in 64-column boxes. W/16 wgmma
// m64n64k16, issued into the open group (the caller fences, commits and waits).
template <int W>
__device__ __forceinline__ void issue_rows_times_tile_t(float (&d)[32], uint32_t res, uint32_t tile, int wg) {
#pragma unroll
  for (int kk = 0; kk < W / 16; ++kk) {
    const int blk = kk >> 2, w = kk & 3;
    const uint64_t da = ptx::desc_k_sw128(res + blk * kResBox + wg * 64 * 128) + 2 * w;
    ptx::wgmma_m64n64k16_bf16_ss<0, 0>(d, da, ptx::desc_k_sw128(tile + blk * kTileBox) + 2 * w, kk > 0);
  }
}

struct Grads {
  float* dq;
  int64_t lddq;
  float* dkv;
  int64_t lddkv;
  float* dk_rot_h;
};

// kDkv: the dK/dV kernel (resident K, V; tiles of Q, dO), else the dQ kernel (resident Q, dO; tiles of
// K, V). Maps: mrx, mry the resident X, Y (128-row boxes), mtx, mty the tiles' X', Y' (64-row boxes).
template <bool kDkv>
__global__ void __launch_bounds__(kThreads, 1)
    attn_bwd_sm90_kernel(const __grid_constant__ CUtensorMap mrx, const __grid_constant__ CUtensorMap mry,
                         const __grid_constant__ CUtensorMap mtx, const __grid_constant__ CUtensorMap mty,
                         const PackedQkv a, const PackedGrad gr, const Grads out) {
  extern __shared__ unsigned char smem_raw[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int base = a.cu[b];
  const int len = a.cu[b + 1] - base;
  const int r0 = (kDkv ? int(blockIdx.x) : int(gridDim.x) - 1 - int(blockIdx.x)) * kRows;
  if (r0 >= len) return;  // the whole CTA, before any barrier
  // The tiles: dK/dV the queries [r0, len) (none earlier sees these keys), dQ the keys [0, r0 + 128).
  const int c_first = kDkv ? r0 : 0, c_end = kDkv ? len : min(len, r0 + kRows);
  const int tiles = (c_end - c_first + kTile - 1) / kTile;
  const uint32_t raw = ptx::smem_u32(smem_raw);
  const uint32_t sRX = (raw + 1023u) & ~1023u, sRY = sRX + kResX;
  const uint32_t sTX = sRY + kResY, sTY = sTX + kStages * kTileX, sStat = sTY + kStages * kTileY;
  const uint32_t rbar = sStat + kStages * kStatBytes, full = rbar + 8, empty = full + 8 * kStages;
  float* stats = reinterpret_cast<float*>(smem_raw + (sStat - raw));  // [stage][lse2 64 | Delta 64]
  const int tid = threadIdx.x;
  if (tid == 0) {
    ptx::mbar_init(rbar, 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full + 8 * s, kDkv ? 1 + 32 : 1);  // the expect_tx arrival (+ the 32 statistics lanes)
      ptx::mbar_init(empty + 8 * s, 8);                 // the 8 consumer warps
    }
    ptx::fence_mbar_init();
  }
  __syncthreads();

  if (tid >= 256) {
    // ---- producer: one thread issues every copy; in dK/dV its warp copies the statistics ----
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (tid >= 256 + 32) return;
    const int lane = tid & 31;
    if (lane == 0) {
      ptx::prefetch_tensormap(&mrx);
      ptx::prefetch_tensormap(&mry);
      ptx::prefetch_tensormap(&mtx);
      ptx::prefetch_tensormap(&mty);
      ptx::mbar_arrive_expect_tx(rbar, kResX + kResY);
      for (int blk = 0; blk < kDq / 64; ++blk)
        ptx::tma_load_3d(sRX + blk * kResBox, &mrx, rbar, 64 * blk, base + r0, h);
      for (int blk = 0; blk < kDv / 64; ++blk)
        ptx::tma_load_3d(sRY + blk * kResBox, &mry, rbar, 64 * blk, base + r0, h);
    }
    for (int it = 0; it < tiles; ++it) {
      const int s = it % kStages, c0 = c_first + it * kTile;
      ptx::wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
      const uint32_t bar = full + 8 * s;
      if (lane == 0) {
        ptx::mbar_arrive_expect_tx(bar, kTileX + kTileY);
        for (int blk = 0; blk < kDq / 64; ++blk)
          ptx::tma_load_3d(sTX + s * kTileX + blk * kTileBox, &mtx, bar, 64 * blk, base + c0, h);
        for (int blk = 0; blk < kDv / 64; ++blk)
          ptx::tma_load_3d(sTY + s * kTileY + blk * kTileBox, &mty, bar, 64 * blk, base + c0, h);
      }
      if constexpr (kDkv) {
        float* st = stats + s * 2 * kTile;
        for (int i = lane; i < kTile; i += 32) {
          const int q = c0 + i;
          const int64_t hr = int64_t(h) * a.rows + base + q;
          st[i] = q < len ? gr.lse2[hr] : 0.0f;  // 0 past len: those queries are masked where used
          st[kTile + i] = q < len ? gr.delta[hr] : 0.0f;
        }
        ptx::mbar_arrive(bar);  // release: the statistics are visible to whoever waits on the stage
      }
    }
    // Wait for the consumers to release the last use of every stage: a consumer that gave up waiting
    // (wait_or_exit) never does, and this wait traps.
    for (int it = max(tiles - kStages, 0); it < tiles; ++it)
      ptx::wait_or_trap(empty + 8 * (it % kStages), (it / kStages) & 1);
    return;
  }

  // ---- consumers ----
  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int w0 = r0 + 64 * wg;          // the warpgroup's first resident row
  const bool active = w0 < len;         // warpgroup-uniform
  const int row0 = w0 + 16 * warp + g;  // this thread's rows row0 and row0 + 8
  float acc_x[96];                      // dK or dQ: [64 rows][192]
  float acc_y[kDkv ? 64 : 1];           // dV: [64 rows][128] (dK/dV only)
#pragma unroll
  for (int i = 0; i < 96; ++i) acc_x[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < (kDkv ? 64 : 1); ++i) acc_y[i] = 0.0f;
  // dQ: the rows' log2(e)·lse and Delta (0 past len: those rows are masked and never stored).
  float row_l2[2] = {0.0f, 0.0f}, row_d[2] = {0.0f, 0.0f};
  if constexpr (!kDkv) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int t = row0 + 8 * r;
      if (t < len) {
        const int64_t hr = int64_t(h) * a.rows + base + t;
        row_l2[r] = gr.lse2[hr];
        row_d[r] = gr.delta[hr];
      }
    }
  }
  wait_or_exit(rbar, 0);

  for (int it = 0; it < tiles; ++it) {
    const int s = it % kStages, c0 = c_first + it * kTile;
    wait_or_exit(full + 8 * s, (it / kStages) & 1);
    // Whether any (key <= query) pair of the warpgroup's rows and the tile's columns exists.
    const bool visible = kDkv ? c0 + kTile - 1 >= w0 : c0 <= w0 + 63;
    if (active && visible) {
      const uint32_t sx = sTX + s * kTileX, sy = sTY + s * kTileY;
      // 1. The scores: sc[4j + e] is resident row row0 + 8(e/2), tile column c0 + 8j + 2t4 + e%2 (dK/dV:
      //    key, query; dQ: query, key).
      float sc[32];
      ptx::wgmma_fence();
      issue_rows_times_tile_t<kDq>(sc, sRX, sx, wg);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(sc);

      // 2. P = exp2(log2(e)·scale·S − log2(e)·lse), masked by selection, rounded to bf16 pairs: the A
      //    fragments of the 16-column slices (n8 blocks 2c, 2c + 1 are slice c, as in the forward). A
      //    tile whose every pair is seen (key <= query < len) needs no mask.
      const bool unmasked = kDkv ? (w0 + 63 <= c0 && c0 + kTile <= len) : (c0 + kTile - 1 <= w0 && w0 + 64 <= len);
      const float* st = stats + s * 2 * kTile;
      uint32_t pa[4][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ci = 8 * j + 2 * t4 + (e & 1), row = row0 + 8 * (e >> 1), col = c0 + ci;
          p[e] = exp2f(sc[4 * j + e] * a.scale_log2 - (kDkv ? st[ci] : row_l2[e >> 1]));
          if (!unmasked) {
            const int key = kDkv ? row : col, q = kDkv ? col : row;
            p[e] = (key <= q && q < len) ? p[e] : 0.0f;
          }
        }
        pa[j >> 1][2 * (j & 1)] = ptx::pack_bf16x2(p[0], p[1]);
        pa[j >> 1][2 * (j & 1) + 1] = ptx::pack_bf16x2(p[2], p[3]);
      }

      // 3. dV += Pᵀ dO (dK/dV) and the scores' gradient dp = Y Y'ᵀ, in one batch.
      float dp[32];
      ptx::wgmma_fence();
      if constexpr (kDkv) {
#pragma unroll
        for (int c = 0; c < kTile / 16; ++c)
          ptx::wgmma_m64n128k16_bf16_rs<1>(acc_y, pa[c], ptx::desc_mn_sw128(sy + c * 2048, kTileBox), 1);
      }
      issue_rows_times_tile_t<kDv>(dp, sRY, sy, wg);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(dp);
      if constexpr (kDkv) ptx::fence_regs(acc_y);

      // 4. dS = P (dP − Delta) from the bf16 P of step 2, rounded to bf16 pairs in the same layout.
      uint32_t dsa[4][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t lo = pa[j >> 1][2 * (j & 1)], hi = pa[j >> 1][2 * (j & 1) + 1];
        const float p[4] = {__uint_as_float(lo << 16), __uint_as_float(lo & 0xFFFF0000u), __uint_as_float(hi << 16),
                            __uint_as_float(hi & 0xFFFF0000u)};
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ci = 8 * j + 2 * t4 + (e & 1);
          ds[e] = p[e] * (dp[4 * j + e] - (kDkv ? st[kTile + ci] : row_d[e >> 1]));
        }
        dsa[j >> 1][2 * (j & 1)] = ptx::pack_bf16x2(ds[0], ds[1]);
        dsa[j >> 1][2 * (j & 1) + 1] = ptx::pack_bf16x2(ds[2], ds[3]);
      }

      // 5. dK += dSᵀ Q, or dQ += dS K.
      ptx::wgmma_fence();
#pragma unroll
      for (int c = 0; c < kTile / 16; ++c)
        ptx::wgmma_m64n192k16_bf16_rs<1>(acc_x, dsa[c], ptx::desc_mn_sw128(sx + c * 2048, kTileBox), 1);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(acc_x);
    }
    if (lane == 0) ptx::mbar_arrive(empty + 8 * s);
  }
  if (!active) return;

  // dK (k_nope into dkv, k_rot into the per-head scratch) and dV, or dQ, for the rows that exist.
  const int dqk = gr.Dn + gr.Dr;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = row0 + 8 * r;
    if (t >= len) continue;
    const int64_t row = int64_t(base) + t;
    if constexpr (kDkv) {
      float* dkn = out.dkv + row * out.lddkv + int64_t(h) * (gr.Dn + kDv);
      float* dkr = out.dk_rot_h + (int64_t(h) * a.rows + row) * gr.Dr;
#pragma unroll
      for (int j = 0; j < 24; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * t4 + e;
          const float v = acc_x[4 * j + 2 * r + e] * gr.scale;
          if (col < gr.Dn) dkn[col] = v;
          else if (col < dqk) dkr[col - gr.Dn] = v;
        }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = 8 * j + 2 * t4;
        dkn[gr.Dn + col] = acc_y[4 * j + 2 * r];
        dkn[gr.Dn + col + 1] = acc_y[4 * j + 2 * r + 1];
      }
    } else {
      float* drow = out.dq + row * out.lddq + int64_t(h) * dqk;
#pragma unroll
      for (int j = 0; j < 24; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * t4 + e;
          if (col < dqk) drow[col] = acc_x[4 * j + 2 * r + e] * gr.scale;
        }
    }
  }
}

}  // namespace

void attention_backward(const PackedQkv& a, const PackedGrad& g, float* dq, int64_t lddq, float* dkv, int64_t lddkv,
                        float* dk_rot_h, int B, int64_t max_len) {
  if (B == 0 || max_len == 0 || a.rows == 0) return;
  const uint64_t rows = uint64_t(a.rows), H = uint64_t(a.H);
  auto map = [&](const uint16_t* p, uint64_t w, uint32_t box_rows, const char* what) {
    return cuda_tma::bf16_3d_sw128(p, w, rows, H, w * 2, rows * w * 2, 64, box_rows, what);
  };
  const Grads out{dq, lddq, dkv, lddkv, dk_rot_h};
  const dim3 grid(unsigned((max_len + kRows - 1) / kRows), unsigned(a.H), unsigned(B));
  static size_t allowed_kv = 0, allowed_q = 0;
  train_common::allow_smem(attn_bwd_sm90_kernel<true>, kSmemBytes, allowed_kv);
  train_common::allow_smem(attn_bwd_sm90_kernel<false>, kSmemBytes, allowed_q);
  attn_bwd_sm90_kernel<true><<<grid, kThreads, kSmemBytes>>>(map(a.k, kDq, kRows, "the packed MLA keys"),
                                                             map(a.v, kDv, kRows, "the packed MLA values"),
                                                             map(a.q, kDq, kTile, "the packed MLA queries"),
                                                             map(g.d_o, kDv, kTile, "the packed MLA output gradient"),
                                                             a, g, out);
  K3_CUDA_LAUNCH_CHECK();
  attn_bwd_sm90_kernel<false><<<grid, kThreads, kSmemBytes>>>(map(a.q, kDq, kRows, "the packed MLA queries"),
                                                              map(g.d_o, kDv, kRows, "the packed MLA output gradient"),
                                                              map(a.k, kDq, kTile, "the packed MLA keys"),
                                                              map(a.v, kDv, kTile, "the packed MLA values"), a, g, out);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::mla::cuda::wgmma
