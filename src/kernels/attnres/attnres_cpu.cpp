#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/attnres/attnres.h"

namespace k3 {

void attnres_forward(float* out, const float* const* sources, int S, int64_t N, int64_t D, const float* query,
                     float eps) {
  K3_ASSERT(S >= 1);
  parallel_for(N, N * D * S, [&](int64_t n) {
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
  });
}

namespace {

// Scores and mixing weights of one row: score_i, rms_i, α_i.
void attnres_row(std::vector<double>& score, std::vector<double>& rms, std::vector<double>& alpha,
                 const std::vector<const double*>& src, const double* q, double eps, int64_t n, int64_t D) {
  const size_t S = src.size();
  double mx = -INFINITY;
  for (size_t i = 0; i < S; ++i) {
    const double* v = src[i] + n * D;
    double ss = 0.0, dot = 0.0;
    for (int64_t d = 0; d < D; ++d) {
      ss += v[d] * v[d];
      dot += v[d] * q[d];
    }
    rms[i] = std::sqrt(ss / double(D) + eps);
    score[i] = dot / rms[i];
    mx = std::max(mx, score[i]);
  }
  double z = 0.0;
  for (size_t i = 0; i < S; ++i) z += (alpha[i] = std::exp(score[i] - mx));
  for (size_t i = 0; i < S; ++i) alpha[i] /= z;
}

}  // namespace

void attnres_forward(double* out, const std::vector<const double*>& src, const double* q, double eps, int64_t N,
                     int64_t D) {
  const size_t S = src.size();
  std::vector<double> score(S), rms(S), alpha(S);
  for (int64_t n = 0; n < N; ++n) {
    attnres_row(score, rms, alpha, src, q, eps, n, D);
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0.0;
      for (size_t i = 0; i < S; ++i) acc += alpha[i] * src[i][n * D + d];
      out[n * D + d] = acc;
    }
  }
}

void attnres_backward(const std::vector<double*>& dsrc, double* dq, const double* dout,
                      const std::vector<const double*>& src, const double* q, double eps, int64_t N, int64_t D) {
  const size_t S = src.size();
  std::vector<double> score(S), rms(S), alpha(S), dalpha(S);
  for (int64_t n = 0; n < N; ++n) {
    attnres_row(score, rms, alpha, src, q, eps, n, D);
    const double* g = dout + n * D;
    // out = Σ α_i v_i: ∂/∂α_i = g · v_i, and v_i gets α_i g directly.
    double mean = 0.0;
    for (size_t i = 0; i < S; ++i) {
      double a = 0.0;
      for (int64_t d = 0; d < D; ++d) a += g[d] * src[i][n * D + d];
      dalpha[i] = a;
      mean += alpha[i] * a;
    }
    for (size_t i = 0; i < S; ++i) {
      const double* v = src[i] + n * D;
      double* dv = dsrc[i] + n * D;
      // softmax: ∂score_i = α_i (∂α_i - Σ_j α_j ∂α_j); score_i = (v_i·q) / rms_i with
      // rms_i = sqrt(mean(v_i²) + eps): ∂v_i += ∂score_i (q / rms_i - (v_i·q) v_i / (D rms_i³)).
      const double ds = alpha[i] * (dalpha[i] - mean);
      const double dot = score[i] * rms[i];
      const double a = ds / rms[i], b = ds * dot / (double(D) * rms[i] * rms[i] * rms[i]);
      for (int64_t d = 0; d < D; ++d) {
        dv[d] += alpha[i] * g[d] + a * q[d] - b * v[d];
        dq[d] += a * v[d];
      }
    }
  }
}

}  // namespace k3
