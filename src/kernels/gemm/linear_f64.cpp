#include "kernels/gemm/linear_f64.h"

#include <cblas.h>

#include <algorithm>

namespace k3 {

void linear_forward(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out) {
  if (N == 0 || out == 0) return;
  if (in == 0) {  // an empty sum (BLAS leaves y alone when k = 0 only with beta 0 on some builds)
    std::fill(y, y + N * out, 0.0);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(N), int(out), int(in), 1.0, x, int(in), W, int(in), 0.0, y,
              int(out));
}

void linear_backward(double* dx, double* dW, const double* dy, const double* x, const double* W, int64_t N, int64_t in,
                     int64_t out, bool accumulate_dx) {
  if (N == 0) return;
  if (dx && in > 0 && out == 0 && !accumulate_dx) std::fill(dx, dx + N * in, 0.0);
  if (dx && in > 0 && out > 0)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(N), int(in), int(out), 1.0, dy, int(out), W, int(in),
                accumulate_dx ? 1.0 : 0.0, dx, int(in));
  if (dW && in > 0 && out > 0)
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(N), 1.0, dy, int(out), x, int(in), 1.0,
                dW, int(in));
}

}  // namespace k3
