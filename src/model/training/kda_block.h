// Training forward/backward of the KDA attention block (K3-ARCHITECTURE.md §5.3), float64.
//
// The forward computes exactly what src/model/kda_layer.cpp (inference, one fresh sequence) computes:
//   qp = Wq x, kp = Wk x, vp = Wv x                           [T, HD]   (HD = H*D, head-major)
//   q = SiLU(conv(qp)), k = SiLU(conv(kp)), v = SiLU(conv(vp))   causal depthwise conv, K taps, zero history
//   q, k <- per-head L2 normalised (sum of squares, eps 1e-6)
//   beta = sigmoid(Wb x)                                      [T, H]
//   z = Wfb (Wfa x);  g = lower_bound * sigmoid(exp(A_log[h]) * (z + dt_bias))   [T, HD], alpha = exp(g)
//   per head, S_0 = 0 (D x D, key-major):
//     S' = Diag(alpha_t) S_{t-1};  u = S'^T k_t;  S_t = S' + beta_t k_t (v_t - u)^T;  o_t = S_t^T q_t / sqrt(D)
//   y = Wo ( RMSNorm_head(o; o_norm, rms_norm_eps) * sigmoid(Wg x) )
// The recurrence (between the normalised q, k, v, beta, g and o) runs in the chunked form of kernels/kda/kda_chunk_f64.h,
// forward and backward (matrix-matrix work per 16-token chunk; the backward differentiates the chunked
// form directly). The token-by-token recurrent form is kept below as the reference twin
// (kernels/kda/kda_f64.h: kda_recurrent_forward_f64 / kda_recurrent_backward_f64): the tests compare the two, and a tape can
// select it (KdaBlockTape::recurrent_reference).
//
// Parameters: the KDA kinds of the tensor table (model/tensor_table.h), named under `prefix` (the
// layer's, e.g. "language_model.model.layers.3.") by tensor_name_at:
//   KdaQ/KdaK/KdaV [HD, hidden]   KdaQConv/KdaKConv/KdaVConv [HD, 1, K] (or [HD, K])   KdaFA [D, hidden]
//   KdaFB [HD, D]   KdaB [H, hidden]   KdaG [HD, hidden]   KdaO [hidden, HD]   KdaDtBias [HD]   KdaONorm [D]
//   KdaALog [>= H] (padded; only the first H are used and only they receive gradient)
//
// Memory of the tape: ~20 arrays of T*HD doubles plus the recurrent state S_{t-1} at every
// `state_every`-th token (T/state_every * H*D*D doubles). In the chunked form state_every is the chunk
// size and these are the states entering the chunks; the backward recomputes each chunk from its state
// (O(chunk * D) scratch per head). The recurrent twin recomputes the states between two checkpoints
// (state_every * H*D*D scratch). Either way memory is O(T*H*D + (T/state_every + state_every)*H*D*D).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"

namespace k3::train {

struct KdaBlockTape {
  // Tokens between two saved recurrent states: the chunk size of the chunked form (default K3's 16), or
  // the checkpoint spacing of the recurrent twin (1: every state saved, nothing recomputed). Set it
  // before kda_block_forward; the backward uses the forward's. The result does not depend on it beyond
  // rounding.
  int64_t state_every = 16;
  // true: the forward and backward run the token-by-token recurrence (the reference twin) instead of
  // the chunked form. Set before kda_block_forward, which also sets it while the float64 forward is batch
  // invariant (kernels/gemm/linear_f64.h: set_f64_batch_invariant).
  bool recurrent_reference = false;

  // Filled by kda_block_forward.
  int64_t T = 0;
  std::vector<double> x;             // [T, hidden] block input
  std::vector<double> qp, kp, vp;    // [T, HD] projections (conv inputs)
  std::vector<double> qc, kc, vc;    // [T, HD] conv outputs (SiLU inputs)
  std::vector<double> qs, ks;        // [T, HD] SiLU outputs of q, k (L2-norm inputs)
  std::vector<double> q_inv, k_inv;  // [T, H] 1/sqrt(sum^2 + 1e-6) per head
  std::vector<double> q, k, v;       // [T, HD] recurrence inputs (q, k normalised)
  std::vector<double> beta;          // [T, H]
  std::vector<double> fa;            // [T, D] the decay gate's first projection (rank D)
  std::vector<double> z;             // [T, HD] f_b_proj output (gate pre-activation before dt_bias)
  std::vector<double> sg;            // [T, HD] sigmoid(exp(A_log) (z + dt_bias)); g = lower_bound * sg
  std::vector<double> g;             // [T, HD] log decay
  std::vector<double> o;             // [T, HD] recurrence output (before the gated norm)
  std::vector<double> o_inv;         // [T, H] 1/sqrt(mean(o^2) + eps) per head
  std::vector<double> gp;            // [T, HD] output-gate pre-activation (g_proj x)
  std::vector<double> on;            // [T, HD] o_proj input (normalised, gated)
  std::vector<double> states;        // [ceil(T/state_every), H, D, D] S_{t-1} at t = 0, state_every, ...
};

// What a decoding sequence carries from one forward to the next (model/training/engine_f64.h): the last K-1
// inputs of each short conv, oldest first, and the recurrent state. Empty: a fresh sequence (zeros).
struct KdaDecodeState {
  std::vector<double> q_tail, k_tail, v_tail;  // [K-1, HD]
  std::vector<double> S;                       // [H, D, D], key-major
};

// x: [T, hidden] (the normalised block input); y: [T, hidden] (overwritten). tape may be nullptr.
// state (decoding, with no tape): the T tokens continue the sequence `state` describes, and `state` then holds
// them too. The recurrence then runs in the token-by-token form, which continues a state.
// Throws k3::Error naming the tensor on a missing or mis-sized parameter, or on a bad config/layer.
void kda_block_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, KdaBlockTape* tape, KdaDecodeState* state = nullptr);

// dy: [T, hidden]; dx: [T, hidden] (OVERWRITTEN). Parameter gradients are ACCUMULATED into P.g(...).
void kda_block_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                        const KdaBlockTape& tape, const double* dy, double* dx);

}  // namespace k3::train
