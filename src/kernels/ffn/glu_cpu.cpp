#include <cmath>

#include "core/parallel.h"
#include "kernels/ffn/glu.h"

namespace k3 {

float sigmoidf_stable(float x) {
  // Never forms exp of a large positive number: exp(-|x|) <= 1.
  const float e = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

void glu_forward(float* out, const float* gate, const float* up, int64_t n, const GluParams& p) {
  parallel_for(n, n, [&](int64_t i) {
    const float g = gate[i], u = up[i];
    const float s = sigmoidf_stable(g);
    out[i] =
        p.situ ? (p.beta_gate * std::tanh(g / p.beta_gate) * s) * (p.beta_up * std::tanh(u / p.beta_up)) : g * s * u;
  });
}

double sigmoid_stable(double x) {
  const double e = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

double glu_forward_backward(double g, double u, const GluParams& p, double* dg, double* du) {
  const double s = sigmoid_stable(g);
  if (p.situ) {
    // h = a(g) b(u), a = b1 tanh(g/b1) σ(g), b = b2 tanh(u/b2).
    // a' = (1 - tanh²(g/b1)) σ(g) + b1 tanh(g/b1) σ(g)(1 - σ(g));  b' = 1 - tanh²(u/b2).
    const double b1 = double(p.beta_gate), b2 = double(p.beta_up);
    const double tg = std::tanh(g / b1), tu = std::tanh(u / b2);
    const double a = b1 * tg * s, b = b2 * tu;
    if (dg) *dg = ((1.0 - tg * tg) * s + b1 * tg * s * (1.0 - s)) * b;
    if (du) *du = a * (1.0 - tu * tu);
    return a * b;
  }
  // SwiGLU: h = g σ(g) u;  ∂h/∂g = u (σ + g σ (1 - σ));  ∂h/∂u = g σ.
  if (dg) *dg = u * (s + g * s * (1.0 - s));
  if (du) *du = g * s;
  return g * s * u;
}

void glu_forward(double* h, const double* g, const double* u, int64_t n, const GluParams& p) {
  for (int64_t i = 0; i < n; ++i) h[i] = glu_forward_backward(g[i], u[i], p);
}

void glu_backward(double* dg, double* du, const double* dh, const double* g, const double* u, int64_t n,
                  const GluParams& p) {
  for (int64_t i = 0; i < n; ++i) {
    double pg, pu;
    glu_forward_backward(g[i], u[i], p, &pg, &pu);
    const double d = dh[i];
    du[i] = d * pu;
    dg[i] = d * pg;
  }
}

}  // namespace k3
