#include "train/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>

namespace k3::train {

void linear_fwd(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out) {
  if (N == 0) return;
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(N), int(out), int(in), 1.0, x, int(in), W, int(in), 0.0, y,
              int(out));
}

void linear_bwd(double* dx, double* dW, const double* dy, const double* x, const double* W, int64_t N, int64_t in,
                int64_t out) {
  if (N == 0) return;
  if (dx)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(N), int(in), int(out), 1.0, dy, int(out), W, int(in), 0.0,
                dx, int(in));
  if (dW)
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(N), 1.0, dy, int(out), x, int(in), 1.0, dW,
                int(in));
}

void rmsnorm_fwd(double* y, const double* x, const double* w, double eps, int64_t N, int64_t D) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = x + n * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const double r = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t i = 0; i < D; ++i) y[n * D + i] = (w ? w[i] : 1.0) * xr[i] * r;
  }
}

void rmsnorm_bwd(double* dx, double* dw, const double* dy, const double* x, const double* w, double eps, int64_t N,
                 int64_t D) {
  // y_i = w_i x_i r with r = (mean(x²) + eps)^(-1/2), so ∂r/∂x_j = -r³ x_j / D and
  // dx_j = r (w ⊙ dy)_j - r³ x_j Σ_i (w ⊙ dy)_i x_i / D.
  for (int64_t n = 0; n < N; ++n) {
    const double *xr = x + n * D, *g = dy + n * D;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const double r = 1.0 / std::sqrt(ss / double(D) + eps);
    double dot = 0.0;
    for (int64_t i = 0; i < D; ++i) dot += (w ? w[i] : 1.0) * g[i] * xr[i];
    for (int64_t i = 0; i < D; ++i) {
      dx[n * D + i] = r * (w ? w[i] : 1.0) * g[i] - r * r * r * xr[i] * dot / double(D);
      if (w && dw) dw[i] += g[i] * xr[i] * r;
    }
  }
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

void attnres_fwd(double* out, const std::vector<const double*>& src, const double* q, double eps, int64_t N, int64_t D) {
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

void attnres_bwd(const std::vector<double*>& dsrc, double* dq, const double* dout, const std::vector<const double*>& src,
                 const double* q, double eps, int64_t N, int64_t D) {
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

double cross_entropy(const double* logits, const int32_t* target, int64_t N, int64_t V, double* dlogits, double scale) {
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
    const double lse = mx + std::log(z);
    loss += lse - l[target[n]];
    if (dl) {
      for (int64_t v = 0; v < V; ++v) dl[v] = std::exp(l[v] - lse) * scale;
      dl[target[n]] -= scale;
    }
  }
  return loss;
}

}  // namespace k3::train
