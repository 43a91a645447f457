// The KDA ops of the training model in float64 (K3-ARCHITECTURE.md §5.3), each forward beside its
// backward: the short causal conv with SiLU, the decay gate, the output's gated RMSNorm, the per-head L2
// norm, and the delta-rule recurrence in its token-by-token form (the reference twin of the chunked form,
// kda_chunk_f64.h). The conv and the recurrence forwards also continue a decoding sequence (a conv history,
// an initial state: model/training/engine_f64.h). The fp32 inference forms are in kda.h. Layouts are
// token-major, head-major inside a token.
#pragma once
#include <cstdint>

namespace k3::kda {

// Causal depthwise conv over T tokens of C channels, zero history: pre[t,c] = sum_j w[c,j] in[t-(K-1)+j, c]
// (tap K-1 is the current token, w [C, K]), then act = SiLU(pre). history (null: zeros) [K-1, C]: the K-1 inputs
// before token 0, oldest first (a decoding sequence's tail; the backward knows only zero history).
void conv_silu_forward(double* pre, double* act, const double* in, int64_t T, int64_t C, const double* w, int64_t K,
                       const double* history = nullptr);
// d_in [T, C] OVERWRITTEN; dw [C, K] ACCUMULATED.
void conv_silu_backward(double* d_in, double* dw, const double* d_act, const double* pre, const double* in, int64_t T,
                        int64_t C, const double* w, int64_t K);

// The lower-bounded decay gate per token and head (T tokens, H heads of D channels, [T, H*D]):
// sg = sigmoid(exp(A_log[h]) (z + dt_bias)), g = lower_bound * sg. A_log [>= H], dt_bias [H*D].
void gate_forward(double* g, double* sg, const double* z, const double* A_log, const double* dt_bias,
                  double lower_bound, int64_t T, int64_t H, int64_t D);
// From dg: dz OVERWRITTEN; dA_log (first H entries) and ddt_bias ACCUMULATED.
void gate_backward(double* dz, double* dA_log, double* ddt_bias, const double* dg, const double* sg, const double* z,
                   const double* A_log, const double* dt_bias, double lower_bound, int64_t T, int64_t H, int64_t D);

// The output's gated RMSNorm over rows of D (one per token and head, the weight shared by the heads):
// on = o * inv * w * sigmoid(gp), inv = 1/sqrt(mean(o^2) + eps), saved per row for the backward.
void gated_rmsnorm_forward(double* on, double* inv, const double* o, const double* gp, const double* w, double eps,
                           int64_t rows, int64_t D);
// From don: d_o and dgp OVERWRITTEN; dw ACCUMULATED.
void gated_rmsnorm_backward(double* d_o, double* dgp, double* dw, const double* don, const double* o, const double* inv,
                            const double* gp, const double* w, int64_t rows, int64_t D);

// L2 norm of rows of D (one per token and head): out = in * inv, inv = 1/sqrt(sum in^2 + eps).
void l2norm_forward(double* out, double* inv, const double* in, int64_t rows, int64_t D, double eps);
// d_in OVERWRITTEN (may alias d_out).
void l2norm_backward(double* d_in, const double* d_out, const double* out, const double* inv, int64_t rows, int64_t D);

// The recurrence core in its token-by-token form: the reference twin of kda_chunk_forward_f64 and
// kda_chunk_backward_f64 (kda_chunk_f64.h), with the same layouts, contract and result (to rounding). Here
// `states` ([ceil(T/state_every), H, Dk, Dv], may be nullptr in the forward) holds S_{t-1} at every
// state_every-th token, which for state_every == chunk is exactly the chunked form's chunk_states; the
// backward recomputes the states in between. Per token it does O(Dk Dv) rank-1 and matrix-vector work.
// state (null: S_0 = 0) [H, Dk, Dv]: the state before token 0 on entry, after token T-1 on return (a decoding
// sequence's; the backward knows only S_0 = 0).
void kda_recurrent_forward_f64(double* o, double* states, const double* q, const double* k, const double* v,
                               const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                               int64_t Dv, int64_t state_every, double* state = nullptr);
// Outputs OVERWRITTEN, as kda_chunk_backward_f64.
void kda_recurrent_backward_f64(double* dq, double* dk, double* dv, double* dg, double* dbeta, const double* d_o,
                                const double* states, const double* q, const double* k, const double* v,
                                const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                                int64_t Dv, int64_t state_every);

}  // namespace k3::kda
