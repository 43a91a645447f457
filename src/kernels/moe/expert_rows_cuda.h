// The routed experts of a decode step without a routing plan (bf16 expert weights): slot s = t K + k runs
// expert idx[s] on token t's latent row z[t].
//   h [T K, I] bf16 = moe_glu(z_t · w1[e]ᵀ, z_t · w3[e]ᵀ)     y [T K, L] bf16 = h_s · w2[e]ᵀ     (slot order)
// A decode step of a few sequences routes a few slots (k3-1b: 4 a token): the grouped GEMMs then run a 64-row tile
// per expert for one row, after a planning launch that sorts the slots by expert. Here a warp computes one output
// element of one slot, reading its weight row in 16-byte runs (lane l at k = 8 l, 8 l + 256, ...), fmaf in k
// order within a run and a butterfly over the lanes, as gemm::cuda::linear_rows does: a slot's bits depend on its
// token's row and its expert alone, never on how many slots the step has. The gate/up epilogue is the grouped
// GEMMs' moe_glu, so only the sums' order differs from them. Then moe::cuda::combine_rmsnorm with a null slot_of.
// Plain C++ header: device pointers, the default stream.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/moe/moe_cuda.h"

namespace k3::moe::cuda {

// Slots a call takes: a decode step's (8 sequences of top-8).
constexpr int64_t kExpertRowsMaxSlots = 64;

// "" when expert_rows_forward can take these: bf16 weights, w1 and w3 [I, L] alike, w2 [L, I], L and I multiples of
// 8, 16-byte aligned rows and strides, T K <= kExpertRowsMaxSlots.
std::string expert_rows_can_run(const ExpertLinear& w1, const ExpertLinear& w3, const ExpertLinear& w2, int64_t T,
                                int64_t K);
// h and y: caller workspace [T K, I] and [T K, L] bf16; z [T, L] bf16; idx [T, K] (the router's).
void expert_rows_forward(bf16* h, bf16* y, const bf16* z, const int32_t* idx, int64_t T, int64_t K,
                         const ExpertLinear& w1, const ExpertLinear& w3, const ExpertLinear& w2, const GluParams& glu);

}  // namespace k3::moe::cuda

#ifndef K3_HAVE_CUDA
#include "core/error.h"
namespace k3::moe::cuda {
inline std::string expert_rows_can_run(const ExpertLinear&, const ExpertLinear&, const ExpertLinear&, int64_t,
                                       int64_t) {
  return "this build has no CUDA backend";
}
inline void expert_rows_forward(bf16*, bf16*, const bf16*, const int32_t*, int64_t, int64_t, const ExpertLinear&,
                                const ExpertLinear&, const ExpertLinear&, const GluParams&) {
  fail("moe::cuda::expert_rows_forward: this build has no CUDA backend");
}
}  // namespace k3::moe::cuda
#endif
