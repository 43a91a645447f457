// The training attention's forward on Hopper's warpgroup MMA at K3's head dims (qk 192, v 128):
// FlashAttention-3's structure without its ping-pong scheduling. mla_train_wgmma_cuda.cuh has the
// contract; mla_train_tc_cuda.h the semantics and numerics, which this kernel keeps (operands bf16,
// products accumulated in fp32, softmax in fp32 with exp2 and log2(e)·scale folded into the scores,
// masked scores -inf by selection, l the sum of the unrounded probabilities).
//
// A CTA owns 128 queries [m0, m0 + 128) of one (sequence, head) and walks 128-key tiles from 0 to the
// causal end min(len, m0 + 128); the heaviest (latest) query blocks are launched first.
//   - Warpgroup 2 produces: one thread loads the Q tile once and then each K and V tile into a ring of
//     two stages by TMA (3-D tensor maps over the packed [H][rows][W] operands, 128-row × 64-column
//     boxes, 128-byte swizzle; rows past the packed buffer arrive as zeros, rows of the next packed
//     sequence are masked by selection like any key past len, and multiply P = 0 in P V).
//   - Warpgroups 0 and 1 consume, 64 queries each: S = Q Kᵀ by 12 wgmma m64n128k16 with both
//     operands K-major in shared memory; the online softmax on the fp32 accumulators (each thread holds
//     rows g and g + 8 of its warp's 16, columns 8j + 2t, +1: row statistics are quad shuffles, as in
//     the mma.sync kernel); P rounded to bf16 into A fragments in registers (two accumulator n8 blocks
//     are one k16 A fragment); O += P V by up to 8 register-A wgmma m64n128k16 whose B, V [keys][dv],
//     is read MN-major (dv contiguous) from the same tile.
//   - Barriers: full[s] completes on the stage's TMA bytes; empty[s] when the 8 consumer warps are
//     done with it; a warpgroup with no query in the sequence still waits and arrives, so the counts
//     hold.
// Shared layouts (1024-byte aligned): a Q or K tile is 3 boxes [128 rows][64 dims] (16 KB each, row r
// at r·128 B, 16-byte chunk c at c ^ (r & 7)): K-major descriptors with SBO 1024 B, the k16 slice w of
// a box 32·w bytes in. A V tile is 2 such boxes [128 keys][64 dv]: as an MN-major operand, 64-dv atoms
// 16 KB apart (LBO), 8-key groups 1024 B apart (SBO), the k16 slice kk 2048·kk bytes in (the layout
// the training expert GEMMs read MN-major operands in).
// Shared memory: Q 48 KB + 2 × (K 48 KB + V 32 KB) = 208 KB: one CTA per SM.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/common/sm90_ptx.cuh"
#include "kernels/common/tensor_map_cuda.h"
#include "kernels/mla/mla_train_common.cuh"
#include "kernels/mla/mla_train_wgmma_cuda.cuh"

namespace k3::mla::cuda::wgmma {
namespace {

constexpr int kBM = 128, kBN = 128;  // queries per CTA (two consumer warpgroups of 64), keys per tile
constexpr int kDq = 192, kDv = 128;  // padded head dims this kernel takes
constexpr int kBoxBytes = 128 * 128;                   // one box: 128 rows × 64 bf16
constexpr int kQkBytes = (kDq / 64) * kBoxBytes;       // a Q or K tile: 48 KB
constexpr int kVBytes = (kDv / 64) * kBoxBytes;        // a V tile: 32 KB
constexpr int kStages = 2;
constexpr int kThreads = 384;                          // consumers 0, 1; producer 2
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // 2·128·224 + 128·56 = 168·384, the launch's
constexpr size_t kSmemBytes = size_t(kQkBytes) + kStages * size_t(kQkBytes + kVBytes) + 1024 + 64;
constexpr float kLn2 = 0.6931471805599453f;

__global__ void __launch_bounds__(kThreads, 1)
    attn_fwd_sm90_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                         const __grid_constant__ CUtensorMap mv, const PackedQkv a, float* __restrict__ o,
                         int64_t ldo, float* __restrict__ lse) {
  extern __shared__ unsigned char smem_raw[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int base = a.cu[b];
  const int len = a.cu[b + 1] - base;
  const int m0 = (int(gridDim.x) - 1 - int(blockIdx.x)) * kBM;
  if (m0 >= len) return;  // the whole CTA, before any barrier
  const uint32_t sQ = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = sQ + kQkBytes, sV = sK + kStages * kQkBytes;
  const uint32_t qbar = sV + kStages * kVBytes, full = qbar + 8, empty = full + 8 * kStages;
  const int tiles = (min(len, m0 + kBM) + kBN - 1) / kBN;
  const int tid = threadIdx.x;
  if (tid == 0) {
    ptx::mbar_init(qbar, 1);
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full + 8 * s, 1);   // the producer's expect_tx arrival (+ the bytes)
      ptx::mbar_init(empty + 8 * s, 8);  // the 8 consumer warps
    }
    ptx::fence_mbar_init();
  }
  __syncthreads();

  if (tid >= 256) {
    // ---- producer: one thread issues every copy ----
    ptx::setmaxnreg_dec<kProducerRegs>();
    if (tid != 256) return;
    ptx::prefetch_tensormap(&mq);
    ptx::prefetch_tensormap(&mk);
    ptx::prefetch_tensormap(&mv);
    ptx::mbar_arrive_expect_tx(qbar, kQkBytes);
    for (int blk = 0; blk < kDq / 64; ++blk) ptx::tma_load_3d(sQ + blk * kBoxBytes, &mq, qbar, 64 * blk, base + m0, h);
    for (int it = 0; it < tiles; ++it) {
      const int s = it & (kStages - 1);
      ptx::wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
      const uint32_t bar = full + 8 * s;
      ptx::mbar_arrive_expect_tx(bar, kQkBytes + kVBytes);
      for (int blk = 0; blk < kDq / 64; ++blk)
        ptx::tma_load_3d(sK + s * kQkBytes + blk * kBoxBytes, &mk, bar, 64 * blk, base + it * kBN, h);
      for (int blk = 0; blk < kDv / 64; ++blk)
        ptx::tma_load_3d(sV + s * kVBytes + blk * kBoxBytes, &mv, bar, 64 * blk, base + it * kBN, h);
    }
    return;
  }

  // ---- consumers ----
  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wq0 = m0 + 64 * wg;           // the warpgroup's first query
  const bool active = wq0 < len;          // warpgroup-uniform
  const int row0 = wq0 + 16 * warp + g;   // this thread's queries row0 and row0 + 8
  float oacc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) oacc[i] = 0.0f;
  // Rows row0, row0 + 8: running max (log2 units of the scaled scores), this thread's partial sum of
  // the probabilities (its 32 columns of every tile; the quad's sum at the end).
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  ptx::wait_or_trap(qbar, 0);

  for (int it = 0; it < tiles; ++it) {
    const int s = it & (kStages - 1), n0 = it * kBN;
    ptx::wait_or_trap(full + 8 * s, (it / kStages) & 1);
    if (active) {
      float sacc[64];
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kDq / 16; ++kk) {
        const int blk = kk >> 2, w = kk & 3;
        const uint64_t da = ptx::desc_k_sw128(sQ + blk * kBoxBytes + wg * 64 * 128) + 2 * w;
        const uint64_t db = ptx::desc_k_sw128(sK + s * kQkBytes + blk * kBoxBytes) + 2 * w;
        ptx::wgmma_m64n128k16_bf16_ss<0, 0>(sacc, da, db, kk > 0);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(sacc);

      // Online softmax; sacc[4j + e] is (query row0 + 8(e/2), key n0 + 8j + 2t4 + e%2). Masked: -inf.
      // A tile whose every key is <= the warpgroup's first query and < len needs no mask.
      const bool unmasked = n0 + kBN - 1 <= wq0 && n0 + kBN <= len;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = sacc[4 * j + e] * a.scale_log2;
          if (!unmasked) {
            const int t = row0 + 8 * (e >> 1), key = n0 + 8 * j + 2 * t4 + (e & 1);
            x = (key <= t && key < len) ? x : -INFINITY;
          }
          sacc[4 * j + e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      float m_use[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m_new = fmaxf(m_r[r], ptx::quad_max(mx[r]));
        m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: exp2(-inf - 0) = 0
        alpha[r] = exp2f(m_r[r] - m_use[r]);
        m_r[r] = m_new;
        l_r[r] *= alpha[r];
      }
      uint32_t pa[kBN / 16][4];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[e] = exp2f(sacc[4 * j + e] - m_use[e >> 1]);
          l_r[e >> 1] += p[e];
        }
        // n8 blocks 2c and 2c + 1 are the A fragment of the 16-key slice c: (a0, a1) from 2c, (a2, a3)
        pa[j >> 1][2 * (j & 1)] = ptx::pack_bf16x2(p[0], p[1]);
        pa[j >> 1][2 * (j & 1) + 1] = ptx::pack_bf16x2(p[2], p[3]);
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        oacc[4 * j] *= alpha[0], oacc[4 * j + 1] *= alpha[0];
        oacc[4 * j + 2] *= alpha[1], oacc[4 * j + 3] *= alpha[1];
      }
      ptx::wgmma_fence();
      // All 8 slices, also those past the warpgroup's last query on the diagonal tile (their P is 0):
      // a data-dependent exit from this loop is a divergent path to ptxas, which then serialises the
      // wgmmas behind a warpgroup arrive (its warning C7520).
#pragma unroll
      for (int c = 0; c < kBN / 16; ++c)
        ptx::wgmma_m64n128k16_bf16_rs<1>(oacc, pa[c], ptx::desc_mn_sw128(sV + s * kVBytes + c * 2048, kBoxBytes), 1);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(oacc);
    }
    if (lane == 0) ptx::mbar_arrive(empty + 8 * s);
  }
  if (!active) return;

  // o = O / l and lse = ln 2 · (m + log2 l) for the rows that exist (l >= 1: its largest term is 2^0).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = ptx::quad_sum(l_r[r]);
    const int t = row0 + 8 * r;
    if (t >= len) continue;
    float* orow = o + (int64_t(base) + t) * ldo + int64_t(h) * kDv;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = 8 * j + 2 * t4;
      orow[col] = oacc[4 * j + 2 * r] / l;
      orow[col + 1] = oacc[4 * j + 2 * r + 1] / l;
    }
    if (t4 == 0) lse[int64_t(h) * a.rows + base + t] = (m_r[r] + log2f(l)) * kLn2;
  }
}

}  // namespace

void attention_forward(const PackedQkv& a, float* o, int64_t ldo, float* lse, int B, int64_t max_len) {
  if (B == 0 || max_len == 0 || a.rows == 0) return;
  const uint64_t rows = uint64_t(a.rows), H = uint64_t(a.H);
  const CUtensorMap mq =
      cuda_tma::bf16_3d_sw128(a.q, kDq, rows, H, kDq * 2, rows * kDq * 2, 64, kBN, "the packed MLA queries");
  const CUtensorMap mk =
      cuda_tma::bf16_3d_sw128(a.k, kDq, rows, H, kDq * 2, rows * kDq * 2, 64, kBN, "the packed MLA keys");
  const CUtensorMap mv =
      cuda_tma::bf16_3d_sw128(a.v, kDv, rows, H, kDv * 2, rows * kDv * 2, 64, kBN, "the packed MLA values");
  static size_t allowed = 0;
  train_common::allow_smem(attn_fwd_sm90_kernel, kSmemBytes, allowed);
  const dim3 grid(unsigned((max_len + kBM - 1) / kBM), unsigned(a.H), unsigned(B));
  attn_fwd_sm90_kernel<<<grid, kThreads, kSmemBytes>>>(mq, mk, mv, a, o, ldo, lse);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::mla::cuda::wgmma
