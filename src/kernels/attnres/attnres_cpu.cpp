#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/attnres/attnres.h"

namespace k3 {

void attnres_forward(float* out, const float* const* sources, int S, int64_t N, int64_t D, const float* query,
                     float eps) {
  K3_ASSERT(S >= 1);
#pragma omp parallel for schedule(static) if (N * D * S > 65536)
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> score(static_cast<size_t>(S));
    double mx = -INFINITY;
    for (int i = 0; i < S; ++i) {
      const float* v = sources[i] + n * D;
      double ss = 0.0, dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        ss += double(v[d]) * v[d];
        dot += double(v[d]) * query[d];
      }
      score[size_t(i)] = dot / std::sqrt(ss / double(D) + double(eps));
      mx = std::max(mx, score[size_t(i)]);
    }
    double z = 0.0;
    for (int i = 0; i < S; ++i) z += (score[size_t(i)] = std::exp(score[size_t(i)] - mx));
    float* o = out + n * D;
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0.0;
      for (int i = 0; i < S; ++i) acc += score[size_t(i)] * sources[i][n * D + d];
      o[d] = float(acc / z);
    }
  }
}

}  // namespace k3
