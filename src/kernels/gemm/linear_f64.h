// Dense float64 linear layers (the training model's, K3-ARCHITECTURE.md §5), forward and backward, on
// OpenBLAS dgemm. Weights are PyTorch's [out, in].
#pragma once
#include <cstdint>

namespace k3 {

// y[N, out] = x[N, in] · W[out, in]^T
void linear_forward(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out);
// dx[N, in] = dy · W (overwritten, or added to with accumulate_dx; skipped when dx is null);
// dW[out, in] += dy^T · x (skipped when dW is null).
void linear_backward(double* dx, double* dW, const double* dy, const double* x, const double* W, int64_t N, int64_t in,
                     int64_t out, bool accumulate_dx = false);

}  // namespace k3
