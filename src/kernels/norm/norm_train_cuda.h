// RMSNorm for GPU training, fp32: the CUDA twin of the float64 k3::rmsnorm_forward_saved /
// rmsnorm_backward_saved (kernels/norm/norm.h).
//   forward:  rstd = 1/sqrt(mean(x²) + eps) per row (saved),  y = w ⊙ (x · rstd)
//   backward: with g = dy ⊙ w and xhat = x · rstd (recomputed from x and the saved rstd),
//             dx = rstd · (g − xhat · mean(g ⊙ xhat)),   dw += Σ_rows dy ⊙ xhat
// w may be null (ones). Rows have strides (elements, >= D), so a column slice of a wider tensor
// (MLA's q/kv latents) is normalised where it lies, without a copy.
//
// Kernels: one block per row for y and dx (x re-read from L1/L2 in the second pass); row sums in
// fp32 through a block reduction of fixed order. dw is a column sum over rows, summed without
// atomics: blocks of kDwRowsPerChunk rows write double partial sums to the workspace, then one
// kernel adds them to dw in chunk order, so dw is bitwise reproducible.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstddef>
#include <cstdint>

namespace k3::norm::cuda {

// y [N, ldy] (columns >= D untouched), rstd [N] written; x [N, ldx]; w [D] or null.
// y may alias x when ldy == ldx.
void rmsnorm_forward_train(float* y, int64_t ldy, float* rstd, const float* x, int64_t ldx, const float* w, float eps,
                           int64_t N, int64_t D);

// Scratch for rmsnorm_backward_train's dw: double partial column sums, one row of D per chunk of
// kDwRowsPerChunk rows (0 when N or D is 0).
constexpr int64_t kDwRowsPerChunk = 128;
size_t rmsnorm_backward_workspace_bytes(int64_t N, int64_t D);

// dx [N, lddx] OVERWRITTEN (columns >= D untouched; dx may alias dy when lddx == lddy);
// dw [D] ACCUMULATED (may be null: no weight gradient); x [N, ldx] and rstd [N] from the forward;
// dy [N, lddy]. workspace: rmsnorm_backward_workspace_bytes(N, D) bytes, needed only when dw is given.
void rmsnorm_backward_train(float* dx, int64_t lddx, float* dw, const float* dy, int64_t lddy, const float* x,
                            int64_t ldx, const float* rstd, const float* w, int64_t N, int64_t D, void* workspace);

}  // namespace k3::norm::cuda
