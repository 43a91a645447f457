// Training on the GPU: the backward of the gated activations of kernels/ffn/glu.h, the fp32 twin of
// the float64 k3::glu_backward. With h = act(g, u) (SiTU-GLU or SwiGLU, GluParams as glu.h):
//   dg = dh ∂h/∂g,  du = dh ∂h/∂u
//   SiTU:   h = a b,  a = b1 tanh(g/b1) σ(g),  b = b2 tanh(u/b2)
//           ∂h/∂g = [sech²(g/b1) σ(g) + b1 tanh(g/b1) σ(g)(1 − σ(g))] b,   ∂h/∂u = a sech²(u/b2)
//   SwiGLU: ∂h/∂g = u [σ(g) + g σ(g)(1 − σ(g))],   ∂h/∂u = g σ(g)
// The forward is the existing fp32 ffn::cuda::glu_forward (glu_cuda.h): the same formula as the
// float64 glu_forward, evaluated once in fp32.
//
// Numerics: fp32, elementwise. sech²(x) is formed as 4e/(1 + e)² with e = exp(−2|x|), and σ(1 − σ)
// as e/(1 + e)² with e = exp(−|g|), never as 1 − tanh² or σ − σ²: those cancel to 0 for large |x|
// where the true value is small but not negligible against the other term.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstdint>

#include "kernels/ffn/glu.h"

namespace k3::ffn::cuda {

// dg, du [n] OVERWRITTEN (activation gradients); one of them (not both) may alias dh: each element reads
// dh[i], g[i], u[i] before it writes. g, u [n] are the activation's saved inputs. Throws k3::Error for
// n < 0, null pointers with n > 0, or SiTU betas that are not positive.
void glu_backward_train(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t n,
                        const GluParams& p);

}  // namespace k3::ffn::cuda
