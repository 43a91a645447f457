// The grouped expert GEMM on Hopper (sm_90a): warpgroup MMA from shared memory, weights by TMA, token
// rows gathered by cp.async, an mbarrier ring between one producer and two consumer warpgroups, and
// persistent CTAs taking work items from Dispatch's device-side tile list through an atomic counter. See moe_gemm_sm90.cuh for the contract and
// docs/CUDA.md ("LatentMoE") for the design in prose.
//
// Tile: 128 routed rows (one expert) × 256 weight rows × 64 of K per pipeline stage.
//   - Warpgroup 2 produces. Its thread 0 loads the 256 × 64 weight tile as two 128-row TMA boxes of a
//     3-D tensor map [E][N][K] (rows past N and k past K arrive as zeros; 128-byte swizzle, as wgmma's
//     descriptors read it). All 128 threads gather the 128 × 64 A tile (token rows x_rows[r]) with
//     16-byte cp.async into the same swizzled layout, zero-filling rows past the expert's count and k
//     past K. sm_90's TMA has no row gather, hence cp.async for A.
//   - Warpgroups 0 and 1 consume: each owns 64 of the 128 rows and runs wgmma m64n256k16 (fp32
//     accumulators: 128 registers a thread) over the stage, keeping one stage's MMAs in flight while it
//     waits for the next. A warpgroup whose 64 rows are all past the expert's count (an expert's last
//     tile) only keeps the barriers' counts: that tile costs about half.
//   - Ring of kStages stages: full[s] completes when the weight bytes have landed (TMA transaction
//     count) and all 128 producer threads arrived; empty[s] when the 8 consumer warps are done with s.
//     cp.async writes through the generic proxy and wgmma reads through the async proxy, so a producer
//     thread arrives for stage s only after its copies of s completed (cp.async.wait_group) and it ran
//     fence.proxy.async. It does so at the top of iteration s + kLag, before waiting for that stage
//     to be empty: the consumers waiting for s have released s - 2 (they keep one stage of MMAs in
//     flight), and iteration s + kLag - 1 waited for s + kLag - 1 - kStages, so kLag <= kStages - 1
//     is deadlock-free and kLag <= kStages - 2 keeps that wait off the consumers' critical path.
//     Stage s's copies are issued when s - kStages is released, about three stages before use.
//     All 128 threads gather every stage: one warp per ring slot, each waiting for its own copies,
//     would have one warp issue 32 copies a lane for a 128-row A tile, which costs more than the wait
//     it saves (docs/CUDA.md, "LatentMoE", lists this and the L2 prefetch among the forms not kept).
//   - Glu: the first 128 weight rows of a tile are gate rows n0..n0+127 and the last 128 the up rows
//     with the same indices, so accumulator n8 block j (gate) and j + 16 (up) of one thread hold the
//     same h columns: SiTU-GLU runs in registers, h is rounded to bf16 once and never exists in fp32.
//   - Persistent, dynamically scheduled: one CTA per SM takes work items (tile slot, column tile) from a
//     global counter, zeroed before the launch. The order is the mma.sync kernel's raster: expert by
//     expert, column tile by column tile, the expert's row tiles innermost, so the CTAs that read one
//     weight tile start it together (one DRAM read, the others hit L2) and the expert's gathered rows
//     stay in L2. Producer thread 0 takes the next item (atomicAdd), writes it to slot j % kItemSlots of
//     a small ring in shared memory and passes it to its warpgroup through a named barrier; the
//     consumers read the slot once the item's first stage is full (the barrier's release/acquire orders
//     the write before the read). The producer runs at most kStages stages, so at most kStages items,
//     ahead: kItemSlots = 8 slots are never overwritten early. At the end the producer completes one
//     more stage with no bytes, whose slot holds an index past the total: the consumers' signal to
//     stop. The static schedule (items c, c + grid, ...; GemmConfig::dynamic_schedule = false) lets CTAs drift apart
//     over hundreds of items, each with its own mix of full and half tiles, until the CTAs sharing a
//     weight tile run it at different times and each reads it from DRAM (docs/CUDA.md, "How the Hopper
//     kernel reached 65% of cuBLAS"). The ring runs on across work items, so the producer loads the
//     next tile while the consumers run the epilogue.
// Every output element is a fixed sequence of wgmma k16 steps from k = 0 up, whatever the raster, grid
// or skipping (test KernelVariantsAreBitwiseEqual). The mma.sync kernel runs the same k16 steps in the
// same order, but nothing documents that wgmma and mma.sync round alike, so the tests compare the two
// kernels to a tolerance only.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda_check.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/sm90_ptx.cuh"
#include "kernels/common/tensor_map_cuda.h"
#include "kernels/moe/moe_gemm_sm90.cuh"
#include "kernels/moe/sm90_pipeline.cuh"

namespace k3::moe::cuda::sm90 {
namespace {

using bf16 = uint16_t;
using ptx::swz128;
using ptx::wait_or_trap;

constexpr int BM = kTileRows, BN = 256, BK = 64, kStages = 4, kLag = 2;
constexpr int kBoxRows = 128;                 // one TMA box: 128 weight rows × 64 k
constexpr int kATileBytes = BM * BK * 2;      // 16 KB
constexpr int kBTileBytes = BN * BK * 2;      // 32 KB
constexpr int kBoxBytes = kBoxRows * BK * 2;  // 16 KB
constexpr int kThreads = 384;                 // consumer warpgroups 0, 1; producer warpgroup 2
// Registers: 168 a thread at launch (64K / 384); the producer needs few, the consumers 128
// accumulators plus addressing and the epilogue. setmaxnreg moves registers within the CTA's launch
// allocation (168 · 384 = 64,512): 2·128·224 + 128·56 = 64,512 exactly. A larger total never fits, and
// setmaxnreg.inc then waits forever: the kernel hangs (no barrier wait, so wait_or_trap cannot see it).
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
constexpr int kItemSlots = 8;  // the dynamic schedule's ring of work items (see the kernel)
constexpr size_t kSmemBytes =
    size_t(kStages) * (kATileBytes + kBTileBytes) + 2 * kStages * 8 + kItemSlots * 4 + 1024;  // +1024: alignment
static_assert(kLag >= 1 && kLag <= kStages - 2, "see the pipeline note above");

static_assert((kStages & (kStages - 1)) == 0, "stage index by mask");

struct Params {
  const bf16* x;
  const int32_t* x_rows;
  const int32_t* offsets;
  const int32_t* tiles;
  const int32_t* num_tiles;
  bf16* y;
  int N, K, col_tiles;
  GluConsts glu;
  bool raster, skip_rows;
  int* counter;  // the dynamic schedule's next work item (zero at launch), or nullptr: static
};

struct Work {
  int e, row_base, rows, n0;  // expert, first sorted row, valid rows (<= BM), first output column
};

// Work item w (< num_tiles · col_tiles) -> tile and column tile (see the raster note above).
template <bool Glu>
__device__ __forceinline__ Work work_item(const Params& p, int w) {
  const int C = p.col_tiles;
  int tile, ct;
  if (p.raster) {
    tile = raster_tile(w, C, BM, p.tiles, p.offsets, &ct);
  } else {
    tile = w / C;
    ct = w % C;
  }
  Work t;
  t.e = p.tiles[2 * tile];
  const int m0 = p.tiles[2 * tile + 1], o0 = p.offsets[t.e];
  t.row_base = o0 + m0;
  t.rows = min(BM, p.offsets[t.e + 1] - o0 - m0);
  t.n0 = ct * (Glu ? BN / 2 : BN);
  return t;
}

template <bool Glu>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map0, const __grid_constant__ CUtensorMap map1,
                             const Params p) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (ptx::smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sA = base;                          // kStages × 128 rows × 128 B
  const uint32_t sB = sA + kStages * kATileBytes;    // kStages × 256 rows × 128 B
  const uint32_t full = sB + kStages * kBTileBytes;  // kStages mbarriers, 8 B each
  const uint32_t empty = full + kStages * 8;
  // Dynamic schedule: work item j of this CTA in slot j % kItemSlots (written by producer thread 0).
  volatile int* items = reinterpret_cast<volatile int*>(smem_raw + (empty + kStages * 8 - ptx::smem_u32(smem_raw)));
  const bool dynamic = p.counter != nullptr;

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full + 8 * s, 128 + 1);  // 128 producer threads + thread 0's expect_tx arrival
      ptx::mbar_init(empty + 8 * s, 8);       // the 8 consumer warps
    }
    ptx::fence_mbar_init();
  }
  __syncthreads();

  const int total = *p.num_tiles * p.col_tiles;
  const int KT = (p.K + BK - 1) / BK;

  if (tid >= 256) {
    // ---- producer warpgroup ----
    ptx::setmaxnreg_dec<kProducerRegs>();
    const int pt = tid - 256;
    const int chunk = pt & 7, r_first = pt >> 3;  // this thread: rows r_first + 16 i, 16-byte chunk `chunk`
    if (pt == 0) {
      ptx::prefetch_tensormap(&map0);
      ptx::prefetch_tensormap(&map1);
    }
    int it = 0;  // stages issued so far (the ring position runs on across work items)
    for (int j = 0;; ++j) {
      int w = int(blockIdx.x) + j * int(gridDim.x);
      if (dynamic) {  // thread 0 takes the next item; the warpgroup reads it after a named barrier
        if (pt == 0) items[j % kItemSlots] = atomicAdd(p.counter, 1);
        ptx::named_barrier_sync(1, 128);
        w = items[j % kItemSlots];
      }
      if (w >= total) break;
      const Work t = work_item<Glu>(p, w);
      int src[8];  // source row in x of each of this thread's 8 rows, -1 past the expert's count
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int r = r_first + 16 * i;
        src[i] = r < t.rows ? (p.x_rows ? p.x_rows[t.row_base + r] : t.row_base + r) : -1;
      }
      for (int kb = 0; kb < KT; ++kb, ++it) {
        if (it >= kLag) {  // stage it - kLag: this thread's copies are done; publish them to the async proxy
          ptx::cp_async_wait<kLag - 1>();
          ptx::fence_proxy_async_shared();
          ptx::mbar_arrive(full + 8 * ((it - kLag) & (kStages - 1)));
        }
        const int s = it & (kStages - 1);
        wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
        const int k0 = kb * BK;
        if (pt == 0) {
          ptx::mbar_arrive_expect_tx(full + 8 * s, kBTileBytes);
          const uint32_t b_s = sB + s * kBTileBytes;
          ptx::tma_load_3d(b_s, &map0, full + 8 * s, k0, t.n0, t.e);
          ptx::tma_load_3d(b_s + kBoxBytes, &map1, full + 8 * s, k0, Glu ? t.n0 : t.n0 + kBoxRows, t.e);
        }
        const uint32_t a_s = sA + s * kATileBytes;
        const bool k_ok = k0 + chunk * 8 < p.K;  // K % 8 == 0: a chunk is all in or all out
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const bool ok = k_ok && src[i] >= 0;
          const bf16* g = p.x + (ok ? int64_t(src[i]) * p.K + k0 + chunk * 8 : 0);
          ptx::cp_async16(a_s + swz128(r_first + 16 * i, chunk), g, ok ? 16 : 0);
        }
        ptx::cp_async_commit();
      }
    }
    ptx::cp_async_wait<0>();
    ptx::fence_proxy_async_shared();
    for (int j = max(0, it - kLag); j < it; ++j) ptx::mbar_arrive(full + 8 * (j & (kStages - 1)));
    if (dynamic) {
      // The end, for the consumers: stage `it` completes with no bytes (all 129 arrivals, once the stage is
      // empty, so its previous phase has completed) and its item slot holds a w past the total.
      const int s = it & (kStages - 1);
      wait_or_trap(empty + 8 * s, ((it / kStages) & 1) ^ 1);
      ptx::mbar_arrive(full + 8 * s);
      if (pt == 0) ptx::mbar_arrive(full + 8 * s);
    }
  } else {
    // ---- consumer warpgroups ----
    ptx::setmaxnreg_inc<kConsumerRegs>();
    const int wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const uint32_t a_off = uint32_t(wg) * 64 * 128;  // this warpgroup's 64 rows of the A tile
    float acc[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int it = 0;
    for (int j = 0;; ++j) {
      int w = int(blockIdx.x) + j * int(gridDim.x);
      if (dynamic) {  // the item's slot is written before its first stage completes (release/acquire)
        wait_or_trap(full + 8 * (it & (kStages - 1)), (it / kStages) & 1);
        w = items[j % kItemSlots];
      }
      if (w >= total) break;
      const Work t = work_item<Glu>(p, w);
      const bool active = !p.skip_rows || t.rows > wg * 64;
      for (int kb = 0; kb < KT; ++kb, ++it) {
        const int s = it & (kStages - 1);
        wait_or_trap(full + 8 * s, (it / kStages) & 1);
        if (active) {
          ptx::wgmma_fence();
          const uint64_t da = ptx::desc_k_sw128(sA + s * kATileBytes + a_off);
          const uint64_t db = ptx::desc_k_sw128(sB + s * kBTileBytes);
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk)  // k16 slice kk starts 32 B further: +2 in the descriptor
            ptx::wgmma_m64n256k16_bf16(acc, da + 2 * kk, db + 2 * kk, (kb | kk) != 0);
          ptx::wgmma_commit();
        }
        ptx::wgmma_wait<1>();  // the previous stage's MMAs are done: release it
        if (kb > 0 && lane == 0) ptx::mbar_arrive(empty + 8 * ((it - 1) & (kStages - 1)));
      }
      ptx::wgmma_wait<0>();
      ptx::fence_regs(acc);
      if (lane == 0) ptx::mbar_arrive(empty + 8 * ((it - 1) & (kStages - 1)));
      if (!active) continue;

      // Epilogue straight from the accumulators: thread holds rows r0, r0 + 8 and, per n8 block j,
      // columns 8j + cq, +1. Rows past the expert's count and columns past N are not stored.
      const int rq = lane >> 2, cq = (lane & 3) * 2;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = wg * 64 + warp * 16 + rq + 8 * h;
        if (r >= t.rows) continue;
        bf16* yrow = p.y + int64_t(t.row_base + r) * p.N;
        if constexpr (Glu) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int c = t.n0 + 8 * j + cq;
            if (c >= p.N) continue;
            const float v0 = moe_glu(acc[4 * j + 2 * h], acc[4 * (j + 16) + 2 * h], p.glu);
            const float v1 = moe_glu(acc[4 * j + 2 * h + 1], acc[4 * (j + 16) + 2 * h + 1], p.glu);
            *reinterpret_cast<uint32_t*>(yrow + c) = ptx::pack_bf16x2(v0, v1);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 32; ++j) {
            const int c = t.n0 + 8 * j + cq;
            if (c >= p.N) continue;
            *reinterpret_cast<uint32_t*>(yrow + c) = ptx::pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          }
        }
      }
    }
  }
}

// The stacked experts' weights as a 3-D tensor [E][N][K] bf16 with 128 × 64 boxes, 128-byte swizzle;
// out-of-range rows and k read as zeros.
CUtensorMap weight_map(const void* w, int E, int N, int K, int64_t expert_stride) {
  return cuda_tma::bf16_3d_sw128(w, uint64_t(K), uint64_t(N), uint64_t(E), uint64_t(K) * 2, uint64_t(expert_stride),
                                 BK, kBoxRows, "the experts' weights");
}

template <bool Glu>
void launch(const GroupedGemmArgs& a, Params p) {
  const CUtensorMap m0 = weight_map(a.w0, a.E, a.N, a.K, a.w_stride);
  const CUtensorMap m1 = Glu ? weight_map(a.w1, a.E, a.N, a.K, a.w_stride) : m0;
  const int64_t work = a.max_tiles * p.col_tiles;
  K3_CHECK(work < (int64_t(1) << 31), "moe::cuda: ", a.max_tiles, " row tiles × ", p.col_tiles,
           " column tiles overflow the work index");
  int64_t grid = std::min<int64_t>(work, sm_count());
  if (a.max_ctas > 0) grid = std::min<int64_t>(grid, a.max_ctas);
  if (grid <= 0) return;
  if (a.dynamic) {
    p.counter = schedule_counter();
    K3_CUDA_CHECK(cudaMemsetAsync(p.counter, 0, sizeof(int), 0));
  }
  K3_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_sm90_kernel<Glu>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(kSmemBytes)));
  grouped_gemm_sm90_kernel<Glu><<<unsigned(grid), kThreads, kSmemBytes>>>(m0, m1, p);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace

int sm_count() {
  static const int n = [] {
    int dev = 0, v = 0;
    K3_CUDA_CHECK(cudaGetDevice(&dev));
    K3_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

int* schedule_counter() {
  constexpr int kMaxDevices = 64;
  static int* counters[kMaxDevices] = {};
  int dev = 0;
  K3_CUDA_CHECK(cudaGetDevice(&dev));
  K3_CHECK(dev >= 0 && dev < kMaxDevices, "moe::cuda: device ", dev, " past ", kMaxDevices);
  if (counters[dev] == nullptr) K3_CUDA_CHECK(cudaMalloc(&counters[dev], sizeof(int)));
  return counters[dev];
}

void grouped_gemm(const GroupedGemmArgs& a) {
  K3_CHECK(a.K % 8 == 0 && a.K > 0 && a.N > 0 && a.w_stride % 16 == 0 && reinterpret_cast<uintptr_t>(a.w0) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(a.w1) % 16 == 0,
           "moe::cuda::sm90::grouped_gemm: needs K % 8 == 0 and 16-byte aligned weights");
  Params p{};
  p.x = a.x;
  p.x_rows = a.x_rows;
  p.offsets = a.offsets;
  p.tiles = a.tiles;
  p.num_tiles = a.num_tiles;
  p.y = a.y;
  p.N = a.N;
  p.K = a.K;
  p.col_tiles = (a.N + (a.glu ? BN / 2 : BN) - 1) / (a.glu ? BN / 2 : BN);
  p.glu = a.act;
  p.raster = a.raster;
  p.skip_rows = a.skip_rows;
  p.counter = nullptr;
  if (a.glu) launch<true>(a, p);
  else launch<false>(a, p);
}

}  // namespace k3::moe::cuda::sm90
