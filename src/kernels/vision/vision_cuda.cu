// The vision tower's own ops on the GPU (vision_cuda.h has the API and the numerics): the position
// embedding, RoPE + packing, bidirectional attention (two kernels), GELU and the sd2_tpool merge.
//
// The attention kernels are the repository's two flash-attention designs with a bidirectional, per-item mask:
//   - attn_mma_kernel: the MLA prefill kernel's structure (kernels/mla/mla_cuda.cu): one CTA per 64 queries of
//     one (item, head), 4 warps of 16 rows, Q in registers, K/V in 64-key tiles through two cp.async stages
//     (rows padded by 8 bf16, so every ldmatrix is conflict-free), S and P in registers (the C fragments of two
//     key n-tiles are the A fragment of P·V).
//   - attn_wgmma_kernel: the training attention's Hopper forward (kernels/mla/mla_train_wgmma_cuda.cu) at head
//     width 128 instead of 192: warpgroup 2 loads Q once and K/V tiles of 128 keys by TMA into a two-stage ring
//     (3-D tensor maps over the packed [heads][L][128] operands, 128-row x 64-column boxes, 128-byte swizzle);
//     warpgroups 0 and 1 own 64 queries each: S = Q Kᵀ by 8 wgmma m64n128k16 from shared memory, the online
//     softmax on the fp32 accumulators, P rounded to bf16 into register A fragments, O += P V by 8 register-A
//     wgmma m64n128k16 reading V MN-major. Shared memory: Q 32 KB + 2 x (K 32 KB + V 32 KB): one CTA per SM.
// Both mask by selection: a key past the item's end scores -inf (those rows are zero-filled or belong to the
// next item, whose values are finite, so p = 0 times them is 0), and a row's running max starts at -inf with 0
// as its subtrahend until a key is seen (every row sees key 0 of its item, so l >= 1 at the end).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <tuple>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/common/sm90_ptx.cuh"
#include "kernels/common/tensor_map_cuda.h"
#include "kernels/vision/vision_cuda.h"

namespace k3::vision::cuda {

namespace {

using bf16 = uint16_t;

#define K3_VISION_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

constexpr int kEltThreads = 256;

// ---------------------------------------------------------------------------------------------------------------
// Position embedding. One thread per (patch of the grid, channel): the interpolated value once, added to every
// frame's row. The taps are k3::position_table_resize's (align_corners = false, clamped below at 0).

__global__ void position_kernel(float* __restrict__ x, const float* __restrict__ table, int H0, int W0, int64_t D,
                                int t, int h, int w, const float* __restrict__ time) {
  const int64_t n = int64_t(h) * w * D;
  const bool same = h == H0 && w == W0;
  const double sr = double(H0) / double(h), sc = double(W0) / double(w);
  K3_VISION_GRID_STRIDE(i, n) {
    const int64_t p = i / D, d = i - p * D;
    const int r = int(p / w), c = int(p - int64_t(r) * w);
    float pos;
    if (same) {
      pos = table[i];
    } else {
      const double yr = fmax((double(r) + 0.5) * sr - 0.5, 0.0), yc = fmax((double(c) + 0.5) * sc - 0.5, 0.0);
      const int r0 = min(int(yr), H0 - 1), c0 = min(int(yc), W0 - 1);
      const int r1 = min(r0 + 1, H0 - 1), c1 = min(c0 + 1, W0 - 1);
      const double fr = yr - double(r0), fc = yc - double(c0);
      const double a = table[(int64_t(r0) * W0 + c0) * D + d], b = table[(int64_t(r0) * W0 + c1) * D + d];
      const double e = table[(int64_t(r1) * W0 + c0) * D + d], f = table[(int64_t(r1) * W0 + c1) * D + d];
      const double top = a * (1.0 - fc) + b * fc, bot = e * (1.0 - fc) + f * fc;
      pos = float(top * (1.0 - fr) + bot * fr);
    }
    for (int frame = 0; frame < t; ++frame) {
      float* xr = x + int64_t(frame) * h * w * D + i;
      *xr = float(double(*xr) + double(pos) + (time ? double(time[int64_t(frame) * D + d]) : 0.0));
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// RoPE + packing. One thread per (head, row, 4 columns): columns 4i..4i+3 of a head vector are pair 2i (turned
// by the column) and pair 2i + 1 (turned by the row), both at frequency i. Thread i writes packed elements
// 4i..4i+3 (the packed layout [heads][L][W] in that order), so writes are contiguous across the warp.

struct RopeArgs {
  const float* qkv;
  int64_t ld, L, heads, hd, W, positions;
  const int32_t* rows;
  const int32_t* cols;
  const float* table;
  bf16* q;
  bf16* k;
  bf16* v;
};

__device__ __forceinline__ uint2 pack4(float a, float b, float c, float d) {
  return make_uint2(ptx::pack_bf16x2(a, b), ptx::pack_bf16x2(c, d));
}

__global__ void rope_pack_kernel(const RopeArgs a) {
  const int64_t groups = a.W / 4, nf = a.hd / 4;
  const int64_t n = a.heads * a.L * groups;
  K3_VISION_GRID_STRIDE(i, n) {
    const int64_t g = i % groups, hr = i / groups, r = hr % a.L, hh = hr / a.L;
    uint2* dq = reinterpret_cast<uint2*>(a.q) + i;
    uint2* dk = reinterpret_cast<uint2*>(a.k) + i;
    uint2* dv = reinterpret_cast<uint2*>(a.v) + i;
    if (g >= nf) {  // the padding columns of the packed width: zeros
      *dq = *dk = *dv = make_uint2(0u, 0u);
      continue;
    }
    const float* src = a.qkv + r * a.ld + hh * a.hd + 4 * g;
    const float4 q = *reinterpret_cast<const float4*>(src);
    const float4 k = *reinterpret_cast<const float4*>(src + a.heads * a.hd);
    const float4 v = *reinterpret_cast<const float4*>(src + 2 * a.heads * a.hd);
    const int col = a.cols[r], row = a.rows[r];
    if (col < 0 || col >= a.positions || row < 0 || row >= a.positions) {  // never read outside the table
      *dq = *dk = pack4(NAN, NAN, NAN, NAN);
      *dv = pack4(v.x, v.y, v.z, v.w);
      continue;
    }
    const float cc = a.table[(col * nf + g) * 2], sc = a.table[(col * nf + g) * 2 + 1];
    const float cr = a.table[(row * nf + g) * 2], sr = a.table[(row * nf + g) * 2 + 1];
    *dq = pack4(q.x * cc - q.y * sc, q.x * sc + q.y * cc, q.z * cr - q.w * sr, q.z * sr + q.w * cr);
    *dk = pack4(k.x * cc - k.y * sc, k.x * sc + k.y * cc, k.z * cr - k.w * sr, k.z * sr + k.w * cr);
    *dv = pack4(v.x, v.y, v.z, v.w);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// GELU (fp32 math, one rounding to bf16). The tanh form as x·σ(2z) = x / (1 + e^(-2z)) (equal to
// 0.5 x (1 + tanh z), without the cancellation of 1 + tanh z at large negative z; e^(-2z) = inf gives -0, the
// limit); the erf form as 0.5 x erfc(-x/√2) (erfc keeps the tail 1 + erf loses). Accurate expf/erfcf.

template <int kForm>
__global__ void gelu_kernel(bf16* __restrict__ y, const float* __restrict__ x, int64_t n) {
  K3_VISION_GRID_STRIDE(i, n) {
    const float v = x[i];
    float g;
    if constexpr (kForm == 0) {
      const float z = 0.7978845608028654f * (v + 0.044715f * v * v * v);  // sqrt(2/pi) (x + 0.044715 x³)
      g = v / (1.0f + expf(-2.0f * z));
    } else {
      g = 0.5f * v * erfcf(-v * 0.7071067811865476f);
    }
    y[i] = rowwise::f32_to_bf16_rne(g);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// sd2_tpool merge: one thread per output element; the frames summed in double in frame order and divided once,
// the CPU's arithmetic (model/vision.cpp), so the fp32 output equals the CPU's bit for bit on equal inputs.

__global__ void merge_kernel(float* __restrict__ out_f32, bf16* __restrict__ out_bf16, const float* __restrict__ x,
                             int t, int h, int w, int64_t D, int mh, int mw) {
  const int tw = w / mw, K = mh * mw;
  const int64_t n = int64_t(h / mh) * tw * K * D;
  K3_VISION_GRID_STRIDE(i, n) {
    const int64_t d = i % D, tk = i / D;
    const int kk = int(tk % K);
    const int64_t tok = tk / K;
    const int r = int(tok / tw) * mh + kk / mw, c = int(tok % tw) * mw + kk % mw;
    double s = 0.0;
    for (int f = 0; f < t; ++f) s += x[((int64_t(f) * h + r) * w + c) * D + d];
    const float m = float(s / double(t));
    out_f32[i] = m;
    if (out_bf16) out_bf16[i] = rowwise::f32_to_bf16_rne(m);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Attention, mma.sync (FlashAttention-2). See the file comment; the fragment bookkeeping is the MLA prefill's.

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool pred) {
  ptx::cp_async16(dst, src, pred ? 16 : 0);
}

// 2^x by the SFU (ex2.approx.ftz: ~2 ulp; 2^-inf = +0, which the masking relies on).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMmaBM = 64, kMmaBN = 64, kMmaThreads = 128;

struct MmaArgs {
  const __nv_bfloat16* q;
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const int32_t* cu;
  __nv_bfloat16* o;
  int64_t ldo, L;
  int hd;
  float scale_log2;
};

template <int W>
struct MmaSmem {
  static constexpr int LD = W + 8;  // padded row length in bf16
  static constexpr int kTile = 64 * LD;
  static constexpr size_t bytes = size_t(5 * kTile) * 2;  // Q, two K stages, two V stages
};

template <int W>
__global__ void __launch_bounds__(kMmaThreads, 2) attn_mma_kernel(const MmaArgs a) {
  using S = MmaSmem<W>;
  constexpr int KK = W / 16, DP = W / 16, CH = W / 8;  // k16 chunks of q·k, 16-wide pairs of v, 16-byte row pieces
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  __nv_bfloat16* sK = sQ + S::kTile;
  __nv_bfloat16* sV = sK + 2 * S::kTile;

  const int item = blockIdx.z, h = blockIdx.y;
  const int base = a.cu[item], len = a.cu[item + 1] - base;
  const int m0 = int(blockIdx.x) * kMmaBM;
  if (m0 >= len) return;  // the whole CTA, before any barrier
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int n_tiles = (len + kMmaBN - 1) / kMmaBN;
  const int64_t row0 = int64_t(h) * a.L + base;  // the item's first row in this head's packed rows
  const __nv_bfloat16* qg = a.q + row0 * W;
  const __nv_bfloat16* kg = a.k + row0 * W;
  const __nv_bfloat16* vg = a.v + row0 * W;

  // One 64-row tile: rows past the item's end are zero-filled (finite, and masked or discarded).
  auto load_rows = [&](__nv_bfloat16* dst, const __nv_bfloat16* src, int first) {
    for (int idx = tid; idx < 64 * CH; idx += kMmaThreads) {
      const int r = idx / CH, c = idx % CH;
      const bool ok = first + r < len;
      const __nv_bfloat16* s = ok ? src + int64_t(first + r) * W + c * 8 : src;
      cp_async16(ptx::smem_u32(dst + r * S::LD + c * 8), s, ok);
    }
  };
  auto load_kv = [&](int tile, int stage) {
    load_rows(sK + stage * S::kTile, kg, tile * kMmaBN);
    load_rows(sV + stage * S::kTile, vg, tile * kMmaBN);
  };
  load_rows(sQ, qg, m0);
  load_kv(0, 0);
  ptx::cp_async_commit();

  uint32_t qf[KK][4];
  float o[2 * DP][4];
#pragma unroll
  for (int j = 0; j < 2 * DP; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    ptx::cp_async_wait<0>();
    __syncthreads();  // this tile's K/V (and Q) visible to all; everyone done with the other stage
    if (tile + 1 < n_tiles) load_kv(tile + 1, stage ^ 1);
    ptx::cp_async_commit();
    if (tile == 0) {
#pragma unroll
      for (int kk = 0; kk < KK; ++kk)
        ptx::ldmatrix_x4(qf[kk], ptx::smem_u32(sQ + (warp * 16 + (lane & 15)) * S::LD + kk * 16 + (lane >> 4) * 8));
    }

    // S = Q Kᵀ for this warp's 16 rows x 64 keys.
    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    const __nv_bfloat16* k_st = sK + stage * S::kTile;
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bf[4];
        ptx::ldmatrix_x4(bf, ptx::smem_u32(k_st + (np * 16 + (lane & 7) + ((lane >> 4) << 3)) * S::LD + kk * 16 +
                                           ((lane >> 3) & 1) * 8));
        ptx::mma_bf16_16816(s[2 * np], qf[kk], bf[0], bf[1]);
        ptx::mma_bf16_16816(s[2 * np + 1], qf[kk], bf[2], bf[3]);
      }
    }

    // Scale into the log2 domain; keys past the item's end masked by selection.
    const int key0 = tile * kMmaBN;
    const bool need_mask = key0 + kMmaBN > len;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * a.scale_log2;
        if (need_mask && key0 + j * 8 + 2 * t + (e & 1) >= len) x = -INFINITY;
        s[j][e] = x;
      }
    }
    // Online softmax: new running max, rescale of O and l, probabilities.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      mx = ptx::quad_max(mx);
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

    // O += P V: P from registers (bf16), Vᵀ fragments by ldmatrix.trans.
    const __nv_bfloat16* v_st = sV + stage * S::kTile;
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      uint32_t pa[4];
      pa[0] = ptx::pack_bf16x2(s[2 * kc][0], s[2 * kc][1]);
      pa[1] = ptx::pack_bf16x2(s[2 * kc][2], s[2 * kc][3]);
      pa[2] = ptx::pack_bf16x2(s[2 * kc + 1][0], s[2 * kc + 1][1]);
      pa[3] = ptx::pack_bf16x2(s[2 * kc + 1][2], s[2 * kc + 1][3]);
#pragma unroll
      for (int dp = 0; dp < DP; ++dp) {
        uint32_t bf[4];
        ptx::ldmatrix_x4_trans(bf, ptx::smem_u32(v_st + (kc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S::LD +
                                                 dp * 16 + (lane >> 4) * 8));
        ptx::mma_bf16_16816(o[2 * dp], pa, bf[0], bf[1]);
        ptx::mma_bf16_16816(o[2 * dp + 1], pa, bf[2], bf[3]);
      }
    }
  }

  // Epilogue: O / l for the rows of the item, the head's hd columns.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = ptx::quad_sum(l_r[r]);
    const int i = m0 + warp * 16 + g + 8 * r;
    if (i >= len) continue;
    __nv_bfloat16* orow = a.o + (int64_t(base) + i) * a.ldo + int64_t(h) * a.hd;
#pragma unroll
    for (int j = 0; j < 2 * DP; ++j) {
      const int col = j * 8 + 2 * t;
      if (col >= a.hd) continue;
      *reinterpret_cast<uint32_t*>(orow + col) = ptx::pack_bf16x2(o[j][2 * r] / l, o[j][2 * r + 1] / l);
    }
  }
}

template <int W>
void launch_mma(const MmaArgs& a, int64_t heads, int64_t items, int64_t max_len) {
  constexpr size_t smem = MmaSmem<W>::bytes;
  static bool configured = false;  // once per instantiation (one device)
  if (!configured) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(attn_mma_kernel<W>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    configured = true;
  }
  const dim3 grid(unsigned((max_len + kMmaBM - 1) / kMmaBM), unsigned(heads), unsigned(items));
  attn_mma_kernel<W><<<grid, kMmaThreads, smem>>>(a);
  K3_CUDA_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------------------------------
// Attention, wgmma (FlashAttention-3's structure without ping-pong scheduling). See the file comment.
// Shared layouts (1024-byte aligned): a Q, K or V tile is 2 boxes [128 rows][64 columns] (16 KB each, row r at
// r·128 B, 16-byte chunk c at c ^ (r & 7)): Q and K are K-major operands (SBO 1024 B, the k16 slice w of a box
// 32·w bytes in); V is read MN-major (64-column atoms 16 KB apart (LBO), 8-key groups 1024 B apart (SBO), the
// k16 slice of keys kk 2048·kk bytes in).

namespace wg {

constexpr int kBM = 128, kBN = 128;                // queries per CTA (two consumer warpgroups of 64), keys a tile
constexpr int kW = 128;                            // the packed head width this kernel takes
constexpr int kBoxBytes = 128 * 128;               // one box: 128 rows x 64 bf16
constexpr int kTileBytes = (kW / 64) * kBoxBytes;  // a Q, K or V tile: 32 KB
constexpr int kStages = 2;
constexpr int kThreads = 384;                           // consumers 0, 1; producer 2
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // 2·128·224 + 128·56 = 168·384, the launch's
constexpr size_t kSmemBytes = size_t(kTileBytes) + kStages * size_t(2 * kTileBytes) + 1024 + 64;

struct Args {
  const int32_t* cu;
  __nv_bfloat16* o;
  int64_t ldo;
  int hd;
  float scale_log2;
};

__global__ void __launch_bounds__(kThreads, 1)
    attn_wgmma_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                      const __grid_constant__ CUtensorMap mv, const Args a) {
  extern __shared__ unsigned char smem_raw[];
  const int b = blockIdx.z, h = blockIdx.y;
  const int base = a.cu[b];
  const int len = a.cu[b + 1] - base;
  const int m0 = int(blockIdx.x) * kBM;
  if (m0 >= len) return;  // the whole CTA, before any barrier
  const uint32_t sQ = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = sQ + kTileBytes, sV = sK + kStages * kTileBytes;
  const uint32_t qbar = sV + kStages * kTileBytes, full = qbar + 8, empty = full + 8 * kStages;
  const int tiles = (len + kBN - 1) / kBN;
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
    ptx::mbar_arrive_expect_tx(qbar, kTileBytes);
    for (int blk = 0; blk < kW / 64; ++blk) ptx::tma_load_3d(sQ + blk * kBoxBytes, &mq, qbar, 64 * blk, base + m0, h);
    for (int it = 0; it < tiles; ++it) {
      const int s = it & (kStages - 1);
      ptx::wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
      const uint32_t bar = full + 8 * s;
      ptx::mbar_arrive_expect_tx(bar, 2 * kTileBytes);
      for (int blk = 0; blk < kW / 64; ++blk) {
        ptx::tma_load_3d(sK + s * kTileBytes + blk * kBoxBytes, &mk, bar, 64 * blk, base + it * kBN, h);
        ptx::tma_load_3d(sV + s * kTileBytes + blk * kBoxBytes, &mv, bar, 64 * blk, base + it * kBN, h);
      }
    }
    return;
  }

  // ---- consumers ----
  ptx::setmaxnreg_inc<kConsumerRegs>();
  const int wgi = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int wq0 = m0 + 64 * wgi;         // the warpgroup's first query
  const bool active = wq0 < len;         // warpgroup-uniform
  const int row0 = wq0 + 16 * warp + g;  // this thread's queries row0 and row0 + 8
  float oacc[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) oacc[i] = 0.0f;
  // Rows row0, row0 + 8: running max (log2 units of the scaled scores), this thread's partial sum of the
  // probabilities (its 32 columns of every tile; the quad's sum at the end).
  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.0f, 0.0f};
  ptx::wait_or_trap(qbar, 0);

  for (int it = 0; it < tiles; ++it) {
    const int s = it & (kStages - 1), n0 = it * kBN;
    ptx::wait_or_trap(full + 8 * s, (it / kStages) & 1);
    if (active) {
      float sacc[64];
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kW / 16; ++kk) {
        const int blk = kk >> 2, w = kk & 3;
        const uint64_t da = ptx::desc_k_sw128(sQ + blk * kBoxBytes + wgi * 64 * 128) + 2 * w;
        const uint64_t db = ptx::desc_k_sw128(sK + s * kTileBytes + blk * kBoxBytes) + 2 * w;
        ptx::wgmma_m64n128k16_bf16_ss<0, 0>(sacc, da, db, kk > 0);
      }
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(sacc);

      // Online softmax; sacc[4j + e] is (query row0 + 8(e/2), key n0 + 8j + 2t4 + e%2). Masked: -inf.
      const bool unmasked = n0 + kBN <= len;
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = sacc[4 * j + e] * a.scale_log2;
          if (!unmasked) x = n0 + 8 * j + 2 * t4 + (e & 1) < len ? x : -INFINITY;
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
        // n8 blocks 2c and 2c + 1 are the A fragment of the 16-key slice c: (a0, a1) from 2c, (a2, a3) from 2c + 1
        pa[j >> 1][2 * (j & 1)] = ptx::pack_bf16x2(p[0], p[1]);
        pa[j >> 1][2 * (j & 1) + 1] = ptx::pack_bf16x2(p[2], p[3]);
      }
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        oacc[4 * j] *= alpha[0], oacc[4 * j + 1] *= alpha[0];
        oacc[4 * j + 2] *= alpha[1], oacc[4 * j + 3] *= alpha[1];
      }
      ptx::wgmma_fence();
      // All 8 slices, also those past the item's end on its last tile (their P is 0): a data-dependent exit
      // from this loop is a divergent path to ptxas, which then serialises the wgmmas (its warning C7520).
#pragma unroll
      for (int c = 0; c < kBN / 16; ++c)
        ptx::wgmma_m64n128k16_bf16_rs<1>(oacc, pa[c], ptx::desc_mn_sw128(sV + s * kTileBytes + c * 2048, kBoxBytes), 1);
      ptx::wgmma_commit();
      ptx::wgmma_wait<0>();
      ptx::fence_regs(oacc);
    }
    if (lane == 0) ptx::mbar_arrive(empty + 8 * s);
  }
  if (!active) return;

    // o = O / l for the rows of the item (l >= 1: its largest term is 2^0), the head's hd columns.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = ptx::quad_sum(l_r[r]);
    const int row = row0 + 8 * r;
    if (row >= len) continue;
    __nv_bfloat16* orow = a.o + (int64_t(base) + row) * a.ldo + int64_t(h) * a.hd;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = 8 * j + 2 * t4;
      if (col < a.hd)
        *reinterpret_cast<uint32_t*>(orow + col) =
            ptx::pack_bf16x2(oacc[4 * j + 2 * r] / l, oacc[4 * j + 2 * r + 1] / l);
    }
  }
}

void launch(const AttentionParams& p) {
  const uint64_t L = uint64_t(p.L), H = uint64_t(p.heads), row_bytes = uint64_t(kW) * 2;
  const CUtensorMap mq = cuda_tma::bf16_3d_sw128(p.q, kW, L, H, row_bytes, L * row_bytes, 64, kBN,
                                                 "the vision attention's packed queries");
  const CUtensorMap mk =
      cuda_tma::bf16_3d_sw128(p.k, kW, L, H, row_bytes, L * row_bytes, 64, kBN, "the vision attention's packed keys");
  const CUtensorMap mv =
      cuda_tma::bf16_3d_sw128(p.v, kW, L, H, row_bytes, L * row_bytes, 64, kBN, "the vision attention's packed values");
  static bool configured = false;  // once (one device)
  if (!configured) {
    K3_CUDA_CHECK(
        cudaFuncSetAttribute(attn_wgmma_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
    configured = true;
  }
  Args a{};
  a.cu = p.cu_seqlens;
  a.o = reinterpret_cast<__nv_bfloat16*>(p.o);
  a.ldo = p.ldo;
  a.hd = int(p.hd);
  a.scale_log2 = float(double(kLog2e) / std::sqrt(double(p.hd)));
  const dim3 grid(unsigned((p.max_len + kBM - 1) / kBM), unsigned(p.heads), unsigned(p.items));
  attn_wgmma_kernel<<<grid, kThreads, kSmemBytes>>>(mq, mk, mv, a);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace wg

// ---------------------------------------------------------------------------------------------------------------
// Host side.

std::string misaligned(const char* name, const void* p, size_t align) {
  if (p == nullptr) return std::string(name) + " is null";
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    return std::string(name) + " is not " + std::to_string(align) + "-byte aligned";
  return "";
}

unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + kEltThreads - 1) / kEltThreads, 1 << 20)); }

}  // namespace

std::string can_run(const PositionParams& p) {
  if (p.H0 <= 0 || p.W0 <= 0 || p.D <= 0 || p.H0 * p.W0 * p.D > INT64_C(1) << 40)
    return "the position table [" + std::to_string(p.H0) + ", " + std::to_string(p.W0) + ", " + std::to_string(p.D) +
           "] must be non-empty";
  if (p.t < 1 || p.h < 1 || p.w < 1 || p.h > INT_MAX / 2 || p.w > INT_MAX / 2 || p.t > INT_MAX / 2)
    return "the grid (t, h, w) = (" + std::to_string(p.t) + ", " + std::to_string(p.h) + ", " + std::to_string(p.w) +
           ") must be positive";
  if (p.H0 > INT_MAX / 2 || p.W0 > INT_MAX / 2) return "the position table is too large";
  if (!p.x || !p.table) return "x or table is null";
  return "";
}

void add_position_embedding(const PositionParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("vision add_position_embedding (cuda): ", why);
  position_kernel<<<grid_for(p.h * p.w * p.D), kEltThreads>>>(p.x, p.table, int(p.H0), int(p.W0), p.D, int(p.t),
                                                              int(p.h), int(p.w), p.time);
  K3_CUDA_LAUNCH_CHECK();
}

std::string can_run(const RopePackParams& p) {
  if (p.L < 0 || p.heads <= 0) return "L = " + std::to_string(p.L) + ", heads = " + std::to_string(p.heads);
  if (p.hd <= 0 || p.hd % 4 != 0 || packed_width(p.hd) == 0)
    return "the head dim " + std::to_string(p.hd) + " must be a multiple of 4 in [4, 128]";
  if (p.ld < 3 * p.heads * p.hd || p.ld % 4 != 0)
    return "ld = " + std::to_string(p.ld) +
           " must be a multiple of 4 and at least 3 heads hd = " + std::to_string(3 * p.heads * p.hd);
  if (p.positions <= 0) return "positions = " + std::to_string(p.positions) + " must be positive";
  if (p.L == 0) return "";
  for (const auto& [name, ptr, align] : {std::tuple<const char*, const void*, size_t>{"qkv", p.qkv, 16},
                                         {"rows", p.rows, 4},
                                         {"cols", p.cols, 4},
                                         {"table", p.table, 4},
                                         {"q", p.q, 8},
                                         {"k", p.k, 8},
                                         {"v", p.v, 8}}) {
    const std::string e = misaligned(name, ptr, align);
    if (!e.empty()) return e;
  }
  return "";
}

void rope_pack(const RopePackParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("vision rope_pack (cuda): ", why);
  if (p.L == 0) return;
  RopeArgs a{};
  a.qkv = p.qkv;
  a.ld = p.ld;
  a.L = p.L;
  a.heads = p.heads;
  a.hd = p.hd;
  a.W = packed_width(p.hd);
  a.positions = p.positions;
  a.rows = p.rows;
  a.cols = p.cols;
  a.table = p.table;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  rope_pack_kernel<<<grid_for(p.heads * p.L * a.W / 4), kEltThreads>>>(a);
  K3_CUDA_LAUNCH_CHECK();
}

std::string can_run(const AttentionParams& p) {
  if (p.heads <= 0 || p.heads > 65535) return "heads = " + std::to_string(p.heads) + ": must be in 1..65535";
  if (p.hd <= 0 || p.hd % 4 != 0 || packed_width(p.hd) == 0)
    return "the head dim " + std::to_string(p.hd) + " must be a multiple of 4 in [4, 128]";
  if (p.items <= 0 || p.items > 65535) return "items = " + std::to_string(p.items) + ": must be in 1..65535";
  if (p.L < 0 || p.L > INT_MAX / 2) return "L = " + std::to_string(p.L) + ": must be in [0, 2^30)";
  if (p.max_len < 0 || p.max_len > p.L)
    return "max_len = " + std::to_string(p.max_len) + ": must be in [0, L = " + std::to_string(p.L) + "]";
  if (p.ldo < p.heads * p.hd || p.ldo % 2 != 0)
    return "ldo = " + std::to_string(p.ldo) +
           ": must be even and at least heads hd = " + std::to_string(p.heads * p.hd);
  if (p.kernel == AttnKernel::kWgmma && packed_width(p.hd) != wg::kW)
    return "the wgmma kernel takes head dims 65..128 (packed width 128), not " + std::to_string(p.hd);
  if (p.L == 0) return "";
  for (const auto& [name, ptr, align] : {std::tuple<const char*, const void*, size_t>{"q", p.q, 16},
                                         {"k", p.k, 16},
                                         {"v", p.v, 16},
                                         {"o", p.o, 4},
                                         {"cu_seqlens", p.cu_seqlens, 4}}) {
    const std::string e = misaligned(name, ptr, align);
    if (!e.empty()) return e;
  }
  return "";
}

void attention(const AttentionParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("vision attention (cuda): ", why);
  if (p.L == 0 || p.max_len == 0) return;
  const int64_t W = packed_width(p.hd);
  const bool use_wgmma = p.kernel == AttnKernel::kWgmma || (p.kernel == AttnKernel::kAuto && W == wg::kW);
  if (use_wgmma) {
    wg::launch(p);
    return;
  }
  MmaArgs a{};
  a.q = reinterpret_cast<const __nv_bfloat16*>(p.q);
  a.k = reinterpret_cast<const __nv_bfloat16*>(p.k);
  a.v = reinterpret_cast<const __nv_bfloat16*>(p.v);
  a.cu = p.cu_seqlens;
  a.o = reinterpret_cast<__nv_bfloat16*>(p.o);
  a.ldo = p.ldo;
  a.L = p.L;
  a.hd = int(p.hd);
  a.scale_log2 = float(double(kLog2e) / std::sqrt(double(p.hd)));
  if (W == 32) launch_mma<32>(a, p.heads, p.items, p.max_len);
  else if (W == 64) launch_mma<64>(a, p.heads, p.items, p.max_len);
  else launch_mma<128>(a, p.heads, p.items, p.max_len);
}

void gelu_to_bf16(uint16_t* y, const float* x, int64_t n, Gelu form) {
  K3_CHECK(n >= 0, "vision gelu_to_bf16 (cuda): negative length ", n);
  if (n == 0) return;
  if (form == Gelu::kTanh) gelu_kernel<0><<<grid_for(n), kEltThreads>>>(y, x, n);
  else gelu_kernel<1><<<grid_for(n), kEltThreads>>>(y, x, n);
  K3_CUDA_LAUNCH_CHECK();
}

std::string can_run(const MergeParams& p) {
  if (p.mh < 1 || p.mw < 1) return "the merge kernel must be positive";
  if (p.t < 1 || p.h < p.mh || p.w < p.mw || p.h % p.mh != 0 || p.w % p.mw != 0 || p.h > INT_MAX / 2 ||
      p.w > INT_MAX / 2 || p.t > INT_MAX / 2)
    return "the grid (t, h, w) = (" + std::to_string(p.t) + ", " + std::to_string(p.h) + ", " + std::to_string(p.w) +
           ") must be positive with h, w multiples of the merge kernel (" + std::to_string(p.mh) + ", " +
           std::to_string(p.mw) + ")";
  if (p.D <= 0) return "D = " + std::to_string(p.D) + " must be positive";
  if (!p.out_f32 || !p.x) return "out_f32 or x is null";
  return "";
}

void merge_tpool(const MergeParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail("vision merge_tpool (cuda): ", why);
  merge_kernel<<<grid_for(p.h * p.w * p.D), kEltThreads>>>(p.out_f32, p.out_bf16, p.x, int(p.t), int(p.h), int(p.w),
                                                           p.D, int(p.mh), int(p.mw));
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::vision::cuda
