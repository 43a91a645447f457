// Fused Block AttnRes (+ RMSNorm) on the GPU (attnres_cuda.h).
//
// One block per token row. Alive at once per thread: the accumulator acc (<= 32 floats) and NB raw
// slices of the sources (<= 32 elements each, kept as loaded: F32, or BF16 widened on use): the one
// being merged and the next NB-1, in flight (NB = 2 for F32 sources, 3 for BF16: the same bytes in
// flight). The query and norm weight are re-read from L1/L2 (they are shared by every row). Each
// source is read from memory exactly once:
//   issue the loads of V_0 .. V_{NB-2}
//   for i in sources:  issue the loads of V_{i+NB-1};  (ss, dot) = block_sum(Σv², Σv·q) over V_i
//                      s = dot / sqrt(ss/D + eps)
//                      m' = max(m, s);  acc = acc·e^(m−m') + e^(s−m')·v;  z = z·e^(m−m') + e^(s−m');  m = m'
//   h = acc / z;  [y = w ⊙ h / sqrt(mean(h²) + eps_n)]
// block_sum gives every thread the same bits, so the softmax state is uniform across the block.
//
// Why this shape (docs/CUDA.md, "Dense", has the figures and the forms that did not pay):
//   - bandwidth needs bytes in flight while the block reduces, so the next source's loads are issued
//     before the current one is reduced (the NB-slice ring); loading a source only when its turn
//     came left the stream idle during every block_sum;
//   - the loads stream (ld.global.cs, evict-first: read once), which leaves L1 to the query and the
//     norm weight;
//   - one row per block, not persistent blocks: a persistent version (the ring running across row
//     ends, the query in shared memory) was slower; it needs more registers per thread, so (registers
//     being given to warps in groups of 4) one block fits an SM where two did, halving what is in flight.
// The arithmetic and its order do not depend on the ring's depth: the same row geometry, the same
// per-thread fma order and block_sum, so the same bits. The kernel parameters are __grid_constant__,
// so that the run-time indexed source pointers are read from the parameter space, not a local copy.
#include <climits>
#include <cmath>
#include <type_traits>

#include "core/cuda.h"
#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/attnres/attnres_cuda.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"

namespace k3::attnres::cuda {

namespace {

using rowwise::bf16;

template <class Tsrc>
struct Args {
  const Tsrc* src[kMaxSources];
  int S;
  int64_t ld_src, ld_out;
  int D, nv;
  const float* query;
  float eps;
  void* out;
  void* normed;
  const float* norm_weight;
  float norm_eps;
  const float* last_addend;  // AttnResParams: the pending residual update of the last source
  float* last_store;
};

// A thread's slice of one source row as loaded (NVMAX packs of VEC elements; packs past the row
// end are zero).
template <class Tsrc, int VEC, int NVMAX>
struct Slice {
  alignas(16) Tsrc raw[NVMAX][VEC];
};

// Issue the loads of a thread's slice of row `vr`: every load before any use.
template <class Tsrc, int VEC, int NVMAX>
__device__ __forceinline__ void load_slice(Slice<Tsrc, VEC, NVMAX>& sl, const Tsrc* vr, int nv, int D) {
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (j < nv && d0 < D) {
      rowwise::copy_bytes_stream<int(sizeof(Tsrc)) * VEC>(sl.raw[j], vr + d0);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) sl.raw[j][k] = Tsrc(0);
    }
  }
}

// Merge one source (its slice in `sl`) into the online softmax state (m, z, acc).
template <class Tsrc, int VEC, int NVMAX>
__device__ __forceinline__ void merge_source(const Slice<Tsrc, VEC, NVMAX>& sl, float (&acc)[NVMAX][VEC], float& m,
                                             float& z, const Args<Tsrc>& a, float (*sh)[2]) {
  const int D = a.D, nv = a.nv;
  float part[2] = {0.0f, 0.0f};  // Σv², Σv·q
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (j < nv && d0 < D) {
      float q[VEC];
      rowwise::load_vec<float, VEC>(q, a.query + d0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = rowwise::to_f32(sl.raw[j][k]);
        part[0] = fmaf(v, v, part[0]);
        part[1] = fmaf(v, q[k], part[1]);
      }
    }
  }
  rowwise::block_sum<2>(part, sh);
  const float s = part[1] / sqrtf(part[0] / float(D) + a.eps);
  const float m_new = fmaxf(m, s);
  const float c_old = expf(m - m_new);  // m = -inf on the first source: c_old = 0, acc and z are 0
  const float c_new = expf(s - m_new);
  z = fmaf(z, c_old, c_new);
#pragma unroll
  for (int j = 0; j < NVMAX; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[j][k] = fmaf(acc[j][k], c_old, c_new * rowwise::to_f32(sl.raw[j][k]));
  m = m_new;
}

// Slices per thread: the one being merged plus the sources in flight. A BF16 slice is half the
// registers and half the bytes of an F32 one, so BF16 sources keep two in flight (the same bytes).
// The scalar path (rows that are not 16-byte packs; 32 one-element loads per slice, each with its
// own address) does not prefetch: a second slice made ptxas spill.
template <class Tsrc, int VEC>
constexpr int prefetch_slices() {
  return VEC == 1 ? 1 : sizeof(Tsrc) == 2 ? 3 : 2;
}

// h = acc / z, stored as Tout, and (with a.normed) the RMSNorm of h: the end of both kernels. `wpre`, when given,
// holds the thread's norm weight already loaded (the pack kernel loads it before it waits on the previous kernel).
template <class Tsrc, class Tout, int VEC, int NVMAX>
__device__ __forceinline__ void finish_row(float (&acc)[NVMAX][VEC], float z, const Args<Tsrc>& a, int64_t row,
                                           float (*sh1)[1], const float (*wpre)[VEC] = nullptr) {
  const int D = a.D, nv = a.nv;
  // h = acc / z, as it will be stored (rounded to Tout): the norm below reads exactly that.
  float ss[1] = {0.0f};
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (j < nv && d0 < D) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        acc[j][k] = rowwise::round_as<Tout>(acc[j][k] / z);
        ss[0] = fmaf(acc[j][k], acc[j][k], ss[0]);
      }
      if (a.out) rowwise::store_vec<Tout, VEC>(static_cast<Tout*>(a.out) + row * a.ld_out + d0, acc[j]);
    }
  }
  if (!a.normed) return;  // uniform across the block: no thread is left waiting at a barrier
  rowwise::block_sum<1>(ss, sh1);
  const float r = 1.0f / sqrtf(ss[0] / float(D) + a.norm_eps);
  Tout* yr = static_cast<Tout*>(a.normed) + row * a.ld_out;
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (j < nv && d0 < D) {
      float o[VEC];
      if (a.norm_weight) {
        float w[VEC];
        if (wpre) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) w[k] = wpre[j][k];
        } else {
          rowwise::load_vec<float, VEC>(w, a.norm_weight + d0);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = w[k] * (acc[j][k] * r);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = acc[j][k] * r;
      }
      rowwise::store_vec<Tout, VEC>(yr + d0, o);
    }
  }
}

template <class Tsrc, class Tout, int VEC, int EPT, int NB>
__global__ void __launch_bounds__(rowwise::kRowMaxThreads) attnres_row_kernel(const __grid_constant__ Args<Tsrc> a) {
  constexpr int NVMAX = EPT / VEC;
  __shared__ float sh[32][2];
  __shared__ float sh1[32][1];
  const int64_t row = blockIdx.x;
  const int D = a.D, nv = a.nv, S = a.S;
  pdl::wait_then_release();

  float acc[NVMAX][VEC];
#pragma unroll
  for (int j = 0; j < NVMAX; ++j)
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[j][k] = 0.0f;
  float m = -INFINITY, z = 0.0f;

  // NB slices, used in turn: while one is merged, the loads of the next NB-1 sources into the others
  // are in flight. The source loop is unrolled by NB so that every slice index is a compile-time
  // constant (the slices stay in registers). merge_source has barriers: `i < S` is uniform.
  Slice<Tsrc, VEC, NVMAX> sl[NB];
#pragma unroll
  for (int b = 0; b < NB - 1; ++b)
    if (b < S) load_slice(sl[b], a.src[b] + row * a.ld_src, nv, D);
  for (int i0 = 0; i0 < S; i0 += NB) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int i = i0 + b;
      if (i < S) {
        if (i + NB - 1 < S) load_slice(sl[(b + NB - 1) % NB], a.src[i + NB - 1] + row * a.ld_src, nv, D);
        merge_source(sl[b], acc, m, z, a, sh);
      }
    }
  }

  finish_row<Tsrc, Tout, VEC, NVMAX>(acc, z, a, row, sh1);
}

// Rows of at most one pack per thread (k3-1b's 512 floats; any row the geometry gives nv = 1): every source is
// loaded at once and all their (Σv², Σv·q) are reduced by one block_sum, then merged in order as merge_source
// does. block_sum reduces each value alone, in the same order whatever their count, and the geometry is the row
// kernel's, so the arithmetic and its order are attnres_row_kernel's; a decode step's row waits on one reduction
// instead of S.
// The last source (with its pending update) is held apart from the others, in `last`, and its sums sit in the
// first two places of the reduction: so no register array is ever indexed by S (which the compiler would place
// in local memory) and every index below is a compile-time constant. The query and the norm weight are loaded
// before the kernel waits on the previous one (pdl_cuda.cuh).
template <class Tsrc, class Tout, int VEC, int SMAX>
__global__ void __launch_bounds__(rowwise::kRowMaxThreads) attnres_pack_kernel(const __grid_constant__ Args<Tsrc> a) {
  __shared__ float sh[32][2 * SMAX];
  __shared__ float sh1[32][1];
  const int64_t row = blockIdx.x;
  const int D = a.D, S = a.S, d0 = int(threadIdx.x) * VEC;
  const bool mine = d0 < D;
  float q[VEC], wn[1][VEC];
  if (mine) {
    rowwise::load_vec<float, VEC>(q, a.query + d0);
    if (a.normed && a.norm_weight) rowwise::load_vec<float, VEC>(wn[0], a.norm_weight + d0);
  }
  pdl::wait_then_release();

  Slice<Tsrc, VEC, 1> sl[SMAX - 1], last;
#pragma unroll
  for (int i = 0; i < SMAX - 1; ++i)
    if (i < S - 1) load_slice(sl[i], a.src[i] + row * a.ld_src, 1, D);
  load_slice(last, a.src[S - 1] + row * a.ld_src, 1, D);
  if constexpr (std::is_same_v<Tsrc, float>) {
    if (a.last_store && mine) {  // the pending residual update (uniform but for d0)
      if (a.last_addend) {
        float ad[VEC];
        rowwise::load_vec<float, VEC>(ad, a.last_addend + row * a.ld_src + d0);
#pragma unroll
        for (int k = 0; k < VEC; ++k) last.raw[0][k] += ad[k];
      }
      rowwise::store_vec<float, VEC>(a.last_store + row * a.ld_src + d0, last.raw[0]);
    }
  }
  float part[2 * SMAX];  // Σv², Σv·q: the last source's first, then sources 0 .. S-2
#pragma unroll
  for (int i = 0; i < 2 * SMAX; ++i) part[i] = 0.0f;
  if (mine)
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float v = rowwise::to_f32(last.raw[0][k]);
      part[0] = fmaf(v, v, part[0]);
      part[1] = fmaf(v, q[k], part[1]);
    }
#pragma unroll
  for (int i = 0; i < SMAX - 1; ++i) {
    if (i < S - 1 && mine)
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float v = rowwise::to_f32(sl[i].raw[0][k]);
        part[2 * i + 2] = fmaf(v, v, part[2 * i + 2]);
        part[2 * i + 3] = fmaf(v, q[k], part[2 * i + 3]);
      }
  }
  rowwise::block_sum<2 * SMAX>(part, sh);
  float acc[1][VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[0][k] = 0.0f;
  float m = -INFINITY, z = 0.0f;
  const auto merge = [&](const Slice<Tsrc, VEC, 1>& v, float ss, float dot) {
    const float sc = dot / sqrtf(ss / float(D) + a.eps);
    const float m_new = fmaxf(m, sc);
    const float c_old = expf(m - m_new), c_new = expf(sc - m_new);
    z = fmaf(z, c_old, c_new);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[0][k] = fmaf(acc[0][k], c_old, c_new * rowwise::to_f32(v.raw[0][k]));
    m = m_new;
  };
#pragma unroll
  for (int i = 0; i < SMAX - 1; ++i)
    if (i < S - 1) merge(sl[i], part[2 * i + 2], part[2 * i + 3]);
  merge(last, part[0], part[1]);
  finish_row<Tsrc, Tout, VEC, 1>(acc, z, a, row, sh1, wn);
}

// One block per row of `nvec` packs, each thread holding at most EPT elements of it.
template <class Tsrc, class Tout, int VEC, int EPT, int NB>
void run_kernel(Args<Tsrc> a, int64_t N, int64_t nvec) {
  const auto g = rowwise::row_geometry(nvec, EPT / VEC);
  a.nv = g.nv;
  if (a.last_store && (g.nv != 1 || !std::is_same_v<Tsrc, float>)) {  // the update first, as its own launch
    float* last = a.last_store;
    if (a.last_addend) elementwise::cuda::add_inplace(last, a.last_addend, N * a.D);
    else k3::cuda::copy_on_device(last, a.src[a.S - 1], size_t(N * a.D) * sizeof(float));
    a.src[a.S - 1] = reinterpret_cast<const Tsrc*>(last);
    a.last_addend = nullptr, a.last_store = nullptr;
  }
  if (g.nv == 1 && a.S <= 4) pdl::launch(attnres_pack_kernel<Tsrc, Tout, VEC, 4>, unsigned(N), g.threads, 0, a);
  else if (g.nv == 1 && a.S <= 8) pdl::launch(attnres_pack_kernel<Tsrc, Tout, VEC, 8>, unsigned(N), g.threads, 0, a);
  else if (g.nv == 1) pdl::launch(attnres_pack_kernel<Tsrc, Tout, VEC, kMaxSources>, unsigned(N), g.threads, 0, a);
  else pdl::launch(attnres_row_kernel<Tsrc, Tout, VEC, EPT, NB>, unsigned(N), g.threads, 0, a);
  K3_CUDA_LAUNCH_CHECK();
}

template <class Tsrc, class Tout>
void launch(const AttnResParams& p) {
  Args<Tsrc> a{};
  for (int i = 0; i < p.S; ++i) a.src[i] = static_cast<const Tsrc*>(p.sources[i]);
  a.S = p.S;
  a.ld_src = p.ld_src ? p.ld_src : p.D;
  a.ld_out = p.ld_out ? p.ld_out : p.D;
  a.D = int(p.D);
  a.query = p.query;
  a.eps = p.eps;
  a.out = p.out;
  a.normed = p.normed;
  a.norm_weight = p.norm_weight;
  a.norm_eps = p.norm_eps;
  a.last_addend = p.last_addend;
  a.last_store = p.last_store;

  constexpr int VEC = 16 / int(sizeof(Tsrc));
  bool vec = p.D % VEC == 0 && a.ld_src % VEC == 0 && a.ld_out % VEC == 0 && rowwise::aligned16(p.query) &&
             (!p.out || rowwise::aligned16(p.out)) && (!p.normed || rowwise::aligned16(p.normed)) &&
             (!p.norm_weight || rowwise::aligned16(p.norm_weight)) &&
             (!p.last_store || rowwise::aligned16(p.last_store)) &&
             (!p.last_addend || rowwise::aligned16(p.last_addend));
  for (int i = 0; i < p.S; ++i) vec = vec && rowwise::aligned16(p.sources[i]);
  if (vec) run_kernel<Tsrc, Tout, VEC, rowwise::kRowElemsPerThread, prefetch_slices<Tsrc, VEC>()>(a, p.N, p.D / VEC);
  else run_kernel<Tsrc, Tout, 1, rowwise::kRowElemsPerThread, prefetch_slices<Tsrc, 1>()>(a, p.N, p.D);
}

bool float_like(DType t) { return t == DType::F32 || t == DType::BF16; }

}  // namespace

std::string can_run(const AttnResParams& p) {
  if (p.S < 1 || p.S > kMaxSources)
    return "attnres (cuda): S = " + std::to_string(p.S) + " sources, expected 1.." + std::to_string(kMaxSources);
  if (!float_like(p.src_type) || !float_like(p.out_type))
    return std::string("attnres (cuda): sources and outputs must be F32 or BF16, got ") + dtype_name(p.src_type) +
           " -> " + dtype_name(p.out_type);
  if (p.N < 0 || p.D < 0) return "attnres (cuda): negative shape";
  if (p.N > INT_MAX) return "attnres (cuda): N = " + std::to_string(p.N) + " rows exceeds the grid limit 2^31-1";
  if (p.D > rowwise::kRowMaxElems)
    return "attnres (cuda): D = " + std::to_string(p.D) + " exceeds the register-resident row limit " +
           std::to_string(rowwise::kRowMaxElems);
  if ((p.ld_src && p.ld_src < p.D) || (p.ld_out && p.ld_out < p.D)) return "attnres (cuda): row stride smaller than D";
  if (p.N > 0 && p.D > 0) {
    for (int i = 0; i < p.S; ++i)
      if (!p.sources[i]) return "attnres (cuda): source " + std::to_string(i) + " is null";
    if (!p.query) return "attnres (cuda): null query";
    if (!p.out && !p.normed) return "attnres (cuda): neither out nor normed is set";
  }
  if (p.last_addend && !p.last_store) return "attnres (cuda): last_addend without last_store";
  if (p.last_store) {
    if (p.src_type != DType::F32) return "attnres (cuda): a pending update needs F32 sources";
    if (p.ld_src && p.ld_src != p.D) return "attnres (cuda): a pending update needs dense rows";
    if (p.last_addend && p.S >= 1 && p.last_store != p.sources[p.S - 1])
      return "attnres (cuda): last_addend updates the last source in place: last_store must be it";
  }
  return {};
}

void attnres_forward(const AttnResParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail(why);
  if (p.N == 0 || p.D == 0) return;
  const bool src_bf = p.src_type == DType::BF16, out_bf = p.out_type == DType::BF16;
  if (!src_bf && !out_bf) launch<float, float>(p);
  else if (!src_bf && out_bf) launch<float, bf16>(p);
  else if (src_bf && !out_bf) launch<bf16, float>(p);
  else launch<bf16, bf16>(p);
}

}  // namespace k3::attnres::cuda
