// The routed experts' grouped GEMMs for training (expert_gemm_train_cuda.h) on Hopper: one
// warp-specialised wgmma kernel, three operand layouts, fp32 outputs.
//
// Each mode is a GEMM C[m, n] = Σ_k A[m, k] B[k, n] per expert. The operands are staged in shared
// memory in the layout they have in global memory, never transposed: wgmma reads a K-major operand
// (k contiguous) or an MN-major one (m or n contiguous) from the same bytes, told which by its
// transpose bit.
//   mode            C (rows m × cols n)        A[m, k]              B[k, n]              K
//   Forward         y rows of e  × out         x[r, k]   K-major    W_e[n, k]  K-major   in
//   BackwardData    dx rows of e × in          dy[r, k]  K-major    W_e[k, n]  MN-major  out
//   BackwardWeight  dW_e: out    × in          dy[k, m]  MN-major   x[k, n]    MN-major  rows of e
// (r, and k in BackwardWeight, are the expert's sorted rows.)
//
// Tile: 128 rows of C × 256 columns × 64 of K per pipeline stage; the inference kernel's design
// (moe_gemm_sm90.cu, whose notes on the barriers hold here word for word):
//   - Warpgroup 2 produces: its 128 threads copy both operand tiles with 16-byte cp.async into
//     128-byte-swizzled shared memory, zero-filling every chunk outside the expert's rows, past out / in
//     or past K (src-size 0: nothing is read), so such elements add exact zeros. cp.async rather than
//     TMA because the trainer's expert matrices are separate buffers named by a pointer table (one
//     tensor map per expert otherwise), and because an expert's rows end mid-box, where TMA would read
//     the next expert's rows instead of zeros.
//   - Warpgroups 0 and 1 consume: each owns 64 rows of C and runs wgmma m64n256k16 (fp32
//     accumulators, 128 registers a thread), one stage of MMAs in flight while it waits for the next.
//     A warpgroup whose 64 rows are all past the valid rows (an expert's last row tile, or out < 128)
//     only keeps the barriers' counts.
//   - Persistent CTAs take work items from a counter (sm90::schedule_counter) in raster order, so the
//     CTAs reading one operand tile run side by side and share it through L2.
// Shared layouts (the tile 1024-byte aligned; swz128 places 16-byte chunk c of a 128-byte row):
//   K-major R × 64:   row r (64 k = 128 B) at r·128, chunk c holds k 8c..8c+7. Descriptor: SBO 1024 B
//                     between 8-row groups; the k16 slice kk starts 32·kk bytes in.
//   MN-major 64 × R:  R/64 atoms of 64 k rows × 64 m/n (8 KB each), atom i holding m/n 64i..64i+63;
//                     k row k of an atom at k·128, chunk c holds m/n 8c..8c+7. Descriptor: LBO 8 KB
//                     between atoms along m/n, SBO 1024 B between 8-row groups of k; the k16 slice kk
//                     starts 2048·kk bytes in. (CUTLASS's canonical GMMA MN-major SW128 layout,
//                     ((8,n),(8,k)):((1,LBO),(8,SBO)) in 16-byte units.)
// Scheduling, without a host round trip:
//   - Forward / BackwardData: tile_prefix_kernel turns the offsets into tiles[e] = Σ_{e' < e}
//     ceil(n_e' / 128). Item w of tiles[E] × col_tiles: q = w / col_tiles names expert e (the largest
//     with tiles[e] <= q, found by binary search), whose items run its column tiles in order with its
//     row tiles innermost (the inference kernel's raster).
//   - BackwardWeight: item w of E × m_tiles × n_tiles: expert-major, then m tile, then n tile. The
//     items of an expert with no rows are never handed out (next_item), so dW_e is untouched.
// Numerics and determinism: every output element is one fp32 accumulator chain, a fixed sequence of
// wgmma k16 steps from k = 0 up, owned by one CTA; no split-k, and an accumulated output receives one
// add per element (see the epilogue). So results are bitwise the
// same run to run and whatever the grid or the schedule, and a row's forward / backward-data result
// does not depend on the other rows of the batch (the batch-invariant mode relies on this).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/sm90_ptx.cuh"
#include "kernels/moe/expert_gemm_train_cuda.h"
#include "kernels/moe/sm90_pipeline.cuh"

namespace k3::moe::cuda {
namespace {

using bf16 = uint16_t;
using ptx::swz128;
using ptx::wait_or_trap;

constexpr int BM = 128, BN = 256, BK = 64, kStages = 4, kLag = 2;
constexpr int kATileBytes = BM * BK * 2;  // 16 KB
constexpr int kBTileBytes = BN * BK * 2;  // 32 KB
constexpr int kAtomBytes = 64 * 128;      // one MN-major atom: 64 k rows × 128 B
constexpr int kThreads = 384;             // consumer warpgroups 0, 1; producer warpgroup 2
constexpr int kProducerRegs = 56, kConsumerRegs = 224;  // see moe_gemm_sm90.cu: 2·128·224 + 128·56 = 168·384
constexpr int kItemSlots = 8;
constexpr size_t kSmemBytes = size_t(kStages) * (kATileBytes + kBTileBytes) + 2 * kStages * 8 + kItemSlots * 4 + 1024;
constexpr int kPrefixThreads = 1024;
static_assert(kLag >= 1 && kLag <= kStages - 2, "see moe_gemm_sm90.cu's pipeline note");
static_assert((kStages & (kStages - 1)) == 0, "stage index by mask");

enum class Mode { Forward, BackwardData, BackwardWeight };

template <Mode M>
struct Layout {
  static constexpr bool a_kmajor = M != Mode::BackwardWeight;
  static constexpr bool b_kmajor = M == Mode::Forward;
};

struct Args {
  float* c;                // Forward: y; BackwardData: dx; BackwardWeight: dW
  const bf16* a;           // Forward: x; else dy
  const bf16* b;           // Forward, BackwardData: W; BackwardWeight: x
  const bf16* const* b_tab;  // per-expert W_e (Forward, BackwardData), or null: stacked
  float* const* c_tab;       // per-expert dW_e (BackwardWeight), or null: stacked
  const int32_t* offsets;  // [E + 1]
  const int32_t* tiles;    // [E + 1] row-tile prefix (Forward, BackwardData)
  int E, out, in;
  int col_tiles;  // column tiles of C (256 wide)
  int m_tiles;    // BackwardWeight: row tiles of C (out / 128)
  bool accumulate;
  int* counter;
};

// tiles[e] = Σ_{e' < e} ceil(n_e' / BM) for e <= E. One CTA: each thread sums a contiguous run of
// experts, an inclusive scan over the threads' sums in shared memory, then each thread writes its run.
__global__ void __launch_bounds__(kPrefixThreads)
    tile_prefix_kernel(int32_t* __restrict__ tiles, const int32_t* __restrict__ offsets, int E) {
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

// One work item's tile: expert e; C rows [m0, m0 + valid_m), columns [n0, n0 + valid_n); reduction
// length K; and the global bases of its operands (element (0, 0) of the tile) and output.
struct Work {
  int e, valid_m, valid_n, K;
  const bf16 *ga, *gb;
  int64_t lda, ldb, ldc;
  float* gc;
};

template <Mode M>
__device__ __forceinline__ Work work_item(const Args& p, int w) {
  Work t;
  const int64_t wsz = int64_t(p.out) * p.in;
  int m0, n0;
  if (M == Mode::BackwardWeight) {
    const int per = p.m_tiles * p.col_tiles;
    t.e = w / per;
    const int local = w - t.e * per;
    m0 = (local / p.col_tiles) * BM;
    n0 = (local % p.col_tiles) * BN;
    const int r0 = p.offsets[t.e];
    t.K = p.offsets[t.e + 1] - r0;
    t.valid_m = min(BM, p.out - m0);
    t.valid_n = min(BN, p.in - n0);
    t.ga = p.a + int64_t(r0) * p.out + m0, t.lda = p.out;  // dy rows k, m contiguous
    t.gb = p.b + int64_t(r0) * p.in + n0, t.ldb = p.in;    // x rows k, n contiguous
    t.gc = (p.c_tab ? p.c_tab[t.e] : p.c + t.e * wsz) + int64_t(m0) * p.in + n0, t.ldc = p.in;
    return t;
  }
  const int C = p.col_tiles;
  const int q = w / C;
  // e = the largest expert with tiles[e] <= q (tiles nondecreasing, tiles[0] = 0 <= q < tiles[E])
  int lo = 0, hi = p.E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.tiles[mid] <= q) lo = mid;
    else hi = mid - 1;
  }
  t.e = lo;
  const int t0 = p.tiles[t.e], R = p.tiles[t.e + 1] - t0;  // R >= 1: q lies in [t0, t0 + R)
  const int local = w - t0 * C;
  const int ct = local / R, rt = local % R;
  const int r0 = p.offsets[t.e];
  m0 = rt * BM;
  n0 = ct * BN;
  t.valid_m = min(BM, p.offsets[t.e + 1] - r0 - m0);
  const bf16* W = p.b_tab ? p.b_tab[t.e] : p.b + t.e * wsz;
  if (M == Mode::Forward) {
    t.K = p.in;
    t.valid_n = min(BN, p.out - n0);
    t.ga = p.a + int64_t(r0 + m0) * p.in, t.lda = p.in;  // x rows, k contiguous
    t.gb = W + int64_t(n0) * p.in, t.ldb = p.in;         // W_e rows n, k contiguous
    t.gc = p.c + int64_t(r0 + m0) * p.out + n0, t.ldc = p.out;
  } else {
    t.K = p.out;
    t.valid_n = min(BN, p.in - n0);
    t.ga = p.a + int64_t(r0 + m0) * p.out, t.lda = p.out;  // dy rows, k contiguous
    t.gb = W + n0, t.ldb = p.in;                            // W_e rows k, n contiguous
    t.gc = p.c + int64_t(r0 + m0) * p.in + n0, t.ldc = p.in;
  }
  return t;
}

// The next work item for producer thread 0 to publish. Items of an expert with no rows have no stages,
// so they are never published: the consumers learn each item from the ring when its first stage
// completes, and a producer running through stage-less items could overwrite ring slots the consumers
// have not read. The counter is the schedule of every CTA, so a skipped item is skipped for all.
template <Mode M>
__device__ __forceinline__ int next_item(const Args& p, int total) {
  for (;;) {
    const int w = atomicAdd(p.counter, 1);
    if (M != Mode::BackwardWeight || w >= total) return w;
    const int e = w / (p.m_tiles * p.col_tiles);
    if (p.offsets[e + 1] > p.offsets[e]) return w;
  }
}

// One stage of one operand tile (R = its m or n extent) into shared memory at dst, by the producer's
// 128 threads (pt). K-major: R rows of 64 k; element (r, k) at g + r·ld + k0 + k. MN-major: 64 k rows
// of R; element (k, r) at g + (k0 + k)·ld + r. Valid when r < valid and k0 + k < K; valid, out and in
// move in whole 8-element chunks, so a chunk is all in or all out (K-major K is out or in, also whole).
template <bool KMajor, int R>
__device__ __forceinline__ void load_operand(uint32_t dst, const bf16* __restrict__ g, int64_t ld, int k0, int K,
                                             int valid, int pt) {
  static_assert(R * BK / 8 % 128 == 0, "whole chunks per producer thread");
  if (KMajor) {
    // 8 chunks a row: thread pt takes chunk pt % 8 of rows pt / 8 + 16 i
    const int c = pt & 7, r0 = pt >> 3;
    const bool k_ok = k0 + 8 * c < K;
    const bf16* src = g + int64_t(r0) * ld + k0 + 8 * c;
#pragma unroll
    for (int i = 0; i < R / 16; ++i) {
      const int r = r0 + 16 * i;
      const bool ok = k_ok && r < valid;
      ptx::cp_async16(dst + swz128(r, c), ok ? src + int64_t(16 * i) * ld : g, ok ? 16 : 0);
    }
  } else {
    // R / 8 chunks a k row: thread pt takes chunk pt % (R / 8) of k rows pt / (R / 8) + (128 / (R / 8)) i
    constexpr int kPerRow = R / 8, kRowsPerPass = 128 / kPerRow;
    const int cm = pt % kPerRow, kr0 = pt / kPerRow;
    const bool r_ok = 8 * cm < valid;
    const uint32_t atom = uint32_t(cm >> 3) * kAtomBytes;
    const bf16* src = g + int64_t(k0 + kr0) * ld + 8 * cm;
#pragma unroll
    for (int i = 0; i < BK / kRowsPerPass; ++i) {
      const int k = kr0 + kRowsPerPass * i;
      const bool ok = r_ok && k0 + k < K;
      ptx::cp_async16(dst + atom + swz128(k, cm & 7), ok ? src + int64_t(kRowsPerPass * i) * ld : g, ok ? 16 : 0);
    }
  }
}

// Descriptors (see the layout note above).
template <bool KMajor>
__device__ __forceinline__ uint64_t operand_desc(uint32_t addr) {
  return KMajor ? ptx::desc_k_sw128(addr) : ptx::desc_mn_sw128(addr, kAtomBytes);
}
// The descriptor step of one k16 slice, in 16-byte units: 32 B along a K-major row, 16 k rows of an atom.
template <bool KMajor>
constexpr uint64_t k16_step() {
  return KMajor ? 32 >> 4 : (16 * 128) >> 4;
}

template <Mode M>
__global__ void __launch_bounds__(kThreads, 1) grouped_linear_sm90_kernel(const Args p) {
  using L = Layout<M>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sA = base;                          // kStages × 16 KB
  const uint32_t sB = sA + kStages * kATileBytes;    // kStages × 32 KB
  const uint32_t full = sB + kStages * kBTileBytes;  // kStages mbarriers, 8 B each
  const uint32_t empty = full + kStages * 8;
  volatile int* items = reinterpret_cast<volatile int*>(smem_raw + (empty + kStages * 8 - ptx::smem_u32(smem_raw)));

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full + 8 * s, 128);  // the 128 producer threads
      ptx::mbar_init(empty + 8 * s, 8);   // the 8 consumer warps
    }
    ptx::fence_mbar_init();
  }
  __syncthreads();

  const int total = M == Mode::BackwardWeight ? p.E * p.m_tiles * p.col_tiles : p.tiles[p.E] * p.col_tiles;

  if (tid >= 256) {
    // ---- producer warpgroup ----
    ptx::setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 256;
    int it = 0;  // stages issued so far (the ring position runs on across work items)
    for (int j = 0;; ++j) {
      if (pt == 0) items[j % kItemSlots] = next_item<M>(p, total);
      ptx::named_barrier_sync(1, 128);
      const int w = items[j % kItemSlots];
      if (w >= total) break;
      const Work t = work_item<M>(p, w);
      const int KT = (t.K + BK - 1) / BK;
      for (int kb = 0; kb < KT; ++kb, ++it) {
        if (it >= kLag) {  // stage it - kLag: this thread's copies are done; publish them to the async proxy
          ptx::cp_async_wait<kLag - 1>();
          ptx::fence_proxy_async_shared();
          ptx::mbar_arrive(full + 8 * ((it - kLag) & (kStages - 1)));
        }
        const int s = it & (kStages - 1);
        wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
        const int k0 = kb * BK;
        load_operand<L::a_kmajor, BM>(sA + s * kATileBytes, t.ga, t.lda, k0, t.K, t.valid_m, pt);
        load_operand<L::b_kmajor, BN>(sB + s * kBTileBytes, t.gb, t.ldb, k0, t.K, t.valid_n, pt);
        ptx::cp_async_commit();
      }
    }
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_shared();
    for (int j = max(0, it - kLag); j < it; ++j) ptx::mbar_arrive(full + 8 * (j & (kStages - 1)));
    // The end, for the consumers: stage `it` completes with no bytes once it is empty, and its item
    // slot holds a w past the total.
    const int s = it & (kStages - 1);
    wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
    ptx::mbar_arrive(full + 8 * s);
  } else {
    // ---- consumer warpgroups ----
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    // this warpgroup's 64 rows of the A tile: 64 K-major rows, or the second MN-major atom
    const uint32_t a_off = L::a_kmajor ? uint32_t(wg) * 64 * 128 : uint32_t(wg) * kAtomBytes;
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int it = 0;
    for (int j = 0;; ++j) {
      // The item's slot is written before its first stage completes (release/acquire).
      wait_or_trap(full + 8 * (it & (kStages - 1)), (it / kStages) & 1);
      const int w = items[j % kItemSlots];
      if (w >= total) break;
      const Work t = work_item<M>(p, w);
      const int KT = (t.K + BK - 1) / BK;
      const bool active = t.valid_m > wg * 64;
      for (int kb = 0; kb < KT; ++kb, ++it) {
        const int s = it & (kStages - 1);
        wait_or_trap(full + 8 * s, (it / kStages) & 1);
        if (active) {
          ptx::wgmma_fence();
          const uint64_t da = operand_desc<L::a_kmajor>(sA + s * kATileBytes + a_off);
          const uint64_t db = operand_desc<L::b_kmajor>(sB + s * kBTileBytes);
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk)
            ptx::wgmma_m64n256k16_bf16<!L::a_kmajor, !L::b_kmajor>(
                acc, da + k16_step<L::a_kmajor>() * kk, db + k16_step<L::b_kmajor>() * kk, (kb | kk) != 0);
          ptx::wgmma_commit();
        }
        ptx::wgmma_wait<1>();  // the previous stage's MMAs are done: release it
        if (kb > 0 && lane == 0) ptx::mbar_arrive(empty + 8 * ((it - 1) & (kStages - 1)));
      }
      ptx::wgmma_wait<0>();
      ptx::fence_regs(acc);
      if (lane == 0) ptx::mbar_arrive(empty + 8 * ((it - 1) & (kStages - 1)));
      if (!active) continue;

      // Epilogue from the accumulators: thread holds rows r, r + 8 and, per n8 block j, columns
      // 8j + cq, +1. Rows and columns outside the tile's valid region are not stored. Adding to the
      // output is a vector reduction in the memory system (red.global.add): the thread never waits for
      // an old value (loading them, 64 a thread with the accumulators holding most registers, exposes
      // one memory latency after another). Each element gets exactly one add in the launch, from the
      // one thread that owns it, so the result is old + acc rounded once, the same run to run. PTX's
      // red.add.f32 flushes subnormal operands and results to zero; a weight gradient below 1.2e-38 is
      // below anything the optimizer can use.
      const bool add = M == Mode::BackwardWeight || p.accumulate;
      const int rq = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wg * 64 + warp * 16 + rq + 8 * h;
        if (r >= t.valid_m) continue;
        float* crow = t.gc + int64_t(r) * t.ldc + cq;
#pragma unroll
        for (int jn = 0; jn < 32; ++jn) {
          if (8 * jn + cq >= t.valid_n) continue;
          const float x = acc[4 * jn + 2 * h], y = acc[4 * jn + 2 * h + 1];
          if (add) ptx::red_add_f32x2(crow + 8 * jn, x, y);
          else *reinterpret_cast<float2*>(crow + 8 * jn) = make_float2(x, y);
        }
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

template <Mode M>
void launch(Args p, int64_t max_items) {
  K3_CHECK(max_items < (int64_t(1) << 31), "moe::cuda::grouped_linear: ", max_items, " work items overflow the index");
  const int64_t grid = std::min<int64_t>(max_items, sm90::sm_count());
  if (grid <= 0) return;
  p.counter = sm90::schedule_counter();
  K3_CUDA_CHECK(cudaMemsetAsync(p.counter, 0, sizeof(int), 0));
  auto* kern = grouped_linear_sm90_kernel<M>;
  K3_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBytes)));
  kern<<<unsigned(grid), kThreads, kSmemBytes>>>(p);
  K3_CUDA_LAUNCH_CHECK();
}

// Forward and BackwardData: the tile prefix, then the GEMM over the upper bound of row tiles.
template <Mode M>
void run_rows(float* c, const void* a, const void* b, const void* const* b_tab, const int32_t* offsets, int64_t S,
              int64_t E, int64_t out, int64_t in, bool accumulate, void* workspace) {
  if (S == 0) return;
  K3_CHECK(workspace && aligned(workspace, 4), "moe::cuda::grouped_linear: workspace is null or misaligned");
  int32_t* tiles = static_cast<int32_t*>(workspace);
  tile_prefix_kernel<<<1, kPrefixThreads>>>(tiles, offsets, int(E));
  K3_CUDA_LAUNCH_CHECK();
  Args p{};
  p.c = c;
  p.a = static_cast<const bf16*>(a);
  p.b = static_cast<const bf16*>(b);
  p.b_tab = reinterpret_cast<const bf16* const*>(b_tab);
  p.offsets = offsets;
  p.tiles = tiles;
  p.E = int(E), p.out = int(out), p.in = int(in);
  const int64_t N = M == Mode::Forward ? out : in;
  p.col_tiles = int((N + BN - 1) / BN);
  p.accumulate = accumulate;
  const int64_t slots = (S + BM - 1) / BM + E;  // >= Σ_e ceil(n_e / BM)
  launch<M>(p, slots * p.col_tiles);
}

void run_weight(float* dW, float* const* dW_tab, const void* dy, const void* x, const int32_t* offsets, int64_t S,
                int64_t E, int64_t out, int64_t in) {
  if (S == 0) return;
  Args p{};
  p.c = dW;
  p.c_tab = dW_tab;
  p.a = static_cast<const bf16*>(dy);
  p.b = static_cast<const bf16*>(x);
  p.offsets = offsets;
  p.E = int(E), p.out = int(out), p.in = int(in);
  p.col_tiles = int((in + BN - 1) / BN);
  p.m_tiles = int((out + BM - 1) / BM);
  p.accumulate = true;
  launch<Mode::BackwardWeight>(p, E * p.m_tiles * p.col_tiles);
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
