#include <cmath>

#include "kernels/ffn/glu.h"

namespace k3 {

float sigmoidf_stable(float x) {
  // Never forms exp of a large positive number: exp(-|x|) <= 1.
  const float e = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

void glu_forward(float* out, const float* gate, const float* up, int64_t n, const GluParams& p) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i], u = up[i];
    const float s = sigmoidf_stable(g);
    out[i] = p.situ ? (p.beta_gate * std::tanh(g / p.beta_gate) * s) * (p.beta_up * std::tanh(u / p.beta_up))
                    : g * s * u;
  }
}

}  // namespace k3
