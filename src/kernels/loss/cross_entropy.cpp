#include "kernels/loss/cross_entropy.h"

#include <algorithm>
#include <cmath>

namespace k3 {

double cross_entropy(const double* logits, const int32_t* target, int64_t N, int64_t V, double* dlogits, double scale,
                     const double* row_weight) {
  double loss = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    const double* l = logits + n * V;
    double* dl = dlogits ? dlogits + n * V : nullptr;
    if (target[n] < 0) {
      if (dl) std::fill(dl, dl + V, 0.0);
      continue;
    }
    const double mx = *std::max_element(l, l + V);
    double z = 0.0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(l[v] - mx);
    const double lse = mx + std::log(z), w = row_weight ? row_weight[n] : 1.0;
    loss += w * (lse - l[target[n]]);
    if (dl) {
      const double s = scale * w;
      for (int64_t v = 0; v < V; ++v) dl[v] = std::exp(l[v] - lse) * s;
      dl[target[n]] -= s;
    }
  }
  return loss;
}

}  // namespace k3
