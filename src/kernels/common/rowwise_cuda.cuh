// Device helpers shared by the memory-bound CUDA kernels of the dense path (norm, attnres, glu,
// convert). For .cu files only. Not a public API: the entry points are in the *_cuda.h headers.
//
//   - bf16 is uint16_t on the device too; widening is a shift, narrowing rounds to nearest even with
//     the exact bit rules of core/dtype.h (so host and device agree bit for bit, NaN included).
//   - load_vec / store_vec move VEC elements of one type as float registers with 16-byte (or
//     smaller, when the pack is smaller) accesses; the caller guarantees the alignment. store_vec
//     narrows pairs to bf16 with the hardware conversion (pack2_bf16_rne, same bits as the integer
//     rule); copy_bytes_stream loads data read once with evict-first (ld.global.cs).
//   - block_sum reduces per-thread partial sums over the block so that EVERY thread gets the same
//     bits (butterfly shuffles are symmetric; the cross-warp sum runs in one fixed order), which the
//     online softmax of AttnRes relies on.
//   - Row kernels keep one row in registers: each thread holds up to kRowElemsPerThread floats, in
//     NV vectors of VEC elements; row_geometry picks the block size for a row length.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.cuh"

namespace k3::rowwise {

using bf16 = uint16_t;

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 h) { return __uint_as_float(uint32_t(h) << 16); }

// Same bits as k3::f32_to_bf16 (core/dtype.h): quiet NaN keeps its payload top, else RNE.
__device__ __forceinline__ bf16 f32_to_bf16_rne(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}

template <class T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return f32_to_bf16_rne(v);
}

// Value as it would be stored as T and read back (identity for float).
template <class T>
__device__ __forceinline__ float round_as(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return to_f32(f32_to_bf16_rne(v));
}

// The CPU twins' stable sigmoid (kernels/ffn/glu_cpu.cpp's sigmoidf_stable, the router's): exp of a
// non-positive number only, so it never overflows; num (1 or e) / (1 + e). kernels/ffn/glu_cuda.cu
// has a faster form with the same bits.
__device__ __forceinline__ float sigmoid_stable(float x) {
  const float e = expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

// Copy BYTES (a power of two, >= sizeof element) between suitably aligned addresses in chunks of
// at most 16 bytes: one LDG/STG.128 per 16 bytes.
template <int BYTES>
__device__ __forceinline__ void copy_bytes(void* dst, const void* src) {
  if constexpr (BYTES >= 16) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) static_cast<uint4*>(dst)[i] = static_cast<const uint4*>(src)[i];
  } else if constexpr (BYTES == 8) {
    *static_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  } else if constexpr (BYTES == 4) {
    *static_cast<uint32_t*>(dst) = *static_cast<const uint32_t*>(src);
  } else {
    static_assert(BYTES == 2, "unsupported pack size");
    *static_cast<uint16_t*>(dst) = *static_cast<const uint16_t*>(src);
  }
}

// copy_bytes from global memory with streaming loads (ld.global.cs, evict-first): for data read
// exactly once, so that it does not push reused data (weights, a query) out of L1/L2.
template <int BYTES>
__device__ __forceinline__ void copy_bytes_stream(void* dst, const void* src) {
  if constexpr (BYTES >= 16) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) static_cast<uint4*>(dst)[i] = __ldcs(static_cast<const uint4*>(src) + i);
  } else if constexpr (BYTES == 8) {
    *static_cast<uint2*>(dst) = __ldcs(static_cast<const uint2*>(src));
  } else if constexpr (BYTES == 4) {
    *static_cast<unsigned int*>(dst) = __ldcs(static_cast<const unsigned int*>(src));
  } else {
    static_assert(BYTES == 2, "unsupported pack size");
    *static_cast<unsigned short*>(dst) = __ldcs(static_cast<const unsigned short*>(src));
  }
}

template <class T, int VEC>
__device__ __forceinline__ void load_vec(float (&out)[VEC], const T* p) {
  alignas(16) T tmp[VEC];
  copy_bytes<int(sizeof(T)) * VEC>(tmp, p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = to_f32(tmp[k]);
}

// Eight bf16 (a 16-byte run, the lower address in v.x's low half) widened to fp32.
__device__ __forceinline__ void bf16x8_to_f32(const uint4 v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(u[i] << 16);
    f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
}

// Two floats as two bf16 packed in a word (lo in the low half: the lower address), the same bits as
// f32_to_bf16_rne on each: the hardware's round-to-nearest-even conversion (one instruction for the
// pair; finite values, infinities and subnormals round exactly as the integer rule does), with NaNs,
// whose payload rule is ours, redone in software.
__device__ __forceinline__ uint32_t pack2_bf16_rne(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  if ((lo != lo) | (hi != hi)) r = uint32_t(f32_to_bf16_rne(lo)) | (uint32_t(f32_to_bf16_rne(hi)) << 16);
  return r;
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[VEC]) {
  if constexpr (std::is_same_v<T, bf16> && VEC % 2 == 0) {
    alignas(16) uint32_t tmp[VEC / 2];
#pragma unroll
    for (int k = 0; k < VEC / 2; ++k) tmp[k] = pack2_bf16_rne(v[2 * k], v[2 * k + 1]);
    copy_bytes<int(sizeof(T)) * VEC>(p, tmp);
  } else {
    alignas(16) T tmp[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) tmp[k] = from_f32<T>(v[k]);
    copy_bytes<int(sizeof(T)) * VEC>(p, tmp);
  }
}

// The sum over the warp (float or double), by an xor butterfly: every lane gets identical bits.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Sum NVAL values over the block (blockDim.x a multiple of 32, <= 1024). `sh` is __shared__
// float[32][NVAL]. Every thread returns identical bits. Contains __syncthreads: call uniformly.
template <int NVAL>
__device__ __forceinline__ void block_sum(float (&v)[NVAL], float (*sh)[NVAL]) {
#pragma unroll
  for (int i = 0; i < NVAL; ++i) v[i] = warp_sum(v[i]);
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31), nw = int(blockDim.x >> 5);
  __syncthreads();  // the previous call's readers are done with sh
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < NVAL; ++i) sh[warp][i] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < NVAL; ++i) {
    float s = 0.0f;
    for (int w = 0; w < nw; ++w) s += sh[w][i];
    v[i] = s;
  }
}

// Row kernels: a thread holds at most this many floats of a row (registers, compile-time indexed).
// Blocks of at most 512 threads, declared with __launch_bounds__(kRowMaxThreads) so that the
// compiler keeps each thread within 128 registers (AttnRes holds 64 floats of row state).
// The longest row is 16384 elements; K3's rows are 7168 (hidden) or shorter.
constexpr int kRowElemsPerThread = 32;
constexpr int kRowMaxThreads = 512;
constexpr int64_t kRowMaxElems = int64_t(kRowElemsPerThread) * kRowMaxThreads;  // 16384

// Block size and vectors-per-thread for a row of `nvec` vectors when each thread holds at most
// `nv_max` of them: the fewest warps that fit, but at least one vector per thread up to kRowMinThreads, so that
// a short row (k3-1b's 512 floats) is not one warp walking its sources alone: a decode step has one row per
// sequence, and its latency is the block's. The geometry depends on the row length only, never on the row
// count, so a row's bits are the same in a step of one sequence and in a batch.
constexpr int kRowMinThreads = 128;
struct RowGeometry {
  int threads = 32;
  int nv = 1;
};
inline RowGeometry row_geometry(int64_t nvec, int nv_max) {
  RowGeometry g;
  int64_t t = (nvec + nv_max - 1) / nv_max;
  const int64_t one_each = (nvec + 31) / 32 * 32;
  t = (t + 31) / 32 * 32;
  t = std::max(t, std::min<int64_t>(one_each, kRowMinThreads));
  g.threads = int(t < 32 ? 32 : (t > kRowMaxThreads ? kRowMaxThreads : t));
  g.nv = int((nvec + g.threads - 1) / g.threads);
  return g;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Grid for a grid-stride loop over `work` items with 256-thread blocks.
inline unsigned grid_for(int64_t work, int threads = 256) {
  int64_t b = (work + threads - 1) / threads;
  if (b < 1) b = 1;
  if (b > 65536) b = 65536;
  return unsigned(b);
}

}  // namespace k3::rowwise
