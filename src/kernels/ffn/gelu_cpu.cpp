#include <cmath>

#include "core/parallel.h"
#include "kernels/ffn/gelu.h"

namespace k3 {

void gelu_tanh_forward(float* x, int64_t n) {
  const double c = std::sqrt(2.0 / M_PI);
  parallel_for(n, n * 20, [&](int64_t i) {
    const double v = x[i];
    x[i] = float(0.5 * v * (1.0 + std::tanh(c * (v + 0.044715 * v * v * v))));
  });
}

void gelu_erf_forward(float* x, int64_t n) {
  const double r = 1.0 / std::sqrt(2.0);
  parallel_for(n, n * 20, [&](int64_t i) {
    const double v = x[i];
    x[i] = float(0.5 * v * (1.0 + std::erf(v * r)));
  });
}

}  // namespace k3
