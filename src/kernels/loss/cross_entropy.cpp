#include "kernels/loss/cross_entropy.h"

#include <algorithm>
#include <cmath>

namespace k3 {

namespace {

template <class T>
double log_sum_exp_t(const T* logits, int64_t V, double temperature) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits[v]) / temperature);
  double z = 0.0;
  for (int64_t v = 0; v < V; ++v) z += std::exp(double(logits[v]) / temperature - mx);
  return mx + std::log(z);
}

}  // namespace

double log_sum_exp(const float* logits, int64_t V, double temperature) { return log_sum_exp_t(logits, V, temperature); }
double log_sum_exp(const double* logits, int64_t V, double temperature) {
  return log_sum_exp_t(logits, V, temperature);
}
double log_softmax_at(const float* logits, int64_t V, int32_t id, double temperature) {
  return double(logits[id]) / temperature - log_sum_exp(logits, V, temperature);
}
double log_softmax_at(const double* logits, int64_t V, int32_t id, double temperature) {
  return logits[id] / temperature - log_sum_exp(logits, V, temperature);
}

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
    const double lse = log_sum_exp(l, V), w = row_weight ? row_weight[n] : 1.0;
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
