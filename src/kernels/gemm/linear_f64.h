// Dense float64 linear layers (the training model's, K3-ARCHITECTURE.md §5), forward and backward, on
// OpenBLAS dgemm. Weights are PyTorch's [out, in].
#pragma once
#include <cstdint>

namespace k3 {

// Batch invariance of the float64 forward: RL's deterministic mode (`k3 rl --deterministic`), in which the
// trainer's log-probabilities are the float64 engine's bit for bit. Off (the default), the forward products run on
// dgemm, whose summation order depends on the shapes, so a row's values depend, in their last bits, on how many rows
// came with it. On, linear_forward computes every output as one dot product in a fixed order (the same for any N),
// and the training KDA block runs its recurrence token by token as a decoding sequence does
// (model/training/kda_block.h). A whole sequence's forward then computes each position exactly as the engine did
// one piece at a time. Process-wide; the backward products are unaffected.
void set_f64_batch_invariant(bool on);
bool f64_batch_invariant();

// y[N, out] = x[N, in] · W[out, in]^T
void linear_forward(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out);
// dx[N, in] = dy · W (overwritten, or added to with accumulate_dx; skipped when dx is null);
// dW[out, in] += dy^T · x (skipped when dW is null).
void linear_backward(double* dx, double* dW, const double* dy, const double* x, const double* W, int64_t N, int64_t in,
                     int64_t out, bool accumulate_dx = false);

// The same over rows with strides (ldy >= out, ldx >= in, ...), for operands that are column blocks
// of wider rows (the MLA layer's [c_lat | k_rot]). The contiguous forms above call these.
// y[N, out] (row stride ldy) = x[N, in] (row stride ldx) · W^T.
void linear_forward_strided(double* y, int64_t ldy, const double* x, int64_t ldx, const double* W, int64_t N,
                            int64_t in, int64_t out);
// dx[N, in] (row stride lddx) = dy[N, out] (row stride lddy) · W, overwritten or added to with accumulate_dx.
void linear_backward_x_strided(double* dx, int64_t lddx, const double* dy, int64_t lddy, const double* W, int64_t N,
                               int64_t in, int64_t out, bool accumulate_dx = false);
// dW[out, in] += dy[N, out]^T (row stride lddy) · x[N, in] (row stride ldx).
void linear_backward_w_strided(double* dW, const double* dy, int64_t lddy, const double* x, int64_t ldx, int64_t N,
                               int64_t in, int64_t out);

}  // namespace k3
