// The routed experts of a decode step without a routing plan (expert_rows_cuda.h).
#include <climits>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/moe/expert_rows_cuda.h"
#include "kernels/moe/moe_gemm_sm90.cuh"

namespace k3::moe::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

// Σ_k x[k] w[k] over k < K, lane l taking the 16-byte runs at k = 8 l, 8 l + 256, ... (fmaf in k order within a
// run); the lanes' partial sums, not yet added.
__device__ __forceinline__ float lane_dot(const bf16* __restrict__ w, const bf16* __restrict__ x, int K, int lane) {
  float acc = 0.0f;
  for (int k = 8 * lane; k < K; k += 256) {
    float wf[8], xf[8];
    rowwise::bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(w + k)), wf);
    rowwise::bf16x8_to_f32(__ldg(reinterpret_cast<const uint4*>(x + k)), xf);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(xf[i], wf[i], acc);
  }
  return acc;
}

// h[s, n] = moe_glu(z[t] · w1[e][n], z[t] · w3[e][n]): a warp per (slot, n).
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    expert_gate_up_rows_kernel(bf16* __restrict__ h, const bf16* __restrict__ z, const int32_t* __restrict__ idx,
                               const unsigned char* __restrict__ w1, const unsigned char* __restrict__ w3,
                               int64_t stride, int I, int L, int S, int K, GluConsts glu) {
  pdl::wait_then_release();
  const int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = int(threadIdx.x & 31);
  if (g >= int64_t(S) * I) return;
  const int s = int(g / I), n = int(g % I);
  const int64_t e = idx[s];
  const bf16* x = z + int64_t(s / K) * L;
  const float gs =
      rowwise::warp_sum(lane_dot(reinterpret_cast<const bf16*>(w1 + e * stride) + int64_t(n) * L, x, L, lane));
  const float us =
      rowwise::warp_sum(lane_dot(reinterpret_cast<const bf16*>(w3 + e * stride) + int64_t(n) * L, x, L, lane));
  if (lane == 0) h[g] = rowwise::f32_to_bf16_rne(moe_glu(gs, us, glu));
}

// y[s, l] = h[s] · w2[e][l]: a warp per (slot, l).
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    expert_down_rows_kernel(bf16* __restrict__ y, const bf16* __restrict__ h, const int32_t* __restrict__ idx,
                            const unsigned char* __restrict__ w2, int64_t stride, int L, int I, int S) {
  pdl::wait_then_release();
  const int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = int(threadIdx.x & 31);
  if (g >= int64_t(S) * L) return;
  const int s = int(g / L), l = int(g % L);
  const int64_t e = idx[s];
  const float v = rowwise::warp_sum(
      lane_dot(reinterpret_cast<const bf16*>(w2 + e * stride) + int64_t(l) * I, h + int64_t(s) * I, I, lane));
  if (lane == 0) y[g] = rowwise::f32_to_bf16_rne(v);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned blocks_for(int64_t warps) { return unsigned((warps + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

std::string expert_rows_can_run(const ExpertLinear& w1, const ExpertLinear& w3, const ExpertLinear& w2, int64_t T,
                                int64_t K) {
  using F = ExpertLinear::Format;
  if (w1.format != F::BF16 || w3.format != F::BF16 || w2.format != F::BF16)
    return "expert_rows: the expert weights must be bf16";
  if (!w1.data || !w3.data || !w2.data) return "expert_rows: null expert weights";
  if (w1.rows != w3.rows || w1.cols != w3.cols || w1.expert_stride != w3.expert_stride)
    return "expert_rows: gate and up weights must have the same shape and stride";
  if (w2.rows != w1.cols || w2.cols != w1.rows) return "expert_rows: w2 must be [L, I] for w1 [I, L]";
  if (w1.rows < 8 || w1.rows % 8 || w1.cols < 8 || w1.cols % 8 || w1.rows > INT_MAX || w1.cols > INT_MAX)
    return "expert_rows: I = " + std::to_string(w1.rows) + " and L = " + std::to_string(w1.cols) +
           " must be positive multiples of 8";
  for (const ExpertLinear* w : {&w1, &w3, &w2})
    if (!aligned16(w->data) || w->expert_stride % 16) return "expert_rows: weights and strides must be 16-byte aligned";
  if (T < 0 || K < 1 || T * K > kExpertRowsMaxSlots)
    return "expert_rows: T = " + std::to_string(T) + " tokens of K = " + std::to_string(K) + " slots, at most " +
           std::to_string(kExpertRowsMaxSlots) + " slots";
  return {};
}

void expert_rows_forward(bf16* h, bf16* y, const bf16* z, const int32_t* idx, int64_t T, int64_t K,
                         const ExpertLinear& w1, const ExpertLinear& w3, const ExpertLinear& w2, const GluParams& glu) {
  const std::string why = expert_rows_can_run(w1, w3, w2, T, K);
  if (!why.empty()) fail("moe::cuda::", why);
  K3_CHECK(aligned16(z) && aligned16(h), "moe::cuda::expert_rows: z and h must be 16-byte aligned");
  const int S = int(T * K), I = int(w1.rows), L = int(w1.cols);
  if (S == 0) return;
  pdl::launch(expert_gate_up_rows_kernel, blocks_for(int64_t(S) * I), 32 * kWarpsPerBlock, 0, h, z, idx,
              static_cast<const unsigned char*>(w1.data), static_cast<const unsigned char*>(w3.data), w1.expert_stride,
              I, L, S, int(K), glu_consts(glu));
  pdl::launch(expert_down_rows_kernel, blocks_for(int64_t(S) * L), 32 * kWarpsPerBlock, 0, y, h, idx,
              static_cast<const unsigned char*>(w2.data), w2.expert_stride, L, I, S);
}

}  // namespace k3::moe::cuda
