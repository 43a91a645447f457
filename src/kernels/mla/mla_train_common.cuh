// Host-side pieces shared by the training MLA attention in fp32 (mla_train_cuda.cu) and on bf16 tensor
// cores (mla_train_tc_cuda.cu): the argument checks, the backward's workspace layout, the shared-memory
// opt-in of the kernels, and the sum of dk_rot over the heads. For those .cu files only; the entry
// points are in mla_train_cuda.h and mla_train_tc_cuda.h.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/mla/mla.h"

namespace k3::mla::cuda::train_common {

constexpr int kMaxQk = 256, kMaxV = 256;

// Shapes and strides common to the forward and the backward; `fn` names the caller.
inline void check_attention(const char* fn, const Dims& d, int B, int64_t max_len, int64_t rows, int64_t ldq,
                            int64_t ldkv, int64_t ldr, float scale) {
  K3_CHECK(d.H >= 1 && d.H <= 65535, fn, ": H must be in [1, 65535], got ", d.H);
  K3_CHECK(d.Dn >= 0 && d.Dr >= 0 && d.Dn + d.Dr >= 1 && d.Dn + d.Dr <= kMaxQk, fn,
           ": need Dn, Dr >= 0 and 1 <= Dn + Dr <= 256, got Dn = ", d.Dn, ", Dr = ", d.Dr);
  K3_CHECK(d.Dv >= 1 && d.Dv <= kMaxV, fn, ": Dv must be in [1, 256], got ", d.Dv);
  K3_CHECK(B >= 0 && B <= 65535, fn, ": B must be in [0, 65535], got ", B);
  K3_CHECK(rows >= 0 && rows <= INT32_MAX, fn, ": rows must be in [0, 2^31), got ", rows);
  K3_CHECK(max_len >= 0 && max_len <= rows, fn, ": max_len must be in [0, rows = ", rows, "], got ", max_len);
  K3_CHECK(rows == 0 || B == 0 || max_len >= 1, fn, ": max_len must be >= 1 when rows = ", rows, " > 0");
  K3_CHECK(ldq >= d.H * (d.Dn + d.Dr), fn, ": ldq = ", ldq, " < H*(Dn+Dr) = ", d.H * (d.Dn + d.Dr));
  K3_CHECK(ldkv >= d.H * (d.Dn + d.Dv), fn, ": ldkv = ", ldkv, " < H*(Dn+Dv) = ", d.H * (d.Dn + d.Dv));
  K3_CHECK(ldr >= d.Dr, fn, ": ldr = ", ldr, " < Dr = ", d.Dr);
  K3_CHECK(std::isfinite(scale) && scale > 0.0f, fn, ": scale must be finite and > 0, got ", scale);
}

// The backward's shapes and strides: check_attention's, then those of dO (ldo) and of the gradients.
inline void check_backward(const char* fn, const Dims& d, int B, int64_t max_len, int64_t rows, int64_t ldq,
                           int64_t ldkv, int64_t ldr, float scale, int64_t ldo, int64_t lddq, int64_t lddkv,
                           int64_t lddr) {
  check_attention(fn, d, B, max_len, rows, ldq, ldkv, ldr, scale);
  K3_CHECK(ldo >= d.H * d.Dv, fn, ": ldo = ", ldo, " < H*Dv = ", d.H * d.Dv);
  K3_CHECK(lddq >= d.H * (d.Dn + d.Dr), fn, ": lddq = ", lddq, " < H*(Dn+Dr) = ", d.H * (d.Dn + d.Dr));
  K3_CHECK(lddkv >= d.H * (d.Dn + d.Dv), fn, ": lddkv = ", lddkv, " < H*(Dn+Dv) = ", d.H * (d.Dn + d.Dv));
  K3_CHECK(lddr >= d.Dr, fn, ": lddr = ", lddr, " < Dr = ", d.Dr);
}

// The backward's workspace: Delta [H, rows] fp32 in the first delta_bytes (rounded up to 256), then the
// per-head dk_rot [H, rows, Dr] fp32. `fn` names the caller.
inline size_t delta_bytes(int64_t rows, const Dims& d) {
  return (size_t(d.H * rows) * sizeof(float) + 255) / 256 * 256;
}
inline size_t backward_workspace_bytes(const char* fn, int64_t rows, const Dims& d) {
  K3_CHECK(rows >= 0 && d.H >= 1 && d.Dr >= 0, fn, ": bad rows = ", rows, ", H = ", d.H, " or Dr = ", d.Dr);
  return delta_bytes(rows, d) + size_t(d.H * rows * d.Dr) * sizeof(float);
}

// Raises a kernel's dynamic shared-memory limit to `bytes` (once per kernel and size seen so far).
template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes, size_t& allowed) {
  if (bytes > 48 * 1024 && bytes > allowed) {
    K3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    allowed = bytes;
  }
}

// dk_rot[r][c] (row stride lddr) = Σ_{h = 0..H-1} dk_rot_h[h][r][c] (dk_rot_h [H, rows, Dr]), in head
// order, summed in double, rounded once: one launch of `grid` blocks of 256 threads (a grid-stride
// loop over rows * Dr elements). Defined in mla_train_cuda.cu.
void dk_rot_sum(unsigned grid, float* dk_rot, int64_t lddr, const float* dk_rot_h, int64_t rows, int H, int Dr);

}  // namespace k3::mla::cuda::train_common
