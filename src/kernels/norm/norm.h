// RMSNorm over rows. y = weight * x / sqrt(mean(x^2) + eps); weight may be null (plain RMS
// normalisation, as AttnRes keys use). The sum of squares is accumulated in double (ggml's habit):
// cheap, and it makes the reduction order irrelevant at fp32 output precision.
#pragma once
#include <cmath>
#include <cstdint>

namespace k3 {

// x and y may alias. Rows have stride ld (>= D) in both.
void rmsnorm_forward(float* y, const float* x, const float* weight, float eps, int64_t N, int64_t D, int64_t ld);
inline void rmsnorm_forward(float* y, const float* x, const float* weight, float eps, int64_t N, int64_t D) {
  rmsnorm_forward(y, x, weight, eps, N, D, D);
}

// 1 / sqrt(mean(x²) + eps) of one row of D, the sum of squares in order: the one definition every
// float64 RMS normalisation here uses (plain, with saved statistics, KDA's gated output norm).
inline double inv_rms_f64(const double* x, int64_t D, double eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  return 1.0 / std::sqrt(ss / double(D) + eps);
}

// Float64, for training: y = w ⊙ x / sqrt(mean(x²) + eps) ([N, D], w may be null), and its backward:
// dx overwritten, dw accumulated (when both w and dw are given).
void rmsnorm_forward(double* y, const double* x, const double* w, double eps, int64_t N, int64_t D);
void rmsnorm_backward(double* dx, double* dw, const double* dy, const double* x, const double* w, double eps, int64_t N,
                      int64_t D);

// Float64 with saved statistics, for a layer's backward (the MLA norms). Rows of x have stride ldx;
// xhat = x r with r = 1/sqrt(mean(x²) + eps) per row, y = w ⊙ xhat; y and xhat are [N, D], rs [N]
// holds r. w may be null (ones).
void rmsnorm_forward_saved(double* y, double* xhat, double* rs, const double* x, int64_t ldx, const double* w,
                           double eps, int64_t N, int64_t D);
// Its backward from xhat and rs: with g = dy ⊙ w, dx = r (g - xhat · mean(g ⊙ xhat)) (∂r/∂x_k = -r³ x_k / D).
// dx OVERWRITTEN in rows of stride lddx (other columns left alone); dw += Σ_rows dy ⊙ xhat (skipped when null).
void rmsnorm_backward_saved(double* dx, int64_t lddx, double* dw, const double* dy, const double* xhat,
                            const double* rs, const double* w, int64_t N, int64_t D);

}  // namespace k3
