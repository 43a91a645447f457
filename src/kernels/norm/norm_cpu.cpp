#include <cmath>

#include "kernels/norm/norm.h"

namespace k3 {

void rmsnorm_forward(float* y, const float* x, const float* weight, float eps, int64_t N, int64_t D, int64_t ld) {
#pragma omp parallel for schedule(static) if (N * D > 65536)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * ld;
    float* yr = y + n * ld;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = float(1.0 / std::sqrt(ss / double(D) + double(eps)));
    if (weight)
      for (int64_t i = 0; i < D; ++i) yr[i] = weight[i] * (xr[i] * r);
    else
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r;
  }
}

}  // namespace k3
