// The KDA block's elementwise and per-row ops for GPU training, fp32 in and out: the CUDA twins of the
// float64 ops of kda_f64.h (conv + SiLU, decay gate, gated RMSNorm, per-head L2 norm) and of the block's
// beta = sigmoid(b), each forward beside its backward. Same formulas as the twins (eps placement, which
// sum is a mean, the sigmoid's form); tests/test_cuda_train_kda_ops.cpp checks each against its twin.
//
// Plain C++ (no CUDA headers): every pointer is a DEVICE pointer, every kernel runs on the default
// stream, and a function returns once its kernels are queued. Bad sizes or a missing pointer throw
// k3::Error naming the function and the argument.
//
// Layouts. Activations are [rows, H*D], head-major inside a row: row t, head h, channel d at
// t*H*D + h*D + d; `rows` is the total of a packed batch. The per-head ops take the same memory as
// head_rows = rows*H rows of width D. Packed sequences: cu_seqlens (device, B+1 ascending int32 row
// offsets, cu_seqlens[0] = 0, cu_seqlens[B] = rows) puts sequence b at rows [cu_seqlens[b], cu_seqlens[b+1]).
//
// Gradients. Those of activations are OVERWRITTEN; those of parameters are ACCUMULATED (+=, a step sums
// over micro-batches). Parameter gradients are sums over rows, reduced deterministically (no atomics,
// a fixed order: per 64-row chunk partial sums in float64 into the caller's workspace, then a sum of the
// partials in chunk order, rounded once to fp32 and added), so a result is bitwise identical run to run.
// The backward functions with a workspace need `..._workspace_bytes(...)` bytes of device scratch there
// (8-byte aligned; cudaMalloc memory is); nothing is allocated inside. Outputs must not alias inputs
// unless a function says they may.
#pragma once
#include <cstddef>
#include <cstdint>

namespace k3::kda::cuda {

// ---- short causal conv + SiLU (kda::conv_silu_forward / conv_silu_backward per sequence) ----------------
// Per channel c of C = H*D, K taps (1 <= K <= 8; K3's short_conv_kernel_size is 4), zero history at
// every sequence start:
//   pre[t, c] = sum_{j<K} w[c, j] in[t - (K-1) + j, c]   (tap K-1 is the current row; rows before the
//               sequence's first row count as 0),   act = SiLU(pre) = pre sigmoid(pre).
// w is [C, K]; pre and act [rows, C] are both written (pre is saved for the backward).
void conv_silu_forward_train(float* pre, float* act, const float* in, const float* w, int64_t C, int K,
                             const int32_t* cu_seqlens, int B, int64_t rows);
size_t conv_silu_backward_workspace_bytes(int64_t rows, int64_t C, int K);
// From d_act: d_in [rows, C] OVERWRITTEN (must not alias d_act: it reads later rows of it);
// dw [C, K] ACCUMULATED.
void conv_silu_backward_train(float* d_in, float* dw, const float* d_act, const float* pre, const float* in,
                              const float* w, int64_t C, int K, const int32_t* cu_seqlens, int B, int64_t rows,
                              void* workspace);
// The bf16 forms for the tensor-core recurrence (kda_chunk_train_tc_cuda.h), whose v is bf16: act written as bf16
// (uint16_t bits, rounded to nearest even from the same fp32 value), and d_act read as bf16. pre stays fp32.
void conv_silu_forward_train(float* pre, uint16_t* act, const float* in, const float* w, int64_t C, int K,
                             const int32_t* cu_seqlens, int B, int64_t rows);
void conv_silu_backward_train(float* d_in, float* dw, const uint16_t* d_act, const float* pre, const float* in,
                              const float* w, int64_t C, int K, const int32_t* cu_seqlens, int B, int64_t rows,
                              void* workspace);

// ---- the lower-bounded decay gate (kda::gate_forward / gate_backward) -----------------------------------
// sg = sigmoid(exp(A_log[h]) (z + dt_bias[h*D + d])), g = lower_bound sg, both [rows, H*D] (sg saved).
// A_log has >= H entries (only the first H are read), dt_bias [H*D]. lower_bound must be negative (K3: -5).
// Saturates cleanly: g = lower_bound exactly when the sigmoid rounds to 1, g -> 0 at the other end.
void gate_forward_train(float* g, float* sg, const float* z, const float* A_log, const float* dt_bias,
                        float lower_bound, int64_t rows, int64_t H, int64_t D);
size_t gate_backward_workspace_bytes(int64_t rows, int64_t H, int64_t D);
// From dg: dz [rows, H*D] OVERWRITTEN; dA_log [H] and ddt_bias [H*D] ACCUMULATED. With m = A (z + dt_bias),
// A = exp(A_log[h]): dm = lower_bound dg s(1 - s), dz = A dm, ddt_bias += A dm, dA_log[h] += sum dm (z + dt_bias) A.
// s(1 - s) is recomputed from m as e/(1 + e)^2, e = exp(-|m|), which keeps its relative accuracy where the
// sigmoid saturates (1 - sg rounds to 0 in fp32 once m > ~17); sg is taken for the twin's signature, not read.
void gate_backward_train(float* dz, float* dA_log, float* ddt_bias, const float* dg, const float* sg, const float* z,
                         const float* A_log, const float* dt_bias, float lower_bound, int64_t rows, int64_t H,
                         int64_t D, void* workspace);

// ---- the output's gated RMSNorm (kda::gated_rmsnorm_forward / gated_rmsnorm_backward) -----------------
// Per head row r of width D (head_rows = rows*H; the weight w [D] is shared by the heads):
//   on = o inv w sigmoid(gp),  inv[r] = 1/sqrt(mean(o^2) + eps)  (saved, [head_rows]).
void gated_rmsnorm_forward_train(float* on, float* inv, const float* o, const float* gp, const float* w, float eps,
                                 int64_t head_rows, int64_t D);
size_t gated_rmsnorm_backward_workspace_bytes(int64_t head_rows, int64_t D);
// From don: d_o and dgp [head_rows, D] OVERWRITTEN; dw [D] ACCUMULATED. With n = o inv, s = sigmoid(gp):
//   dw += don n s;  dgp = don n w s(1 - s);  dn = don w s;  d_o = inv (dn - n mean(dn n)).
void gated_rmsnorm_backward_train(float* d_o, float* dgp, float* dw, const float* don, const float* o, const float* inv,
                                  const float* gp, const float* w, int64_t head_rows, int64_t D, void* workspace);
// The same with d_o written as bf16 (the tensor-core recurrence's upstream gradient); everything else as above.
void gated_rmsnorm_backward_train(uint16_t* d_o, float* dgp, float* dw, const float* don, const float* o,
                                  const float* inv, const float* gp, const float* w, int64_t head_rows, int64_t D,
                                  void* workspace);

// ---- per-head L2 norm (kda::l2norm_forward / l2norm_backward) --------------------------------------------
// Per head row of width D: out = in inv, inv[r] = 1/sqrt(sum in^2 + eps) (saved; the block uses eps 1e-6).
void l2norm_forward_train(float* out, float* inv, const float* in, int64_t head_rows, int64_t D, float eps);
// d_in = inv (d_out - out (out . d_out)), OVERWRITTEN; d_in may alias d_out.
void l2norm_backward_train(float* d_in, const float* d_out, const float* out, const float* inv, int64_t head_rows,
                           int64_t D);
// The bf16 forms (the tensor-core recurrence's q, k and dq, dk): out written as bf16; the backward reads the
// bf16 out and d_out (d_in fp32, a separate buffer).
void l2norm_forward_train(uint16_t* out, float* inv, const float* in, int64_t head_rows, int64_t D, float eps);
void l2norm_backward_train(float* d_in, const uint16_t* d_out, const uint16_t* out, const float* inv, int64_t head_rows,
                           int64_t D);

// ---- beta = sigmoid(x), elementwise over n values ---------------------------------------------------------
// Stable for any |x| (exp of a non-positive number only). Backward dx = dbeta beta (1 - beta), OVERWRITTEN;
// dx may alias dbeta.
void sigmoid_forward_train(float* beta, const float* x, int64_t n);
void sigmoid_backward_train(float* dx, const float* dbeta, const float* beta, int64_t n);

}  // namespace k3::kda::cuda
