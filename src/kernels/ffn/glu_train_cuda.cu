// The backward of SiTU-GLU / SwiGLU on the GPU (glu_train_cuda.h). Elementwise and memory-bound: a
// grid-stride loop, one element per thread step, fp32 math with the accurate expf/tanhf.
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/ffn/glu_train_cuda.h"

namespace k3::ffn::cuda {

namespace {

// sech²(x) = 1 − tanh²(x) = 4e / (1 + e)², e = exp(−2|x|): no cancellation for large |x|.
__device__ __forceinline__ float sech2(float x) {
  const float e = expf(-2.0f * fabsf(x));
  const float d = 1.0f + e;
  return 4.0f * e / (d * d);
}

// dg may alias dh, or du may (not __restrict__): every element is read before it is written.
template <bool SITU>
__global__ void glu_backward_kernel(float* dg, float* du, const float* dh, const float* __restrict__ g,
                                    const float* __restrict__ u, int64_t n, float b1, float b2) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float d = dh[i], gv = g[i], uv = u[i];
    // σ(g) and σ(g)(1 − σ(g)) = e / (1 + e)², e = exp(−|g|) (symmetric in g).
    const float e = expf(-fabsf(gv)), den = 1.0f + e;
    const float s = (gv >= 0.0f ? 1.0f : e) / den;
    const float sp = e / (den * den);
    float pg, pu;
    if constexpr (SITU) {
      const float xg = gv / b1, xu = uv / b2;
      const float tg = tanhf(xg), tu = tanhf(xu);
      const float a = b1 * tg * s, b = b2 * tu;
      pg = (sech2(xg) * s + b1 * tg * sp) * b;
      pu = a * sech2(xu);
    } else {
      pg = uv * (s + gv * sp);
      pu = gv * s;
    }
    du[i] = d * pu;
    dg[i] = d * pg;
  }
}

}  // namespace

void glu_backward_train(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t n,
                        const GluParams& p) {
  K3_CHECK(n >= 0, "ffn::cuda::glu_backward_train: negative element count ", n);
  if (n == 0) return;
  K3_CHECK(dg && du && dh && g && u, "ffn::cuda::glu_backward_train: null pointer");
  K3_CHECK(dg != du, "ffn::cuda::glu_backward_train: dg and du must be different buffers");
  if (p.situ)
    K3_CHECK(p.beta_gate > 0.0f && p.beta_up > 0.0f, "ffn::cuda::glu_backward_train: SiTU betas must be positive, got ",
             p.beta_gate, ", ", p.beta_up);
  const int threads = 256;
  const unsigned blocks = unsigned(rowwise::grid_for(n));
  if (p.situ) glu_backward_kernel<true><<<blocks, threads>>>(dg, du, dh, g, u, n, p.beta_gate, p.beta_up);
  else glu_backward_kernel<false><<<blocks, threads>>>(dg, du, dh, g, u, n, p.beta_gate, p.beta_up);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::ffn::cuda
