// Pieces shared by the training KDA recurrence in fp32 (kda_chunk_train_cuda.cu) and on bf16 tensor
// cores (kda_chunk_train_tc_cuda.cu): the chunk length, the lookup of a chunk's rows, and the host-side
// argument checks of the entry points. For those .cu files only; the entry points are in
// kda_chunk_train_cuda.h and kda_chunk_train_tc_cuda.h.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"
#include "kernels/kda/kda_chunk_train_cuda.h"

namespace k3::kda::cuda::chunk_train {

constexpr int C = 16;  // chunk (tokens)

// Where a chunk lives: its first row, its length n (1..16), its sequence.
struct ChunkLoc {
  int64_t row0;
  int n;
  int b;
};

// The sequence holding global chunk ci: the b with chunk_offsets[b] <= ci < chunk_offsets[b+1] (binary
// search; empty sequences have equal offsets and are skipped by the strict upper bound).
template <class T>
__device__ __forceinline__ ChunkLoc locate_chunk(const KdaTrainParamsOf<T>& p, int64_t ci) {
  int lo = 0, hi = p.B;  // chunk_offsets[lo] <= ci < chunk_offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (int64_t(p.chunk_offsets[mid]) <= ci) lo = mid;
    else hi = mid;
  }
  const int64_t row0 = int64_t(p.cu_seqlens[lo]) + C * (ci - int64_t(p.chunk_offsets[lo]));
  const int64_t left = int64_t(p.cu_seqlens[lo + 1]) - row0;
  return ChunkLoc{row0, int(left < C ? left : C), lo};
}

// The grid of the chunk-parallel kernels: one CTA per (chunk, head), heads fastest (blockIdx.x), the chunk in
// blockIdx.y + gridDim.y * blockIdx.z (a grid's y and z are at most 65,535). The CTAs the SMs run together then
// cover whole token rows of q, k, v, ... ([rows, H * D]) and consecutive items and states ([chunks, H, ...]), so
// DRAM serves long runs instead of one head's 4 D bytes per row from rows H * D * 4 bytes apart.
inline dim3 chunk_head_grid(int64_t chunks, int H) {
  const int64_t y = chunks < 65535 ? chunks : 65535;
  return dim3(unsigned(H), unsigned(y < 1 ? 1 : y), unsigned(y < 1 ? 1 : (chunks + y - 1) / y));
}
// This CTA's chunk (possibly >= chunks in the last z slice: the caller returns) and head.
__device__ __forceinline__ int64_t grid_chunk() { return blockIdx.y + int64_t(gridDim.y) * blockIdx.z; }
__device__ __forceinline__ int grid_head() { return int(blockIdx.x); }

template <class T>
void check_params(const char* fn, const KdaTrainParamsOf<T>& p) {
  K3_CHECK(p.D == 32 || p.D == 64 || p.D == 128, fn, ": head dim D must be 32, 64 or 128, got ", p.D);
  K3_CHECK(p.H >= 1 && p.H <= 65535, fn, ": H must be in [1, 65535], got ", p.H);
  K3_CHECK(p.B >= 0, fn, ": B must be >= 0, got ", p.B);
  K3_CHECK(p.rows >= 0 && p.rows <= INT32_MAX, fn, ": rows must be in [0, 2^31), got ", p.rows);
  K3_CHECK(p.max_len >= 0, fn, ": max_len must be >= 0, got ", p.max_len);
  K3_CHECK(p.chunks >= (p.rows + C - 1) / C && p.chunks <= p.rows, fn, ": chunks must be in [ceil(rows/16), rows] = [",
           (p.rows + C - 1) / C, ", ", p.rows, "], got ", p.chunks);
}

template <class T>
void check_pointers(const char* fn, const KdaTrainParamsOf<T>& p) {
  K3_CHECK(p.q && p.k && p.v && p.g && p.beta, fn, ": q, k, v, g and beta must be non-null");
  K3_CHECK(p.cu_seqlens && p.chunk_offsets, fn, ": cu_seqlens and chunk_offsets must be non-null");
  K3_CHECK(p.B >= 1, fn, ": B must be >= 1 when rows > 0, got ", p.B);
}

// A caller-owned device buffer (`what`: the workspace, the tape) must be non-null and 16-byte aligned.
inline void check_workspace(const char* fn, const void* workspace, const char* what = "workspace") {
  K3_CHECK(workspace != nullptr, fn, ": ", what, " is null");
  K3_CHECK(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, fn, ": ", what, " must be 16-byte aligned");
}

// The checks of the forward entry point `fn`; false when rows = 0 (nothing to do, pointers not checked).
inline bool check_forward(const char* fn, const KdaTrainParams& p, const float* o, const void* states,
                          const void* workspace) {
  check_params(fn, p);
  if (p.rows == 0) return false;
  check_pointers(fn, p);
  K3_CHECK(o && states, fn, ": o and states must be non-null");
  check_workspace(fn, workspace);
  return true;
}

// The checks of the backward entry point `fn`; false when rows = 0 (nothing to do, pointers not checked).
template <class T>
bool check_backward(const char* fn, const KdaTrainParamsOf<T>& p, const T* d_o, const void* states, const T* dq,
                    const T* dk, const T* dv, const float* dg, const float* dbeta, const void* workspace) {
  check_params(fn, p);
  if (p.rows == 0) return false;
  check_pointers(fn, p);
  K3_CHECK(d_o && states, fn, ": d_o and states must be non-null");
  K3_CHECK(dq && dk && dv && dg && dbeta, fn, ": dq, dk, dv, dg and dbeta must be non-null");
  check_workspace(fn, workspace);
  return true;
}

}  // namespace k3::kda::cuda::chunk_train
