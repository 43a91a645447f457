// The routed experts' grouped GEMMs for training (expert_gemm_train_cuda.h): one templated mma.sync
// kernel, three operand layouts.
//
// Each mode is a GEMM C[m, n] = Σ_k A[m, k] B[k, n] per expert, with the tile's operands staged in
// shared memory in the layout they have in global memory (16-byte cp.async chunks, never a transpose
// in registers) and fragments read with ldmatrix (k-contiguous tiles) or ldmatrix.trans (m/n-contiguous):
//   mode            C (rows m × cols n)        A[m, k]             B[k, n]            K
//   Forward         y rows of e  × out         x[r, k]  k-contig   W_e[n, k] k-contig  in
//   BackwardData    dx rows of e × in          dy[r, k] k-contig   W_e[k, n] n-contig  out
//   BackwardWeight  dW_e: out    × in          dy[k, m] m-contig   x[k, n]   n-contig  rows of e
// (r, and k in BackwardWeight, are the expert's sorted rows.)
//
// Tiles: a CTA of 128 threads (4 warps, 2 along m × 2 along n) computes a BM × 128 tile (BM = 128);
// each warp a 64 × 64 sub-tile, 32 m16n8 accumulator blocks (128 fp32 registers; ~230 registers a
// thread, 2 CTAs per SM), k in stages of BK = 32 through a 4-deep cp.async pipeline (20 KB a stage).
// The 64 × 64 warp tile issues 8 ldmatrix.x4 per 32 MMAs (a 64 × 32 one: 6 per 16): by our estimate,
// not a measurement, shared-memory bandwidth rather than the tensor cores bounds an mma.sync GEMM on
// Hopper, so the wider warp tile pays. Shared rows are padded by 16 bytes (80 B rows for a k-contiguous
// 32-wide tile, 272 B for a 128-wide m/n-contiguous one), so the 8 row addresses of every ldmatrix
// phase fall in 8 different 16-byte bank groups: conflict-free without a swizzle.
//
// Masking: every element outside the expert's rows, past out / in, or past K is zero-filled by
// cp.async (src-size 0: nothing is read), so it adds exact zeros; rows and columns outside the tile's
// valid region are never stored. In Forward / BackwardData a warp whose m16 blocks hold no valid row
// (an expert's last, partial tile) skips their MMAs, which changes no stored value.
//
// Scheduling, without a host round trip:
//   - Forward / BackwardData: tile_prefix_kernel turns the offsets into tiles[e] = Σ_{e' < e}
//     ceil(n_e' / BM) (tiles[E] = the total). The 1-D grid holds the upper bound (ceil(S / BM) + E) ×
//     column tiles, column tile fastest (the CTAs of one row tile run side by side and share its A rows
//     through L2). A CTA's row slot q names the expert e with tiles[e] <= q < tiles[e + 1], found as
//     #{i : tiles[i] <= q} - 1: the CTA reads tiles[] once (coalesced, independent loads; E = 192:
//     two a thread) and sums the counts; q >= tiles[E] exits.
//   - BackwardWeight: the grid is E × (out tiles) × (in tiles), in-tile fastest; CTAs of an expert with
//     no rows exit (dW_e untouched). The expert's rows are the reduction, zero-padded to BK.
// Each output element is owned by one CTA and summed in ascending k: deterministic, no atomics.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/moe/expert_gemm_train_cuda.h"

namespace k3::moe::cuda {
namespace {

using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::smem_u32;

constexpr int kWarpsM = 2, kWarpsN = 2;  // warps along m and n
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kBN = 128, kBK = 32, kStages = 4;
constexpr int kPad = 8;  // bf16 elements of padding per shared row (16 bytes)
constexpr int kBM = 128;
constexpr int kPrefixThreads = 1024;

enum class Mode { Forward, BackwardData, BackwardWeight };

// Shared-memory geometry of one mode. A k-major tile is [R][BK + pad] (k contiguous); an m/n-major
// one [BK][R + pad].
template <Mode M, int BM>
struct Geo {
  static constexpr bool a_kmajor = M != Mode::BackwardWeight;
  static constexpr bool b_kmajor = M == Mode::Forward;
  static constexpr int a_ld = a_kmajor ? kBK + kPad : BM + kPad;  // elements per shared row
  static constexpr int b_ld = b_kmajor ? kBK + kPad : kBN + kPad;
  static constexpr int a_elems = a_kmajor ? BM * a_ld : kBK * a_ld;  // one stage
  static constexpr int b_elems = b_kmajor ? kBN * b_ld : kBK * b_ld;
  static constexpr int stage_elems = a_elems + b_elems;
  static constexpr size_t smem_bytes = size_t(kStages) * stage_elems * 2;
};

struct Args {
  float* c;                // Forward: y; BackwardData: dx; BackwardWeight: dW
  const uint16_t* a;       // Forward: x; else dy
  const uint16_t* b;       // Forward, BackwardData: W; BackwardWeight: x
  const int32_t* offsets;  // [E + 1]
  const int32_t* tiles;    // [E + 1] row-tile prefix (Forward, BackwardData)
  // Per-expert pointers instead of a stacked buffer (null: stacked): W_e (Forward, BackwardData) and
  // dW_e (BackwardWeight).
  const uint16_t* const* b_tab;
  float* const* c_tab;
  int E, out, in;
  int n_tiles;  // column tiles of C
  int m_tiles;  // BackwardWeight: row tiles of C (out / BM)
  bool accumulate;
};

// tiles[e] = Σ_{e' < e} ceil(n_e' / BM) for e <= E. One CTA: each thread sums a contiguous run of
// experts, an inclusive scan over the threads' sums in shared memory, then each thread writes its run.
__global__ void __launch_bounds__(kPrefixThreads)
    tile_prefix_kernel(int32_t* __restrict__ tiles, const int32_t* __restrict__ offsets, int E, int BM) {
  __shared__ int32_t part[kPrefixThreads];
  const int tid = threadIdx.x;
  const int per = (E + kPrefixThreads - 1) / kPrefixThreads;
  const int e0 = min(E, tid * per), e1 = min(E, e0 + per);
  int32_t s = 0;
  for (int e = e0; e < e1; ++e) s += (offsets[e + 1] - offsets[e] + BM - 1) / BM;
  part[tid] = s;
  __syncthreads();
  for (int o = 1; o < kPrefixThreads; o <<= 1) {
    const int32_t v = tid >= o ? part[tid - o] : 0;
    __syncthreads();
    part[tid] += v;
    __syncthreads();
  }
  int32_t run = part[tid] - s;  // exclusive prefix of this thread's run
  for (int e = e0; e < e1; ++e) {
    tiles[e] = run;
    run += (offsets[e + 1] - offsets[e] + BM - 1) / BM;
  }
  if (tid == kPrefixThreads - 1) tiles[E] = part[tid];
}

// One stage of a tile into shared memory (dst: smem_u32 of the stage's tile). R = the tile's m (or n)
// extent. k-major: R rows of BK; element (r, k) at g + r·ld + k0 + k, valid when r < valid_r and
// k0 + k < K. m/n-major: BK rows of R; element (k, r) at g + (k0 + k)·ld + r, same validity. K and
// valid_r move in whole 8-element chunks (out, in are multiples of 8), so a chunk is all in or all out.
template <bool KMajor, int R, int LD>
__device__ __forceinline__ void load_tile(uint32_t dst, const uint16_t* __restrict__ g, int64_t ld, int k0, int K,
                                          int valid_r, int tid) {
  constexpr int kChunks = R * kBK / 8;
  static_assert(kChunks % kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kChunks / kThreads; ++i) {
    const int c = tid + i * kThreads;
    int r, k;
    if (KMajor) {
      r = c / (kBK / 8);
      k = (c % (kBK / 8)) * 8;
    } else {
      k = c / (R / 8);
      r = (c % (R / 8)) * 8;
    }
    const bool ok = r < valid_r && k0 + k < K;
    const uint16_t* src = ok ? (KMajor ? g + int64_t(r) * ld + (k0 + k) : g + int64_t(k0 + k) * ld + r) : g;
    const uint32_t off = KMajor ? uint32_t(r * LD + k) : uint32_t(k * LD + r);
    ptx::cp_async16(dst + off * 2, src, ok ? 16 : 0);
  }
}

// The MMAs of one BK stage for one warp: its (MI·16) × (NI·8) sub-tile at rows m_w, columns n_w of the
// block tile. Guard: only m16 blocks mi < mact (warp-uniform) run.
template <Mode M, int BM, int MI, int NI, bool Guard>
__device__ __forceinline__ void mma_stage(float (&acc)[MI][NI][4], uint32_t sa, uint32_t sb, int m_w, int n_w, int lane,
                                          int mact) {
  using G = Geo<M, BM>;
#pragma unroll
  for (int ks = 0; ks < kBK / 16; ++ks) {
    uint32_t af[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      if (Guard && mi >= mact) continue;
      if (G::a_kmajor) {
        // matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3
        const int r = m_w + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int k = ks * 16 + (lane >> 4) * 8;
        ldmatrix_x4(af[mi], sa + uint32_t(r * G::a_ld + k) * 2);
      } else {
        // stored [k][m]: lane gives row k, the 8 m of one matrix; .trans hands thread t (m = t/4,
        // k = 2(t%4), +1), the row-major fragment. Same matrix order as above.
        const int k = ks * 16 + (lane & 7) + (lane >> 4) * 8;
        const int m = m_w + mi * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4_trans(af[mi], sa + uint32_t(k * G::a_ld + m) * 2);
      }
    }
#pragma unroll
    for (int nj = 0; nj < NI / 2; ++nj) {
      // t4[0], t4[1] = b0, b1 of n8 block 2nj; t4[2], t4[3] = those of 2nj + 1
      uint32_t t4[4];
      if (G::b_kmajor) {
        const int n = n_w + nj * 16 + (lane & 7) + (lane >> 4) * 8;
        const int k = ks * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(t4, sb + uint32_t(n * G::b_ld + k) * 2);
      } else {
        const int k = ks * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int n = n_w + nj * 16 + (lane >> 4) * 8;
        ldmatrix_x4_trans(t4, sb + uint32_t(k * G::b_ld + n) * 2);
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        if (Guard && mi >= mact) continue;
        ptx::mma_bf16_16816(acc[mi][2 * nj], af[mi], t4[0], t4[1]);
        ptx::mma_bf16_16816(acc[mi][2 * nj + 1], af[mi], t4[2], t4[3]);
      }
    }
  }
}

template <Mode M, int BM>
__global__ void __launch_bounds__(kThreads, 2) grouped_linear_kernel(const Args p) {
  using G = Geo<M, BM>;
  constexpr int WM = BM / kWarpsM, WN = kBN / kWarpsN;  // warp tile
  constexpr int MI = WM / 16, NI = WN / 8;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // ---- which tile: expert e, C rows [m0, m0 + valid_m), columns [n0, n0 + valid_n), reduction K
  int e, m0, nt, valid_m, K, r0;
  if (M == Mode::BackwardWeight) {
    const int b = int(blockIdx.x);
    nt = b % p.n_tiles;
    const int t = b / p.n_tiles;
    const int mt = t % p.m_tiles;
    e = t / p.m_tiles;
    r0 = p.offsets[e];
    K = p.offsets[e + 1] - r0;  // the expert's rows
    if (K <= 0) return;         // no rows: dW_e untouched
    m0 = mt * BM;
    valid_m = min(BM, p.out - m0);
  } else {
    const int b = int(blockIdx.x);
    const int q = b / p.n_tiles;  // row-tile slot
    nt = b - q * p.n_tiles;
    // e + 1 = #{i in [0, E] : tiles[i] <= q} (tiles[0] = 0 <= q; nondecreasing). E + 1: past the end.
    // Strided independent loads (one round trip), then a block sum.
    int cnt = 0;
    for (int i = tid; i <= p.E; i += kThreads) cnt += p.tiles[i] <= q ? 1 : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    __shared__ int red[kThreads / 32];
    if (lane == 0) red[warp] = cnt;
    __syncthreads();
    cnt = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) cnt += red[w];
    if (cnt > p.E) return;
    e = cnt - 1;
    r0 = p.offsets[e];
    const int n_e = p.offsets[e + 1] - r0;
    m0 = (q - p.tiles[e]) * BM;
    valid_m = min(BM, n_e - m0);
    K = M == Mode::Forward ? p.in : p.out;
  }
  const int N = M == Mode::BackwardData || M == Mode::BackwardWeight ? p.in : p.out;
  const int n0 = nt * kBN;
  const int valid_n = min(kBN, N - n0);

  // ---- global bases of the tile's operands and output
  const int64_t wsz = int64_t(p.out) * p.in;
  const uint16_t *ga, *gb;
  int64_t lda, ldb, ldc;
  float* gc;
  if (M == Mode::Forward) {
    ga = p.a + int64_t(r0 + m0) * p.in, lda = p.in;       // x rows, k contiguous
    gb = (p.b_tab ? p.b_tab[e] : p.b + e * wsz) + int64_t(n0) * p.in, ldb = p.in;  // W_e rows n, k contiguous
    gc = p.c + int64_t(r0 + m0) * p.out + n0, ldc = p.out;
  } else if (M == Mode::BackwardData) {
    ga = p.a + int64_t(r0 + m0) * p.out, lda = p.out;  // dy rows, k contiguous
    gb = (p.b_tab ? p.b_tab[e] : p.b + e * wsz) + n0, ldb = p.in;  // W_e rows k, n contiguous
    gc = p.c + int64_t(r0 + m0) * p.in + n0, ldc = p.in;
  } else {
    ga = p.a + int64_t(r0) * p.out + m0, lda = p.out;  // dy rows k, m contiguous
    gb = p.b + int64_t(r0) * p.in + n0, ldb = p.in;    // x rows k, n contiguous
    gc = (p.c_tab ? p.c_tab[e] : p.c + e * wsz) + int64_t(m0) * p.in + n0, ldc = p.in;
  }

  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t s0 = smem_u32(smem);
  auto stage_a = [&](int s) { return s0 + uint32_t(s * G::stage_elems) * 2; };
  auto stage_b = [&](int s) { return s0 + uint32_t(s * G::stage_elems + G::a_elems) * 2; };
  auto load_stage = [&](int s, int kt) {
    const int k0 = kt * kBK;
    load_tile<G::a_kmajor, BM, G::a_ld>(stage_a(s), ga, lda, k0, K, valid_m, tid);
    load_tile<G::b_kmajor, kBN, G::b_ld>(stage_b(s), gb, ldb, k0, K, valid_n, tid);
  };

  const int wm = warp / kWarpsN, wn = warp % kWarpsN;
  const int m_w = wm * WM, n_w = wn * WN;
  // m16 blocks of this warp holding a valid row (warp-uniform)
  const int mact = min(MI, max(0, (valid_m - m_w + 15) / 16));

  float acc[MI][NI][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[mi][ni][j] = 0.0f;

  const int KT = (K + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();  // stage kt has landed (this thread's copies)
    __syncthreads();               // ... everyone's; and stage kt - 1 is no longer read
    const int nk = kt + kStages - 1;
    if (nk < KT) load_stage(nk % kStages, nk);
    cp_async_commit();
    const int s = kt % kStages;
    if (mact == MI) mma_stage<M, BM, MI, NI, false>(acc, stage_a(s), stage_b(s), m_w, n_w, lane, mact);
    else if (mact > 0) mma_stage<M, BM, MI, NI, true>(acc, stage_a(s), stage_b(s), m_w, n_w, lane, mact);
  }
  cp_async_wait<0>();  // nothing left in flight when the CTA exits

  // ---- epilogue: c0, c1 at (row g, cols 2t, 2t + 1); c2, c3 at row g + 8 of each m16 × n8 block
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int col = n_w + ni * 8 + 2 * t;
      if (col >= valid_n) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m_w + mi * 16 + g + h * 8;
        if (row >= valid_m) continue;
        float2* dst = reinterpret_cast<float2*>(gc + int64_t(row) * ldc + col);
        float2 v = make_float2(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
        if (M == Mode::BackwardWeight || p.accumulate) {
          const float2 o = *dst;
          v.x += o.x;
          v.y += o.y;
        }
        *dst = v;
      }
    }
  }
}

bool aligned(const void* ptr, uintptr_t a) { return (reinterpret_cast<uintptr_t>(ptr) & (a - 1)) == 0; }

void check_args(const char* fn, const void* c, const void* a, const void* b, const int32_t* offsets, int64_t S,
                int64_t E, int64_t out, int64_t in) {
  K3_CHECK(E >= 1 && E <= INT_MAX, "moe::cuda::", fn, ": E must be in [1, 2^31), got ", E);
  K3_CHECK(S >= 0 && S <= INT_MAX, "moe::cuda::", fn, ": S (sorted rows) must be in [0, 2^31), got ", S);
  K3_CHECK(out > 0 && out % 8 == 0 && out <= INT_MAX, "moe::cuda::", fn, ": out must be a positive multiple of 8, got ",
           out);
  K3_CHECK(in > 0 && in % 8 == 0 && in <= INT_MAX, "moe::cuda::", fn, ": in must be a positive multiple of 8, got ",
           in);
  K3_CHECK(offsets, "moe::cuda::", fn, ": offsets is null");
  K3_CHECK(c && a && b, "moe::cuda::", fn, ": null operand or output pointer");
  K3_CHECK(aligned(a, 16) && aligned(b, 16), "moe::cuda::", fn, ": bf16 operands must be 16-byte aligned");
  K3_CHECK(aligned(c, 8), "moe::cuda::", fn, ": the fp32 output must be 8-byte aligned");
  K3_CHECK(E * out * in < (int64_t(1) << 62), "moe::cuda::", fn, ": E·out·in too large");
}

template <Mode M, int BM>
void launch(const Args& a, int64_t blocks) {
  using G = Geo<M, BM>;
  K3_CHECK(blocks <= INT_MAX, "moe::cuda::grouped_linear: grid of ", blocks, " CTAs too large");
  if (blocks == 0) return;
  auto* kern = grouped_linear_kernel<M, BM>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(G::smem_bytes)));
  kern<<<unsigned(blocks), kThreads, G::smem_bytes>>>(a);
  K3_CUDA_LAUNCH_CHECK();
}

// Forward and BackwardData: the tile prefix, then the GEMM over the upper bound of row tiles.
template <Mode M>
void run_rows(float* c, const void* a, const void* b, const void* const* b_tab, const int32_t* offsets, int64_t S,
              int64_t E, int64_t out, int64_t in, bool accumulate, void* workspace) {
  if (S == 0) return;
  K3_CHECK(workspace && aligned(workspace, 4), "moe::cuda::grouped_linear: workspace is null or misaligned");
  int32_t* tiles = static_cast<int32_t*>(workspace);
  tile_prefix_kernel<<<1, kPrefixThreads>>>(tiles, offsets, int(E), kBM);
  K3_CUDA_LAUNCH_CHECK();
  Args p{};
  p.c = c;
  p.a = static_cast<const uint16_t*>(a);
  p.b = static_cast<const uint16_t*>(b);
  p.b_tab = reinterpret_cast<const uint16_t* const*>(b_tab);
  p.offsets = offsets;
  p.tiles = tiles;
  p.E = int(E), p.out = int(out), p.in = int(in);
  const int64_t N = M == Mode::Forward ? out : in;
  p.n_tiles = int((N + kBN - 1) / kBN);
  p.m_tiles = 0;
  p.accumulate = accumulate;
  const int64_t slots = (S + kBM - 1) / kBM + E;  // >= Σ_e ceil(n_e / BM)
  launch<M, kBM>(p, slots * p.n_tiles);
}

}  // namespace

size_t grouped_linear_workspace_bytes(int64_t E) { return size_t(E + 1) * sizeof(int32_t); }

void grouped_linear_forward_bf16(float* y, const void* x, const void* W, const int32_t* offsets, int64_t S, int64_t E,
                                 int64_t out, int64_t in, bool accumulate, void* workspace) {
  check_args("grouped_linear_forward_bf16", y, x, W, offsets, S, E, out, in);
  run_rows<Mode::Forward>(y, x, W, nullptr, offsets, S, E, out, in, accumulate, workspace);
}
void grouped_linear_forward_bf16(float* y, const void* x, const void* const* W, const int32_t* offsets, int64_t S,
                                 int64_t E, int64_t out, int64_t in, bool accumulate, void* workspace) {
  check_args("grouped_linear_forward_bf16", y, x, W, offsets, S, E, out, in);
  run_rows<Mode::Forward>(y, x, nullptr, W, offsets, S, E, out, in, accumulate, workspace);
}

void grouped_linear_backward_data_bf16(float* dx, const void* dy, const void* W, const int32_t* offsets, int64_t S,
                                       int64_t E, int64_t out, int64_t in, bool accumulate, void* workspace) {
  check_args("grouped_linear_backward_data_bf16", dx, dy, W, offsets, S, E, out, in);
  run_rows<Mode::BackwardData>(dx, dy, W, nullptr, offsets, S, E, out, in, accumulate, workspace);
}
void grouped_linear_backward_data_bf16(float* dx, const void* dy, const void* const* W, const int32_t* offsets,
                                       int64_t S, int64_t E, int64_t out, int64_t in, bool accumulate,
                                       void* workspace) {
  check_args("grouped_linear_backward_data_bf16", dx, dy, W, offsets, S, E, out, in);
  run_rows<Mode::BackwardData>(dx, dy, nullptr, W, offsets, S, E, out, in, accumulate, workspace);
}

namespace {
void run_weight(float* dW, float* const* dW_tab, const void* dy, const void* x, const int32_t* offsets, int64_t S,
                int64_t E, int64_t out, int64_t in) {
  if (S == 0) return;
  Args p{};
  p.c = dW;
  p.c_tab = dW_tab;
  p.a = static_cast<const uint16_t*>(dy);
  p.b = static_cast<const uint16_t*>(x);
  p.offsets = offsets;
  p.tiles = nullptr;
  p.E = int(E), p.out = int(out), p.in = int(in);
  p.n_tiles = int((in + kBN - 1) / kBN);
  p.m_tiles = int((out + kBM - 1) / kBM);
  p.accumulate = true;
  launch<Mode::BackwardWeight, kBM>(p, E * p.m_tiles * p.n_tiles);
}
}  // namespace

void grouped_linear_backward_weight_bf16(float* dW, const void* dy, const void* x, const int32_t* offsets, int64_t S,
                                         int64_t E, int64_t out, int64_t in) {
  check_args("grouped_linear_backward_weight_bf16", dW, dy, x, offsets, S, E, out, in);
  run_weight(dW, nullptr, dy, x, offsets, S, E, out, in);
}
void grouped_linear_backward_weight_bf16(float* const* dW, const void* dy, const void* x, const int32_t* offsets,
                                         int64_t S, int64_t E, int64_t out, int64_t in) {
  check_args("grouped_linear_backward_weight_bf16", dW, dy, x, offsets, S, E, out, in);
  run_weight(nullptr, dW, dy, x, offsets, S, E, out, in);
}

}  // namespace k3::moe::cuda
