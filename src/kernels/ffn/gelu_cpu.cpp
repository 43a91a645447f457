#include <cmath>

#include "core/parallel.h"
#include "kernels/ffn/gelu.h"

namespace k3 {

namespace {

constexpr double kTanhCubic = 0.044715;
const double kSqrt2OverPi = std::sqrt(2.0 / M_PI);
const double kInvSqrt2 = 1.0 / std::sqrt(2.0);

double gelu_tanh(double v) { return 0.5 * v * (1.0 + std::tanh(kSqrt2OverPi * (v + kTanhCubic * v * v * v))); }
double gelu_tanh_grad(double v) {
  const double t = std::tanh(kSqrt2OverPi * (v + kTanhCubic * v * v * v));
  return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * kTanhCubic * v * v);
}

double gelu_erf(double v) { return 0.5 * v * (1.0 + std::erf(v * kInvSqrt2)); }
double gelu_erf_grad(double v) {
  return 0.5 * (1.0 + std::erf(v * kInvSqrt2)) + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * M_PI);
}

}  // namespace

void gelu_tanh_forward(float* x, int64_t n) {
  parallel_for(n, n * 20, [&](int64_t i) { x[i] = float(gelu_tanh(x[i])); });
}

void gelu_erf_forward(float* x, int64_t n) {
  parallel_for(n, n * 20, [&](int64_t i) { x[i] = float(gelu_erf(x[i])); });
}

void gelu_tanh_forward(double* y, const double* x, int64_t n) {
  parallel_for(n, n * 20, [&](int64_t i) { y[i] = gelu_tanh(x[i]); });
}

void gelu_tanh_backward(double* dx, const double* dy, const double* x, int64_t n) {
  parallel_for(n, n * 30, [&](int64_t i) { dx[i] = dy[i] * gelu_tanh_grad(x[i]); });
}

void gelu_erf_forward(double* y, const double* x, int64_t n) {
  parallel_for(n, n * 20, [&](int64_t i) { y[i] = gelu_erf(x[i]); });
}

void gelu_erf_backward(double* dx, const double* dy, const double* x, int64_t n) {
  parallel_for(n, n * 30, [&](int64_t i) { dx[i] = dy[i] * gelu_erf_grad(x[i]); });
}

}  // namespace k3
