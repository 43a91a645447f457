#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/norm/norm.h"

namespace k3 {

void rmsnorm_forward(float* y, const float* x, const float* weight, float eps, int64_t N, int64_t D, int64_t ld) {
  parallel_for(N, N * D, [&](int64_t n) {
    const float* xr = x + n * ld;
    float* yr = y + n * ld;
    double ss = 0.0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float r = float(1.0 / std::sqrt(ss / double(D) + double(eps)));
    if (weight)
      for (int64_t i = 0; i < D; ++i) yr[i] = weight[i] * (xr[i] * r);
    else
      for (int64_t i = 0; i < D; ++i) yr[i] = xr[i] * r;
  });
}

void rmsnorm_forward(double* y, const double* x, const double* w, double eps, int64_t N, int64_t D) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = x + n * D;
    const double r = inv_rms_f64(xr, D, eps);
    for (int64_t i = 0; i < D; ++i) y[n * D + i] = (w ? w[i] : 1.0) * xr[i] * r;
  }
}

void rmsnorm_backward(double* dx, double* dw, const double* dy, const double* x, const double* w, double eps, int64_t N,
                      int64_t D) {
  // y_i = w_i x_i r with r = (mean(x²) + eps)^(-1/2), so ∂r/∂x_j = -r³ x_j / D and
  // dx_j = r (w ⊙ dy)_j - r³ x_j Σ_i (w ⊙ dy)_i x_i / D.
  for (int64_t n = 0; n < N; ++n) {
    const double *xr = x + n * D, *g = dy + n * D;
    const double r = inv_rms_f64(xr, D, eps);
    double dot = 0.0;
    for (int64_t i = 0; i < D; ++i) dot += (w ? w[i] : 1.0) * g[i] * xr[i];
    for (int64_t i = 0; i < D; ++i) {
      dx[n * D + i] = r * (w ? w[i] : 1.0) * g[i] - r * r * r * xr[i] * dot / double(D);
      if (w && dw) dw[i] += g[i] * xr[i] * r;
    }
  }
}

void rmsnorm_forward_saved(double* y, double* xhat, double* rs, const double* x, int64_t ldx, const double* w,
                           double eps, int64_t N, int64_t D) {
  for (int64_t n = 0; n < N; ++n) {
    const double* xr = x + n * ldx;
    const double r = inv_rms_f64(xr, D, eps);
    rs[n] = r;
    for (int64_t i = 0; i < D; ++i) {
      xhat[n * D + i] = xr[i] * r;
      y[n * D + i] = (w ? w[i] : 1.0) * xhat[n * D + i];
    }
  }
}

void rmsnorm_backward_saved(double* dx, int64_t lddx, double* dw, const double* dy, const double* xhat,
                            const double* rs, const double* w, int64_t N, int64_t D) {
  // y = w ⊙ x r: dw += dy ⊙ xhat; with g = dy ⊙ w,
  //   dx_k = r g_k - r³ x_k / D Σ_i g_i x_i = r (g_k - xhat_k · mean(g ⊙ xhat)).
  std::vector<double> g(static_cast<size_t>(D));
  for (int64_t n = 0; n < N; ++n) {
    const double* dyr = dy + n * D;
    const double* xh = xhat + n * D;
    double dot = 0.0;
    for (int64_t i = 0; i < D; ++i) {
      if (dw) dw[i] += dyr[i] * xh[i];
      g[size_t(i)] = dyr[i] * (w ? w[i] : 1.0);
      dot += g[size_t(i)] * xh[i];
    }
    const double m = dot / double(D);
    for (int64_t i = 0; i < D; ++i) dx[n * lddx + i] = rs[n] * (g[size_t(i)] - xh[i] * m);
  }
}

}  // namespace k3
