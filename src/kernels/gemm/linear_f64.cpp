#include "kernels/gemm/linear_f64.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>

namespace k3 {

namespace {

std::atomic<bool> g_batch_invariant{false};

// x·w over n terms in one fixed order, whoever calls: four interleaved partial sums (term p goes to sum p mod 4,
// which the compiler can keep in vector lanes without reordering anything), combined as (s0 + s1) + (s2 + s3),
// then the n mod 4 last terms in turn.
double fixed_order_dot(const double* x, const double* w, int64_t n) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  const int64_t n4 = n - n % 4;
  for (int64_t p = 0; p < n4; p += 4)
    for (int i = 0; i < 4; ++i) s[i] += x[p + i] * w[p + i];
  double sum = (s[0] + s[1]) + (s[2] + s[3]);
  for (int64_t p = n4; p < n; ++p) sum += x[p] * w[p];
  return sum;
}

}  // namespace

void set_f64_batch_invariant(bool on) { g_batch_invariant = on; }
bool f64_batch_invariant() { return g_batch_invariant; }

void linear_forward_strided(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t N,
                            int64_t in, int64_t out) {
  if (N == 0 || out == 0) return;
  if (in == 0) {  // an empty sum (BLAS leaves y alone when k = 0 only with beta 0 on some builds)
    for (int64_t n = 0; n < N; ++n) std::fill(y + n * ldy, y + n * ldy + out, 0.0);
    return;
  }
  if (g_batch_invariant) {  // each output by itself; threads split the work, not the sums
#pragma omp parallel for collapse(2) schedule(static) if (N * out * in > (int64_t(1) << 16))
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < out; ++o) y[n * ldy + o] = fixed_order_dot(x + n * ldx, W + o * in, in);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(N), int(out), int(in), 1.0, x, int(ldx), W, int(in), 0.0, y,
              int(ldy));
}

void linear_backward_x_strided(double* dx, int64_t lddx, const double* dy, int64_t lddy, const double* W, int64_t N,
                               int64_t in, int64_t out, bool accumulate_dx) {
  if (N == 0 || in == 0) return;
  if (out == 0) {  // an empty sum: dx = 0, or unchanged when accumulating
    if (!accumulate_dx)
      for (int64_t n = 0; n < N; ++n) std::fill(dx + n * lddx, dx + n * lddx + in, 0.0);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(N), int(in), int(out), 1.0, dy, int(lddy), W, int(in),
              accumulate_dx ? 1.0 : 0.0, dx, int(lddx));
}

void linear_backward_w_strided(double* dW, const double* dy, int64_t lddy, const double* x, int64_t ldx, int64_t N,
                               int64_t in, int64_t out) {
  if (N == 0 || in == 0 || out == 0) return;
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(N), 1.0, dy, int(lddy), x, int(ldx), 1.0,
              dW, int(in));
}

void linear_forward(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out) {
  linear_forward_strided(y, out, x, in, W, N, in, out);
}

void linear_backward(double* dx, double* dW, const double* dy, const double* x, const double* W, int64_t N, int64_t in,
                     int64_t out, bool accumulate_dx) {
  if (dx) linear_backward_x_strided(dx, in, dy, out, W, N, in, out, accumulate_dx);
  if (dW) linear_backward_w_strided(dW, dy, out, x, in, N, in, out);
}

}  // namespace k3
