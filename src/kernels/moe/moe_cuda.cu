// LatentMoE routed experts on the GPU: see moe_cuda.h for the API and the numerics.
//
// bf16 weights on 128-row tile lists run on the Hopper wgmma kernel of moe_gemm_sm90.cu (see there and
// docs/CUDA.md); everything else on the mma.sync kernel here.
//
// mma.sync grouped GEMM design (one kernel, templated on <TM, BNT, Glu, Mxfp4>):
//   - one CTA = 256 threads (8 warps as 2 (M) × 4 (N)) computes a TM × BNT tile of one expert (TM rows,
//     BNT weight rows = output columns; BNT/2 columns of h for Glu); each warp (TM/2) × (BNT/4) with
//     mma.sync.m16n8k16 bf16 -> fp32, fragments from ldmatrix.x4. Shapes used: 128 × 256 (warp 64 × 64,
//     ~230 registers, 1 CTA/SM: 4 ldmatrix.x4 per 8 MMAs) for TM = 128, 64 × 128 (warp 32 × 32, 2 CTAs/SM)
//     for TM = 64; MXFP4 falls back to 128 × 128 where K's scales would not fit shared memory;
//   - the tile list (expert, first row) comes from Dispatch::build; CTAs past the device-side tile count
//     exit at once, so the whole layer is one launch with no host sync. The 1-D grid is rastered expert
//     by expert, column tile by column tile, the expert's row tiles innermost (see grouped_gemm_kernel):
//     a weight tile is read from DRAM once and its other row tiles hit L2;
//   - A rows are gathered in the loader (x_rows), rows past the expert's count and k past K are
//     zero-filled by cp.async (src-size 0) and never stored; a warp skips the MMAs of its m16 row blocks
//     that hold no valid row (a group's last tile), which changes no stored value;
//   - 4-stage cp.async pipeline over BK = 64, 128-byte smem rows with the 16-byte chunk index XORed by
//     (row & 7), so ldmatrix and cp.async are bank-conflict free;
//   - Glu: the 128 B rows of a tile interleave gate and up rows in groups of 8 (n8 tile 2p = gate,
//     2p+1 = up for the same 8 output columns), so the same thread holds matching gate/up
//     accumulators and SiTU-GLU runs in registers in the epilogue: h never exists in fp32;
//   - Mxfp4: the stages hold packed bytes (BNT × 32 B per stage instead of BNT × 128); the tile's E8M0
//     scales for the whole K sit in shared memory; after each stage lands, every thread decodes
//     BNT/128 32-element groups (16 bytes each) into a bf16 tile of the same swizzled layout, and the
//     MMA loop is the bf16 one.
// Every variant above computes each output element with the same k order, so results do not depend on
// the tile shape, the raster or the skipping (test KernelVariantsAreBitwiseEqual).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>

#include "core/cuda_check.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/moe/moe_cuda.h"
#include "kernels/moe/moe_gemm_sm90.cuh"
#include "kernels/moe/moe_train_cuda.h"

namespace k3::moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int BN = 128, BK = 64, kStages = 4;
constexpr int kMaxMxCols = 16384;
constexpr int kRouterThreads = 128;
constexpr int kRouterMaxExperts = 8192;

// ---------------------------------------------------------------------------------------------------
// small device helpers

// Shared PTX wrappers: kernels/common/mma_sm80.cuh. When !valid nothing is read and the 16 bytes
// are zero-filled.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  ptx::cp_async16(dst, src, valid ? 16 : 0);
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::pack_bf16x2;
using ptx::smem_u32;

// Byte offset of 16-byte chunk `c` (0..7) of row `r` in a 128-byte-row tile, XOR-swizzled.
__device__ __forceinline__ uint32_t swz(int r, int c) { return uint32_t(r * 128 + ((c ^ (r & 7)) << 4)); }

// 2^(s-127) as fp32 (s = 0 is the subnormal 2^-127), NaN for 255: exactly e8m0_to_f32 of gemm/mxfp4.h.
__device__ __forceinline__ float e8m0_f32(uint32_t s) {
  if (s == 255u) return __uint_as_float(0x7fc00000u);
  return s == 0u ? __uint_as_float(0x00400000u) : __uint_as_float(s << 23);
}

// Two e2m1 nibbles of byte b (low = even element) × scale -> bf16x2 (low half = even element).
// (nib & 7) << 22 is the fp32 with exponent field e and top mantissa bit m, i.e. E2M1 · 2^-126 (the
// e = 0 code 1 lands on the subnormal 2^-127 = 0.5 · 2^-126); the sign goes to bit 31. Multiplying by
// 2^126 and then by the scale reproduces kE2M1[nib] · 2^(s-127) with the CPU's single rounding
// (exact unless the result leaves fp32's range); `s1` = 2^126 · scale folds both into one multiply
// when that is itself exact and finite (fast = true).
__device__ __forceinline__ uint32_t decode_byte(uint32_t b, float sc, float s1, bool fast) {
  const float lo = __uint_as_float(((b & 7u) << 22) | ((b & 8u) << 28));
  const float hi = __uint_as_float(((b & 0x70u) << 18) | ((b & 0x80u) << 24));
  if (fast) return pack_bf16x2(lo * s1, hi * s1);
  return pack_bf16x2((lo * 0x1p126f) * sc, (hi * 0x1p126f) * sc);
}

// ---------------------------------------------------------------------------------------------------
// router: one CTA per token

struct Best {
  float v;
  int i;
};
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) { return va > vb || (va == vb && ia < ib); }

__device__ Best block_argmax(Best b, Best* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, b.v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, b.i, o);
    if (better(ov, oi, b.v, b.i)) b = Best{ov, oi};
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) red[warp] = b;
  __syncthreads();
  Best r = red[0];
  for (int w = 1; w < kRouterThreads / 32; ++w)
    if (better(red[w].v, red[w].i, r.v, r.i)) r = red[w];
  __syncthreads();  // red is reused by the next call
  return r;
}

__global__ void __launch_bounds__(kRouterThreads)
    router_kernel(int32_t* __restrict__ idx, float* __restrict__ weight, float* __restrict__ scores_out,
                  float* __restrict__ sel_sum_out, const float* __restrict__ logits, const float* __restrict__ bias,
                  int E, int K, int G, int topk_groups, bool renormalize, float scaling) {
  pdl::wait_then_release();
  extern __shared__ unsigned char router_smem[];
  float* s = reinterpret_cast<float*>(router_smem);                  // [E] unbiased scores
  float* sel = s + E;                                                // [E] biased selection scores; -INF = masked
  unsigned char* taken = reinterpret_cast<unsigned char*>(sel + E);  // [E]
  __shared__ Best red[kRouterThreads / 32];
  __shared__ float gscore[64];
  __shared__ unsigned char gkeep[64];
  __shared__ float chosen_s[64];
  __shared__ int chosen_i[64];

  const int64_t t = blockIdx.x;
  const float* lg = logits + t * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const float v = rowwise::sigmoid_stable(lg[e]);
    s[e] = v;
    if (scores_out) scores_out[t * E + e] = v;  // training: the unbiased scores (moe_train_cuda.h)
    // NaN (a NaN input or weight) selects last, as -inf: every argmax below then names a real,
    // untaken expert (a NaN compares false with everything, which left the argmax with no expert and
    // the dispatch with an index out of range). The expert weights stay NaN, so the logits show it.
    const float b = v + (bias ? bias[e] : 0.0f);
    sel[e] = isnan(b) ? -INFINITY : b;
    taken[e] = 0;
  }
  __syncthreads();
  if (G > 1 && topk_groups < G) {
    // DeepSeek-V3 group limit, as the CPU twin: a group's score is the sum of its two best biased
    // scores; only the best topk_groups groups (ties to the lower group) stay selectable.
    const int per = E / G;
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int e = g * per; e < (g + 1) * per; ++e) {
        const float v = sel[e];
        if (v > b1) {
          b2 = b1;
          b1 = v;
        } else if (v > b2) {
          b2 = v;
        }
      }
      gscore[g] = per >= 2 ? b1 + b2 : b1;
      gkeep[g] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int r = 0; r < topk_groups; ++r) {
        int bi = -1;
        for (int g = 0; g < G; ++g)
          if (!gkeep[g] && (bi < 0 || gscore[g] > gscore[bi])) bi = g;
        gkeep[bi] = 1;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (!gkeep[e / per]) sel[e] = -INFINITY;
    __syncthreads();
  }
  for (int k = 0; k < K; ++k) {
    Best b{-INFINITY, INT_MAX};
    for (int e = threadIdx.x; e < E; e += blockDim.x)
      if (!taken[e] && better(sel[e], e, b.v, b.i)) b = Best{sel[e], e};
    const Best w = block_argmax(b, red);
    if (threadIdx.x == 0) {
      taken[w.i] = 1;
      chosen_i[k] = w.i;
      chosen_s[k] = s[w.i];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int k = 0; k < K; ++k) sum += chosen_s[k];
    if (sel_sum_out) sel_sum_out[t] = float(sum);
    for (int k = 0; k < K; ++k) {
      const double w = renormalize ? double(chosen_s[k]) / (sum + 1e-20) : double(chosen_s[k]);
      idx[t * K + k] = chosen_i[k];
      weight[t * K + k] = float(w * scaling);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// dispatch

__global__ void count_kernel(int32_t* __restrict__ counts, const int32_t* __restrict__ idx, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    atomicAdd(&counts[idx[i]], 1);
}

// The exclusive scan of one CTA over E experts (E ≤ any size): row offsets and TM-row tile offsets, written
// to roff/toff (shared memory, [E] each). Thread t owns the contiguous experts [t P, (t + 1) P), P = ceil(E /
// blockDim.x), so one block scan of the per-thread totals does it. Returns the totals (rows, tiles).
template <int kThreads>
__device__ int2 scan_counts(int32_t* roff, int32_t* toff, const int32_t* counts, int E, int TM) {
  using Scan = cub::BlockScan<int2, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int P = (E + kThreads - 1) / kThreads, e0 = min(E, int(threadIdx.x) * P), e1 = min(E, e0 + P);
  int2 mine{0, 0};
  for (int e = e0; e < e1; ++e) mine.x += counts[e], mine.y += (counts[e] + TM - 1) / TM;
  int2 before, total;
  Scan(tmp).ExclusiveScan(
      mine, before, int2{0, 0},
      [](int2 a, int2 b) {
        return int2{a.x + b.x, a.y + b.y};
      },
      total);
  for (int e = e0; e < e1; ++e) {
    roff[e] = before.x, toff[e] = before.y;
    before.x += counts[e], before.y += (counts[e] + TM - 1) / TM;
  }
  __syncthreads();
  return total;
}

// Writes offsets [E + 1], the TM-row tile list and its length from counts and their scans (one CTA).
__device__ void write_plan(int32_t* offsets, int32_t* tiles, int32_t* num_tiles, const int32_t* counts,
                           const int32_t* roff, const int32_t* toff, int2 total, int E, int TM) {
  if (threadIdx.x == 0) offsets[E] = total.x, *num_tiles = total.y;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    offsets[e] = roff[e];
    for (int m = 0; m * TM < counts[e]; ++m) {
      tiles[2 * (toff[e] + m)] = e;
      tiles[2 * (toff[e] + m) + 1] = m * TM;
    }
  }
}

constexpr int kScanThreads = 1024;

// One CTA: offsets (exclusive scan of counts), cursors, and the TM-row tile list.
__global__ void __launch_bounds__(kScanThreads)
    scan_kernel(int32_t* __restrict__ offsets, int32_t* __restrict__ cursor, int32_t* __restrict__ tiles,
                int32_t* __restrict__ num_tiles, const int32_t* __restrict__ counts, int E, int TM) {
  extern __shared__ int32_t scan_smem[];  // [E] row offsets, [E] tile offsets
  int32_t* roff = scan_smem;
  int32_t* toff = scan_smem + E;
  const int2 total = scan_counts<kScanThreads>(roff, toff, counts, E, TM);
  write_plan(offsets, tiles, num_tiles, counts, roff, toff, total, E, TM);
  for (int e = threadIdx.x; e < E; e += blockDim.x) cursor[e] = roff[e];
}

// The whole plan in one CTA for few slots (decode steps): counts, scan and scatter with shared-memory atomics,
// one launch where the general path takes a memset and three kernels.
__global__ void __launch_bounds__(kScanThreads)
    plan_small_kernel(int32_t* __restrict__ counts_out, int32_t* __restrict__ offsets, int32_t* __restrict__ tiles,
                      int32_t* __restrict__ num_tiles, int32_t* __restrict__ slot_of, int32_t* __restrict__ slot_token,
                      const int32_t* __restrict__ idx, int S, int K, int E, int TM) {
  pdl::wait_then_release();
  extern __shared__ int32_t plan_smem[];  // [E] counts, [E] row offsets (then cursors), [E] tile offsets
  int32_t* counts = plan_smem;
  int32_t* roff = plan_smem + E;
  int32_t* toff = plan_smem + 2 * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < S; i += blockDim.x) atomicAdd(&counts[idx[i]], 1);
  __syncthreads();
  const int2 total = scan_counts<kScanThreads>(roff, toff, counts, E, TM);
  write_plan(offsets, tiles, num_tiles, counts, roff, toff, total, E, TM);
  for (int e = threadIdx.x; e < E; e += blockDim.x) counts_out[e] = counts[e];
  __syncthreads();  // roff becomes the cursors
  for (int i = threadIdx.x; i < S; i += blockDim.x) {
    const int32_t pos = atomicAdd(&roff[idx[i]], 1);
    slot_of[i] = pos;
    slot_token[pos] = i / K;
  }
}

__global__ void scatter_kernel(int32_t* __restrict__ slot_of, int32_t* __restrict__ slot_token,
                               int32_t* __restrict__ cursor, const int32_t* __restrict__ idx, int64_t n, int K) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t pos = atomicAdd(&cursor[idx[i]], 1);
    slot_of[i] = pos;
    slot_token[pos] = int32_t(i / K);
  }
}

// ---------------------------------------------------------------------------------------------------
// grouped GEMM

struct GemmArgs {
  const bf16* x;            // A rows: x + row * K
  const int32_t* x_rows;    // optional gather: sorted row -> row of x
  const unsigned char* w0;  // weight (gate for Glu): bf16 [N, K] or packed [N, K/2], expert stride bytes
  const unsigned char* w1;  // up weight (Glu only)
  int64_t w_stride;
  const uint8_t* s0;  // MXFP4 scales [N, K/32]
  const uint8_t* s1;
  int64_t s_stride;
  int N, K;  // weight rows (= output columns of y; of h for Glu) and reduction length
  const int32_t* offsets;
  const int32_t* tiles;
  const int32_t* num_tiles;
  bf16* y;             // [S, N] in sorted order
  GluConsts glu;       // the SiTU/SwiGLU epilogue's constants (Glu only; moe_glu)
  bool raster_expert;  // 1-D grid, expert-major, row tiles innermost (see grouped_gemm_kernel)
  int col_tiles;       // column tiles per row tile
  bool skip_rows;      // skip the MMAs of m16 row blocks past the tile's valid rows
};

// The MMAs of one BK = 64 stage for one warp: its (MI·16) × (NI·8) sub-tile at rows arow0, weight rows
// brow0 of the swizzled stage tiles. Guard: only m16 blocks mi < mact (the warp-uniform count of blocks
// holding valid rows); the hot path (all blocks) is compiled without the tests.
template <int MI, int NI, bool Guard>
__device__ __forceinline__ void mma_stage(float (&acc)[MI][NI][4], uint32_t a_s, uint32_t b_s, int arow0, int brow0,
                                          int lane, int mact) {
#pragma unroll
  for (int ks = 0; ks < BK / 16; ++ks) {
    uint32_t af[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      if (Guard && mi >= mact) continue;
      const int r = arow0 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      ldmatrix_x4(af[mi], a_s + swz(r, ks * 2 + (lane >> 4)));
    }
#pragma unroll
    for (int nj = 0; nj < NI / 2; ++nj) {
      const int r = brow0 + nj * 16 + (lane & 7) + (lane >> 4) * 8;
      uint32_t t4[4];
      ldmatrix_x4(t4, b_s + swz(r, ks * 2 + ((lane >> 3) & 1)));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if (Guard && mi >= mact) continue;
        ptx::mma_bf16_16816(acc[mi][2 * nj], af[mi], t4[0], t4[1]);
        ptx::mma_bf16_16816(acc[mi][2 * nj + 1], af[mi], t4[2], t4[3]);
      }
    }
  }
}

// Tile rasterisation (raster_expert): CTA b of a 1-D grid of col_tiles × max_tiles CTAs takes tile-list
// slot q = b / col_tiles, which names expert e; the CTAs [t0·C, (t0+R)·C) of expert e's R row tiles
// (t0 its first slot) run its column tiles in order with the row tiles innermost, so the R CTAs that
// read one weight tile run side by side (one DRAM read, the others hit L2) and the expert's A rows stay
// in L2 across its column tiles. Otherwise (2-D grid, x = column tile) one row tile sweeps all column
// tiles before the next starts: a weight tile comes back only after a whole expert's weights
// (44 MB for K3's gate/up) went through L2.
template <int TM, int BNT, bool Glu, bool Mx>
__global__ void __launch_bounds__(kThreads, (TM == 64 && BNT == 128) ? 2 : 1) grouped_gemm_kernel(const GemmArgs a) {
  pdl::wait_then_release();
  constexpr int MI = TM / 32;                // m16 tiles per warp (warp tile (TM/2) × WN)
  constexpr int WN = BNT / 4;                // weight rows (combined output columns) per warp
  constexpr int NI = WN / 8;                 // n8 tiles per warp
  constexpr int BR = BNT / 32;               // weight rows each thread loads per stage (bf16)
  constexpr int kATileBytes = TM * BK * 2;   // one bf16 TM × 64 A tile
  constexpr int kBTileBytes = BNT * BK * 2;  // one bf16 BNT × 64 weight tile
  constexpr int kPStage = BNT * BK / 2;      // one packed MXFP4 BNT × 64 stage
  constexpr int MXC = BNT / 128;             // packed 16-byte chunks (32-element groups) per thread
  int tile, ct;
  if (a.raster_expert) {
    const int b = int(blockIdx.x);
    if (b / a.col_tiles >= *a.num_tiles) return;
    tile = raster_tile(b, a.col_tiles, TM, a.tiles, a.offsets, &ct);
  } else {
    tile = int(blockIdx.y);
    ct = int(blockIdx.x);
    if (tile >= *a.num_tiles) return;
  }
  const int e = a.tiles[2 * tile], m0 = a.tiles[2 * tile + 1];
  const int row_base = a.offsets[e] + m0;                          // first sorted row of this tile
  const int rows = min(TM, a.offsets[e + 1] - a.offsets[e] - m0);  // valid rows in the tile
  const int n0 = ct * (Glu ? BNT / 2 : BNT);                       // first weight row (output column)
  const int K = a.K, N = a.N;
  const int KT = (K + BK - 1) / BK;

  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* sA = smem;                          // kStages × TM × 128 bytes
  unsigned char* sB = smem + kStages * kATileBytes;  // bf16: kStages × BNT × 128 B; Mx: kStages × 4 KB packed
  unsigned char* sBdec = sB + kStages * kPStage;     // Mx: the decoded bf16 tile
  unsigned char* sScale = sBdec + kBTileBytes;       // Mx: [BNT][K/32]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;

  // Weight row of combined tile row r (0..127): Glu interleaves gate/up in groups of 8.
  auto wsrc = [&](int r, const unsigned char*& base, int& wrow) {
    if (Glu) {
      base = ((r >> 3) & 1) ? a.w1 : a.w0;
      wrow = n0 + (r >> 4) * 8 + (r & 7);
    } else {
      base = a.w0;
      wrow = n0 + r;
    }
  };

  // Per-thread loader state. A and bf16 B: rows tid/8 + 32*i, 16-byte chunk tid%8.
  const int lc = tid & 7;
  const bf16* a_ptr[MI];
  bool a_ok[MI];
#pragma unroll
  for (int i = 0; i < MI; ++i) {
    const int r = (tid >> 3) + 32 * i;
    a_ok[i] = r < rows;
    const int64_t xr = a_ok[i] ? (a.x_rows ? a.x_rows[row_base + r] : row_base + r) : 0;
    a_ptr[i] = a.x + xr * K + lc * 8;
  }
  // bf16 B: rows (tid/8) + 32 i, i < BR, chunk tid%8. Row i's weight row is wrow0 + i·dstep (gate/up
  // interleave: (r >> 3) & 1 is the same for all i, and r >> 4 steps by 2), so one pointer and the count
  // of rows below N describe them all.
  constexpr int dstep = Glu ? 16 : 32;
  const unsigned char* b_ptr0 = nullptr;
  int b_nvalid = 0;
  const unsigned char* mx_ptr[MXC];
  bool mx_ok[MXC];
  if (!Mx) {
    const unsigned char* base;
    int wrow;
    wsrc(tid >> 3, base, wrow);
    b_nvalid = wrow < N ? min(BR, (N - wrow + dstep - 1) / dstep) : 0;
    b_ptr0 = base + e * a.w_stride + int64_t(b_nvalid > 0 ? wrow : 0) * K * 2 + lc * 16;
  } else {
    // packed: chunk c = tid + 256 j is row c/2, 16-byte half c%2 (one 32-element scale group)
#pragma unroll
    for (int j = 0; j < MXC; ++j) {
      const unsigned char* base;
      int wrow;
      wsrc((tid >> 1) + 128 * j, base, wrow);
      mx_ok[j] = wrow < N;
      mx_ptr[j] = base + e * a.w_stride + int64_t(mx_ok[j] ? wrow : 0) * (K / 2) + (tid & 1) * 16;
    }
    // All of this tile's scales (BNT rows × K/32 bytes) into shared memory. With 4-byte aligned rows they
    // travel as cp.async words in the first pipeline group (waited for with stage 0); otherwise as
    // plain byte loads, published by the first k-loop barrier. Rows past N read as scale 0 (their
    // packed bytes are zero-filled too, so they decode to 0, never NaN).
    const int KS = K / 32;
    const bool vec4 =
        KS % 4 == 0 &&
        ((reinterpret_cast<uintptr_t>(a.s0) | reinterpret_cast<uintptr_t>(a.s1) | uintptr_t(a.s_stride)) & 3u) == 0;
    if (vec4) {
      const int words = KS / 4;
      for (int i = tid; i < BNT * words; i += kThreads) {
        const int r = i / words, q = i % words;
        const unsigned char* wb;
        int wr;
        wsrc(r, wb, wr);
        const uint8_t* sb = (Glu && ((r >> 3) & 1) ? a.s1 : a.s0) + e * a.s_stride;
        const bool ok = wr < N;
        cp_async4(smem_u32(sScale + r * KS + q * 4), sb + int64_t(ok ? wr : 0) * KS + q * 4, ok);
      }
    } else {
      for (int i = tid; i < BNT * KS; i += kThreads) {
        const int r = i / KS, g = i % KS;
        const unsigned char* wb;
        int wr;
        wsrc(r, wb, wr);
        const uint8_t* sb = (Glu && ((r >> 3) & 1) ? a.s1 : a.s0) + e * a.s_stride;
        sScale[i] = wr < N ? sb[int64_t(wr) * KS + g] : uint8_t(0);
      }
    }
  }

  auto load_stage = [&](int slot, int kt) {
    const int k0 = kt * BK;
    const uint32_t a_s = smem_u32(sA + slot * kATileBytes);
    const bool k_ok = k0 + lc * 8 < K;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const int r = (tid >> 3) + 32 * i;
      cp_async16(a_s + swz(r, lc), a_ptr[i] + k0, a_ok[i] && k_ok);
    }
    if (!Mx) {
      const uint32_t b_s = smem_u32(sB + slot * kBTileBytes);
#pragma unroll
      for (int i = 0; i < BR; ++i) {
        const int r = (tid >> 3) + 32 * i;
        const bool ok = i < b_nvalid;
        cp_async16(b_s + swz(r, lc), b_ptr0 + (ok ? int64_t(i) * dstep * K * 2 : 0) + int64_t(k0) * 2, ok && k_ok);
      }
    } else {
      const uint32_t b_s = smem_u32(sB + slot * kPStage);
      const bool g_ok = k0 + (tid & 1) * 32 < K;
#pragma unroll
      for (int j = 0; j < MXC; ++j) cp_async16(b_s + (tid + 256 * j) * 16, mx_ptr[j] + k0 / 2, mx_ok[j] && g_ok);
    }
  };

  // m16 row blocks of this warp that hold valid rows: the others' MMAs are skipped (their rows are
  // never stored), so a group's last, partly filled tile costs only what it holds.
  const int wrows = rows - wm * (TM / 2);
  const int mact = !a.skip_rows ? MI : wrows <= 0 ? 0 : min(MI, (wrows + 15) >> 4);

  float acc[MI][NI][4];
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < NI; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }

  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt visible to all; every warp is done with iteration kt-1
    {
      const int nk = kt + kStages - 1;
      if (nk < KT) load_stage(nk % kStages, nk);
      cp_async_commit();
    }
    const int slot = kt % kStages;
    const unsigned char* bt;
    if (Mx) {
      // decode: thread tid -> rows tid/2 + 128 j, group tid%2 (32 elements) of the packed stage
#pragma unroll
      for (int j = 0; j < MXC; ++j) {
        const int r = (tid >> 1) + 128 * j, g = tid & 1;
        const int kg = kt * (BK / 32) + g;  // global scale-group index
        uint4 out[4];
        if (kg * 32 < K) {
          const uint4 p = *reinterpret_cast<const uint4*>(sB + slot * kPStage + (tid + 256 * j) * 16);
          const uint32_t sb = sScale[r * (K / 32) + kg];
          const float sc = e8m0_f32(sb);
          const bool fast = sb >= 1u && sb <= 128u;  // 2^126 · 2^(s-127) = 2^(s-1) is a normal float
          const float s1 = fast ? __uint_as_float((sb + 126u) << 23) : 0.0f;
          const uint32_t w[4] = {p.x, p.y, p.z, p.w};
          uint32_t o[16];
#pragma unroll
          for (int q = 0; q < 4; ++q)
#pragma unroll
            for (int bb = 0; bb < 4; ++bb) o[q * 4 + bb] = decode_byte((w[q] >> (8 * bb)) & 0xffu, sc, s1, fast);
#pragma unroll
          for (int q = 0; q < 4; ++q) out[q] = make_uint4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
        } else {
#pragma unroll
          for (int q = 0; q < 4; ++q) out[q] = make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int q = 0; q < 4; ++q) *reinterpret_cast<uint4*>(sBdec + swz(r, g * 4 + q)) = out[q];
      }
      __syncthreads();
      bt = sBdec;
    } else {
      bt = sB + slot * kBTileBytes;
    }
    const uint32_t a_s = smem_u32(sA + slot * kATileBytes);
    const uint32_t b_s = smem_u32(bt);
    if (mact == MI) mma_stage<MI, NI, false>(acc, a_s, b_s, wm * (TM / 2), wn * WN, lane, MI);
    else if (mact > 0) mma_stage<MI, NI, true>(acc, a_s, b_s, wm * (TM / 2), wn * WN, lane, mact);
  }
  cp_async_wait<0>();

  // epilogue: accumulator (mi, ni) holds rows r0, r0+8 and columns c, c+1 of the warp's sub-tile
  const int rq = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * (TM / 2) + mi * 16 + rq + h * 8;
      if (r >= rows) continue;
      bf16* yrow = a.y + int64_t(row_base + r) * N;
      if (Glu) {
#pragma unroll
        for (int p = 0; p < NI / 2; ++p) {
          const int c = n0 + wn * (WN / 2) + p * 8 + cq;
          if (c >= N) continue;
          float v[2];
#pragma unroll
          for (int q = 0; q < 2; ++q) v[q] = moe_glu(acc[mi][2 * p][2 * h + q], acc[mi][2 * p + 1][2 * h + q], a.glu);
          *reinterpret_cast<uint32_t*>(yrow + c) = pack_bf16x2(v[0], v[1]);
        }
      } else {
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
          const int c = n0 + wn * WN + ni * 8 + cq;
          if (c >= N) continue;
          *reinterpret_cast<uint32_t*>(yrow + c) = pack_bf16x2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        }
      }
    }
  }
}

size_t gemm_smem_bytes(int tm, int bn, bool mx, int K) {
  const size_t a = size_t(kStages) * tm * BK * 2;
  if (!mx) return a + size_t(kStages) * bn * BK * 2;
  return a + size_t(kStages) * bn * BK / 2 + size_t(bn) * BK * 2 + size_t(bn) * (K / 32);
}

template <int TM, int BNT, bool Glu, bool Mx>
void launch_gemm_tm(GemmArgs a, const Dispatch& d, const GemmConfig& cfg) {
  const size_t smem = gemm_smem_bytes(TM, BNT, Mx, a.K);
  K3_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<TM, BNT, Glu, Mx>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(smem)));
  const int cols_per_tile = Glu ? BNT / 2 : BNT;
  a.col_tiles = (a.N + cols_per_tile - 1) / cols_per_tile;
  a.raster_expert = cfg.expert_raster;
  a.skip_rows = cfg.skip_empty_rows;
  dim3 grid;
  if (a.raster_expert) {
    K3_CHECK(int64_t(a.col_tiles) * d.max_tiles() < (int64_t(1) << 31), "moe::cuda: ", d.max_tiles(), " row tiles × ",
             a.col_tiles, " column tiles exceed the grid limit");
    grid = dim3(unsigned(int64_t(a.col_tiles) * d.max_tiles()));
  } else {
    K3_CHECK(d.max_tiles() <= 65535, "moe::cuda: ", d.max_tiles(), " row tiles exceed the grid limit 65535");
    grid = dim3(unsigned(a.col_tiles), unsigned(d.max_tiles()));
  }
  pdl::launch(grouped_gemm_kernel<TM, BNT, Glu, Mx>, grid, kThreads, smem, a);
  K3_CUDA_LAUNCH_CHECK();
}

// The heuristic's kernel: bf16 weights on a 128-row tile list run on the Hopper wgmma kernel
// (moe_gemm_sm90.cu) unless cfg asks for mma.sync; TM 64 lists and MXFP4 weights run on the mma.sync
// kernel below.
bool use_sm90(bool mx, const Dispatch& d, const GemmConfig& cfg) {
  return !mx && d.tile_m() == sm90::kTileRows && cfg.kernel == GemmConfig::Kernel::kAuto;
}

void launch_sm90(const GemmArgs& a, const Dispatch& d, bool glu, const GemmConfig& cfg) {
  sm90::GroupedGemmArgs s;
  s.x = a.x;
  s.x_rows = a.x_rows;
  s.w0 = a.w0;
  s.w1 = a.w1;
  s.w_stride = a.w_stride;
  s.E = int(d.num_experts());
  s.N = a.N;
  s.K = a.K;
  s.offsets = a.offsets;
  s.tiles = a.tiles;
  s.num_tiles = a.num_tiles;
  s.max_tiles = d.max_tiles();
  s.y = a.y;
  s.glu = glu;
  s.act = a.glu;
  s.raster = cfg.expert_raster;
  s.skip_rows = cfg.skip_empty_rows;
  s.max_ctas = cfg.max_ctas;
  s.dynamic = cfg.dynamic_schedule;
  sm90::grouped_gemm(s);
}

template <bool Glu, bool Mx>
void launch_gemm(const GemmArgs& a, const Dispatch& d, const GemmConfig& cfg) {
  if (use_sm90(Mx, d, cfg)) return launch_sm90(a, d, Glu, cfg);
  // Tile rows × weight rows: 128 × 256 (1 CTA/SM) unless cfg asks for 128 × 128 or, for MXFP4, the K/32
  // scale bytes of 256 rows push shared memory past the 227 KB limit; 64 × 128 (2 CTAs/SM) at TM 64.
  if (d.tile_m() == 64) return launch_gemm_tm<64, BN, Glu, Mx>(a, d, cfg);
  if (cfg.narrow_weight_tiles || (Mx && gemm_smem_bytes(128, 256, true, a.K) > 227 * 1024))
    return launch_gemm_tm<128, BN, Glu, Mx>(a, d, cfg);
  launch_gemm_tm<128, 256, Glu, Mx>(a, d, cfg);
}

void check_gemm(const ExpertLinear& w, const char* what) {
  const std::string why = gemm_can_run(w);
  K3_CHECK(why.empty(), "moe::cuda::", what, ": ", why);
}

void check_config(const GemmConfig& cfg, const char* what) {
  K3_CHECK(cfg.max_ctas >= 0, "moe::cuda::", what, ": GemmConfig::max_ctas must be >= 0 (0: one CTA per SM), got ",
           cfg.max_ctas);
}

// acc = Σ_k w[t,k] y[slot_of[t,k], c .. c+7], k ascending: the weighted sum of token t's chosen experts' outputs.
// A null slot_of: y in slot order (the slot of (t, k) is t K + k).
__device__ __forceinline__ void combine_eight(float (&acc)[8], const bf16* __restrict__ y,
                                              const float* __restrict__ weight, const int32_t* __restrict__ slot_of,
                                              int64_t t, int K, int L, int c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  for (int k = 0; k < K; ++k) {
    const float wk = weight[t * K + k];
    const int64_t slot = slot_of ? int64_t(slot_of[t * K + k]) : t * K + k;
    const uint4 v = *reinterpret_cast<const uint4*>(y + slot * L + c);
    const uint32_t w4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      acc[2 * q] += wk * __uint_as_float(w4[q] << 16);
      acc[2 * q + 1] += wk * __uint_as_float(w4[q] & 0xffff0000u);
    }
  }
}

// u [T, L] = Σ_k w[t,k] y[slot_of[t,k]]: one CTA per token, 8 bf16 per thread step.
__global__ void combine_kernel(float* __restrict__ u, const bf16* __restrict__ y, const float* __restrict__ weight,
                               const int32_t* __restrict__ slot_of, int K, int L) {
  pdl::wait_then_release();
  const int64_t t = blockIdx.x;
  for (int c = threadIdx.x * 8; c < L; c += blockDim.x * 8) {
    float acc[8];
    combine_eight(acc, y, weight, slot_of, t, K, L, c);
    float4* dst = reinterpret_cast<float4*>(u + t * L + c);
    dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

// normed [T, L] bf16 = RMSNorm(u) with u [T, L] = Σ_k w[t,k] y[slot_of[t,k]], the latent norm after the
// combine in one launch (a decode step's MoE is a chain of small launches): one CTA per token, a thread per 8
// columns. u's sums are combine_kernel's, term for term; the norm is norm_cuda's formula, w (u r) with
// r = 1 / sqrt(Σu² / L + eps) in fp32, its sum of squares reduced over this CTA's threads.
__global__ void __launch_bounds__(1024)
    combine_rmsnorm_kernel(bf16* __restrict__ normed, const bf16* __restrict__ y, const float* __restrict__ weight,
                           const int32_t* __restrict__ slot_of, int K, int L, const float* __restrict__ nw, float eps) {
  __shared__ float sh[32][1];
  const int64_t t = blockIdx.x;
  const int c = int(threadIdx.x) * 8;
  const bool mine = c < L;
  float w8[8];
  if (mine && nw) rowwise::load_vec<float, 8>(w8, nw + c);  // (a weight: before the wait)
  pdl::wait_then_release();
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (mine) combine_eight(acc, y, weight, slot_of, t, K, L, c);
  float ss[1] = {0.0f};
#pragma unroll
  for (int i = 0; i < 8; ++i) ss[0] = fmaf(acc[i], acc[i], ss[0]);
  rowwise::block_sum<1>(ss, sh);
  const float r = 1.0f / sqrtf(ss[0] / float(L) + eps);
  if (!mine) return;
  float o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = nw ? w8[i] * (acc[i] * r) : acc[i] * r;
  rowwise::store_vec<bf16, 8>(normed + t * L + c, o);
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void fill_bf16_kernel(bf16* __restrict__ dst, int64_t n, float scale, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(seed ^ mix64(uint64_t(i)));
    const float u = float(h >> 40) * 0x1p-24f * 2.0f - 1.0f;  // [-1, 1)
    const __nv_bfloat16 b = __float2bfloat16_rn(u * scale);
    dst[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

__global__ void fill_u8_kernel(uint8_t* __restrict__ dst, int64_t n, int lo, int span, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = uint8_t(lo + int(mix64(seed ^ mix64(uint64_t(i))) % uint64_t(span)));
}

int grid_for(int64_t n, int threads) { return int(std::min<int64_t>((n + threads - 1) / threads, 65535 * 4)); }

}  // namespace

// ---- router ---------------------------------------------------------------------------------------

std::string router_can_run(const RouterParams& p) {
  if (p.num_experts < 1 || p.num_experts > kRouterMaxExperts)
    return "num_experts must be in [1, " + std::to_string(kRouterMaxExperts) + "], got " +
           std::to_string(p.num_experts);
  if (p.top_k < 1 || p.top_k > p.num_experts || p.top_k > 64)
    return "top_k must be in [1, min(num_experts, 64)], got " + std::to_string(p.top_k);
  if (p.num_groups < 1 || p.num_groups > 64 || p.num_experts % p.num_groups != 0)
    return "num_groups must divide num_experts and be at most 64, got " + std::to_string(p.num_groups);
  if (p.num_groups > 1 && (p.topk_groups < 1 || p.topk_groups > p.num_groups))
    return "topk_groups must be in [1, num_groups], got " + std::to_string(p.topk_groups);
  return "";
}

namespace {
// The router launch shared by inference and training (scores_out, sel_sum_out: null, or the training
// outputs of moe_train_cuda.h's router_forward_train).
void launch_router(const char* what, int32_t* idx, float* weight, float* scores_out, float* sel_sum_out,
                   const float* logits, const float* bias, int64_t T, const RouterParams& p) {
  const std::string why = router_can_run(p);
  K3_CHECK(why.empty(), "moe::cuda::", what, ": ", why);
  if (T <= 0) return;
  const size_t smem = size_t(p.num_experts) * 9;
  K3_CUDA_CHECK(cudaFuncSetAttribute(router_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  pdl::launch(router_kernel, unsigned(T), kRouterThreads, smem, idx, weight, scores_out, sel_sum_out, logits, bias,
              int(p.num_experts), int(p.top_k), int(p.num_groups), int(p.topk_groups), p.renormalize, p.scaling);
  K3_CUDA_LAUNCH_CHECK();
}
}  // namespace

void router_forward(int32_t* idx, float* weight, const float* logits, const float* bias, int64_t T,
                    const RouterParams& p) {
  launch_router("router_forward", idx, weight, nullptr, nullptr, logits, bias, T, p);
}

// Declared in moe_train_cuda.h: the same kernel, also writing the scores and the selected sums.
void router_forward_train(int32_t* idx, float* weight, float* scores, float* sel_sum, const float* logits,
                          const float* bias, int64_t N, const RouterParams& p) {
  launch_router("router_forward_train", idx, weight, scores, sel_sum, logits, bias, N, p);
}

namespace {
__global__ void router_force_kernel(int32_t* __restrict__ idx, float* __restrict__ weight, float* __restrict__ sel_sum,
                                    const float* __restrict__ scores, const int32_t* __restrict__ forced, int64_t N,
                                    int E, int K, bool renormalize, float scaling) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= N) return;
  double sum = 0.0;
  for (int k = 0; k < K; ++k) sum += scores[t * E + forced[t * K + k]];
  if (sel_sum) sel_sum[t] = float(sum);
  for (int k = 0; k < K; ++k) {
    const int e = forced[t * K + k];
    const double s = scores[t * E + e];
    const double w = renormalize ? s / (sum + 1e-20) : s;
    idx[t * K + k] = e;
    weight[t * K + k] = float(w * scaling);
  }
}
}  // namespace

void router_force_train(int32_t* idx, float* weight, float* sel_sum, const float* scores, const int32_t* forced,
                        int64_t N, const RouterParams& p) {
  if (N <= 0) return;
  constexpr int threads = 128;
  router_force_kernel<<<unsigned((N + threads - 1) / threads), threads>>>(idx, weight, sel_sum, scores, forced, N,
                                                                          int(p.num_experts), int(p.top_k),
                                                                          p.renormalize, p.scaling);
  K3_CUDA_LAUNCH_CHECK();
}

// ---- dispatch -------------------------------------------------------------------------------------

Dispatch::Dispatch(int64_t max_tokens, int64_t num_experts, int64_t top_k)
    : E_(num_experts),
      K_(top_k),
      max_tokens_(max_tokens),
      counts_(size_t(num_experts)),
      offsets_(size_t(num_experts + 1)),
      cursor_(size_t(num_experts)),
      slot_token_(size_t(std::max<int64_t>(1, max_tokens * top_k))),
      slot_of_(size_t(std::max<int64_t>(1, max_tokens * top_k))),
      tiles_(size_t(2 * ((max_tokens * top_k + 63) / 64 + std::min(num_experts, max_tokens * top_k)) + 2)),
      num_tiles_(1) {
  K3_CHECK(num_experts >= 1 && top_k >= 1 && top_k <= num_experts && max_tokens >= 0,
           "moe::cuda::Dispatch: need 1 <= top_k <= num_experts, got E=", num_experts, " K=", top_k);
  K3_CHECK(max_tokens * top_k < (int64_t(1) << 31), "moe::cuda::Dispatch: ", max_tokens, " tokens × top-", top_k,
           " slots overflow int32");
}

namespace {
int choose_tile_m(int64_t S, int64_t E) {
  // Rows computed per expert for an average group a = S/E: ceil(a/TM)·TM. A 64-row tile (128 weight
  // rows, 2 CTAs/SM) costs ~1.3× more per computed row than a 128-row one (256 weight rows) (docs/CUDA.md,
  // "LatentMoE", tile height), so 64 is taken only for small groups, where it pads much less.
  const double a = std::max(1.0, double(S) / double(E));
  const double c128 = std::ceil(a / 128) * 128, c64 = std::ceil(a / 64) * 64 * 1.3;
  return c64 < c128 ? 64 : 128;
}
}  // namespace

void Dispatch::build(const int32_t* idx, int64_t T, int tile_m) {
  K3_CHECK(T >= 0 && T <= max_tokens_, "moe::cuda::Dispatch::build: ", T, " tokens, capacity ", max_tokens_);
  K3_CHECK(tile_m == 0 || tile_m == 64 || tile_m == 128,
           "moe::cuda::Dispatch::build: tile_m must be 0 (auto), 64 or 128, got ", tile_m);
  T_ = T;
  const int64_t S = T * K_;
  tile_m_ = tile_m ? tile_m : choose_tile_m(S, E_);
  max_tiles_ = (S + tile_m_ - 1) / tile_m_ + std::min(E_, S);
  if (S <= kPlanSmallSlots && E_ <= kPlanSmallExperts) {
    const size_t smem = size_t(3 * E_) * 4;
    K3_CUDA_CHECK(cudaFuncSetAttribute(plan_small_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    pdl::launch(plan_small_kernel, 1, kScanThreads, smem, counts_.data(), offsets_.data(), tiles_.data(),
                num_tiles_.data(), slot_of_.data(), slot_token_.data(), idx, int(S), int(K_), int(E_), tile_m_);
    K3_CUDA_LAUNCH_CHECK();
    return;
  }
  K3_CUDA_CHECK(cudaMemsetAsync(counts_.data(), 0, size_t(E_) * 4));
  count_kernel<<<grid_for(S, 256), 256>>>(counts_.data(), idx, S);
  K3_CUDA_LAUNCH_CHECK();
  const size_t smem = size_t(2 * E_) * 4;
  K3_CUDA_CHECK(cudaFuncSetAttribute(scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  scan_kernel<<<1, kScanThreads, smem>>>(offsets_.data(), cursor_.data(), tiles_.data(), num_tiles_.data(),
                                         counts_.data(), int(E_), tile_m_);
  K3_CUDA_LAUNCH_CHECK();
  scatter_kernel<<<grid_for(S, 256), 256>>>(slot_of_.data(), slot_token_.data(), cursor_.data(), idx, S, int(K_));
  K3_CUDA_LAUNCH_CHECK();
}

// ---- weights --------------------------------------------------------------------------------------

ExpertLinear ExpertLinear::bf16_stacked(const bf16* w, int64_t rows, int64_t cols) {
  ExpertLinear l;
  l.format = Format::BF16;
  l.rows = rows;
  l.cols = cols;
  l.data = w;
  l.expert_stride = rows * cols * 2;
  return l;
}

ExpertLinear ExpertLinear::mxfp4_stacked(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols) {
  ExpertLinear l;
  l.format = Format::MXFP4;
  l.rows = rows;
  l.cols = cols;
  l.data = packed;
  l.expert_stride = rows * cols / 2;
  l.scales = scales;
  l.scale_stride = rows * cols / 32;
  return l;
}

std::string gemm_can_run(const ExpertLinear& w) {
  if (w.data == nullptr) return "the weight is empty";
  if (w.rows < 1 || w.rows % 8 != 0)
    return "weight rows must be a positive multiple of 8, got " + std::to_string(w.rows);
  if (w.rows >= (int64_t(1) << 30) || w.cols >= (int64_t(1) << 30)) return "weight too large";
  if (w.format == ExpertLinear::Format::BF16) {
    if (w.cols < 8 || w.cols % 8 != 0)
      return "bf16 weight cols must be a positive multiple of 8, got " + std::to_string(w.cols);
    if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0 || w.expert_stride % 16 != 0)
      return "bf16 weight data and expert stride must be 16-byte aligned";
  } else {
    if (w.cols < 32 || w.cols % 32 != 0)
      return "MXFP4 weight cols must be a positive multiple of 32, got " + std::to_string(w.cols);
    if (w.cols > kMaxMxCols)
      return "MXFP4 weight cols above " + std::to_string(kMaxMxCols) + " (scales kept in shared memory)";
    if (w.scales == nullptr) return "MXFP4 weight has no scales";
    if (reinterpret_cast<uintptr_t>(w.data) % 16 != 0 || w.expert_stride % 16 != 0)
      return "MXFP4 packed data and expert stride must be 16-byte aligned";
  }
  return "";
}

// ---- GEMMs ----------------------------------------------------------------------------------------

void grouped_gemm(bf16* y, const bf16* x, const int32_t* x_rows, const Dispatch& d, const ExpertLinear& w,
                  const GemmConfig& cfg) {
  check_gemm(w, "grouped_gemm");
  check_config(cfg, "grouped_gemm");
  if (d.slots() == 0) return;
  K3_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0, "moe::cuda::grouped_gemm: x must be 16-byte aligned");
  GemmArgs a{};
  a.x = x;
  a.x_rows = x_rows;
  a.w0 = static_cast<const unsigned char*>(w.data);
  a.w1 = a.w0;
  a.w_stride = w.expert_stride;
  a.s0 = w.scales;
  a.s1 = w.scales;
  a.s_stride = w.scale_stride;
  a.N = int(w.rows);
  a.K = int(w.cols);
  a.offsets = d.offsets();
  a.tiles = d.tiles();
  a.num_tiles = d.num_tiles();
  a.y = y;
  if (w.format == ExpertLinear::Format::MXFP4) launch_gemm<false, true>(a, d, cfg);
  else launch_gemm<false, false>(a, d, cfg);
}

void expert_gate_up(bf16* h, const bf16* z, const Dispatch& d, const ExpertLinear& w1, const ExpertLinear& w3,
                    const GluParams& glu, const GemmConfig& cfg) {
  check_gemm(w1, "expert_gate_up (gate w1)");
  check_gemm(w3, "expert_gate_up (up w3)");
  check_config(cfg, "expert_gate_up");
  K3_CHECK(w1.format == w3.format && w1.rows == w3.rows && w1.cols == w3.cols && w1.expert_stride == w3.expert_stride &&
               w1.scale_stride == w3.scale_stride,
           "moe::cuda::expert_gate_up: gate and up weights must have the same format, shape and strides");
  if (d.slots() == 0) return;
  K3_CHECK(reinterpret_cast<uintptr_t>(z) % 16 == 0, "moe::cuda::expert_gate_up: z must be 16-byte aligned");
  GemmArgs a{};
  a.x = z;
  a.x_rows = d.slot_token();
  a.w0 = static_cast<const unsigned char*>(w1.data);
  a.w1 = static_cast<const unsigned char*>(w3.data);
  a.w_stride = w1.expert_stride;
  a.s0 = w1.scales;
  a.s1 = w3.scales;
  a.s_stride = w1.scale_stride;
  a.N = int(w1.rows);
  a.K = int(w1.cols);
  a.offsets = d.offsets();
  a.tiles = d.tiles();
  a.num_tiles = d.num_tiles();
  a.y = h;
  a.glu = glu_consts(glu);
  if (w1.format == ExpertLinear::Format::MXFP4) launch_gemm<true, true>(a, d, cfg);
  else launch_gemm<true, false>(a, d, cfg);
}

void expert_down(bf16* y, const bf16* h, const Dispatch& d, const ExpertLinear& w2, const GemmConfig& cfg) {
  grouped_gemm(y, h, nullptr, d, w2, cfg);
}

void combine(float* u, const bf16* y, const float* weight, int64_t T, int64_t K, int64_t L, const int32_t* slot_of) {
  K3_CHECK(L > 0 && L % 8 == 0, "moe::cuda::combine: L must be a positive multiple of 8, got ", L);
  K3_CHECK(T >= 0 && T <= INT_MAX && K >= 1 && K <= 64, "moe::cuda::combine: T = ", T, ", K = ", K);
  if (T == 0) return;
  pdl::launch(combine_kernel, unsigned(T), 128, 0, u, y, weight, slot_of, int(K), int(L));
}

void combine(float* u, const bf16* y, const float* weight, const Dispatch& d, int64_t L) {
  combine(u, y, weight, d.tokens(), d.top_k(), L, d.slot_of());
}

void combine_rmsnorm(bf16* normed, const bf16* y, const float* weight, int64_t T, int64_t K, int64_t L,
                     const int32_t* slot_of, const float* norm_weight, float eps) {
  K3_CHECK(L > 0 && L % 8 == 0 && L <= 8 * 1024,
           "moe::cuda::combine_rmsnorm: L must be a positive multiple of 8 up to 8192, got ", L);
  K3_CHECK(T >= 0 && T <= INT_MAX && K >= 1 && K <= 64, "moe::cuda::combine_rmsnorm: T = ", T, ", K = ", K);
  if (T == 0) return;
  const unsigned threads = unsigned(std::max<int64_t>(32, (L / 8 + 31) / 32 * 32));
  pdl::launch(combine_rmsnorm_kernel, unsigned(T), threads, 0, normed, y, weight, slot_of, int(K), int(L), norm_weight,
              eps);
}

void combine_rmsnorm(bf16* normed, const bf16* y, const float* weight, const Dispatch& d, int64_t L,
                     const float* norm_weight, float eps) {
  combine_rmsnorm(normed, y, weight, d.tokens(), d.top_k(), L, d.slot_of(), norm_weight, eps);
}

void experts_forward(float* u, bf16* h, bf16* y, const bf16* z, const float* weight, const Dispatch& d,
                     const ExpertLinear& w1, const ExpertLinear& w3, const ExpertLinear& w2, const GluParams& glu,
                     const GemmConfig& cfg) {
  K3_CHECK(w2.cols == w1.rows && w2.rows == w1.cols, "moe::cuda::experts_forward: w2 must be [L, I] for w1 [I, L]");
  expert_gate_up(h, z, d, w1, w3, glu, cfg);
  expert_down(y, h, d, w2, cfg);
  combine(u, y, weight, d, w2.rows);
}

__global__ void glu_eval_kernel(float* y, const float* g, const float* u, int64_t n, GluConsts c) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = moe_glu(g[i], u[i], c);
}

void glu_eval(float* y, const float* g, const float* u, int64_t n, const GluParams& glu) {
  if (n <= 0) return;
  glu_eval_kernel<<<grid_for(n, 256), 256>>>(y, g, u, n, glu_consts(glu));
  K3_CUDA_LAUNCH_CHECK();
}

void fill_random_bf16(bf16* dst, int64_t n, float scale, uint64_t seed) {
  if (n <= 0) return;
  fill_bf16_kernel<<<grid_for(n, 256), 256>>>(dst, n, scale, seed);
  K3_CUDA_LAUNCH_CHECK();
}

void fill_random_u8(uint8_t* dst, int64_t n, int lo, int hi, uint64_t seed) {
  K3_CHECK(0 <= lo && lo <= hi && hi <= 255, "moe::cuda::fill_random_u8: need 0 <= lo <= hi <= 255");
  if (n <= 0) return;
  fill_u8_kernel<<<grid_for(n, 256), 256>>>(dst, n, lo, hi - lo + 1, seed);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::moe::cuda
