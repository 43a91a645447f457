// Gated activations of K3's FFNs (dense layer 0, shared experts, routed experts).
//   SiTU-GLU(g, u) = [b1 * tanh(g / b1) * sigmoid(g)] * [b2 * tanh(u / b2)]   (K3 eq. 12; b1 = 4, b2 = 25)
//   SwiGLU(g, u)   = g * sigmoid(g) * u                                       (Kimi Linear's "silu")
// The sigmoid takes the UNCAPPED gate: only Swish's linear factor is soft-capped, so the output
// is bounded by b1*b2 and equals SwiGLU to first order near 0.
#pragma once
#include <cstdint>

namespace k3 {

struct GluParams {
  bool situ = true;
  float beta_gate = 4.0f;  // activation_situ_beta
  float beta_up = 25.0f;   // activation_situ_linear_beta
};

// out[i] = act(gate[i], up[i]) for n elements; out may alias gate or up.
void glu_forward(float* out, const float* gate, const float* up, int64_t n, const GluParams& p);

float sigmoidf_stable(float x);

// Float64, for training: act(g, u) of one element, with its partial derivatives ∂/∂g and ∂/∂u when
// dg and du are given.
double glu_forward_backward(double g, double u, const GluParams& p, double* dg = nullptr, double* du = nullptr);
// The same over n elements: h = act(g, u); and from dh = ∂L/∂h, dg = dh ∂h/∂g and du = dh ∂h/∂u
// (dg may alias dh).
void glu_forward(double* h, const double* g, const double* u, int64_t n, const GluParams& p);
void glu_backward(double* dg, double* du, const double* dh, const double* g, const double* u, int64_t n,
                  const GluParams& p);
// sigmoid(x) without overflow for large |x| (exp of a non-positive number only).
double sigmoid_stable(double x);

}  // namespace k3
