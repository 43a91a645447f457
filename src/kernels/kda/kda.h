// Kimi Delta Attention (KDA): CPU reference kernels (fp32 activations, fp64 state and internals) (K3-ARCHITECTURE.md §5.3, K3-TECHNIQUES.md (e)).
//
// A KDA layer, per token, after the q/k/v/f/b/g projections (which live elsewhere):
//   1. short_conv_silu_forward  q, k, v each go through a causal depthwise conv (K = 4 taps, no bias) + SiLU.
//                               Decode carries the last K-1 PRE-conv inputs per channel ("tail").
//   2. l2norm_heads             q and k are L2-normalised per head (sum of squares, eps 1e-6). v is not.
//   3. gate_forward             lower-bounded decay g = -5 * sigmoid(exp(A_log[h]) * (z + dt_bias)), alpha = exp(g).
//                               (beta = sigmoid(b_proj x) is a plain sigmoid done by the caller.)
//   4. kda_recurrent_forward    the delta-rule recurrence; this is THE specification of KDA.
//      kda_chunk_forward        the same result computed chunk-wise (WY/UT form); the prefill path.
//   5. gated_rmsnorm_forward    per-head RMSNorm (weight shared by heads), then * sigmoid(gate).
//
// Conventions. All tensors are fp32, row-major and token-major: an activation x[T][H*D] stores channel
// h*D + d of token t at x[t*H*D + h*D + d] (so [T][H][D] and [T][H*D] are the same memory). Output
// buffers must not alias inputs unless a function says it works in place. T = 0 is a no-op; H, D, C,
// K and chunk_size must be >= 1 (violations throw k3::Error naming the argument).
//
// Threading: the heavy kernels split their heads (or tokens) over OpenMP's threads with parallel_for
// (core/parallel.h). Each head (or row) is computed by one thread, so results do not depend on the thread count.
// Not here: the projections, beta = sigmoid(b_proj x), varlen batching, bf16 storage, the CUDA path.
#pragma once
#include <cstdint>

namespace k3::kda {

// Causal depthwise conv (K taps, no bias) followed by SiLU, over T tokens of C channels.
//   out, x: [T][C]      weight: [C][K] (weight[c*K + j])      tail: [K-1][C] or nullptr
// Tap j multiplies input t-(K-1)+j (tap K-1 is the current token).
// tail holds the previous K-1 PRE-conv inputs (oldest first); nullptr means zeros (fresh sequence).
// If tail != nullptr it is updated in place to the last K-1 inputs after these T tokens (also when
// T < K-1, in which case part of the old tail survives, shifted). out must not alias x or tail.
void short_conv_silu_forward(float* out, const float* x, int64_t T, int64_t C, const float* weight, int K, float* tail);

// In place per-head L2 normalisation, x: [T][H][D]:  x <- x / sqrt(sum_d x^2 + eps).  (K3: eps = 1e-6)
void l2norm_heads(float* x, int64_t T, int64_t H, int64_t D, float eps);

// Lower-bounded decay gate, K3 form (Eq. 5):
//   g[t,h,d] = lower_bound * sigmoid(exp(A_log[h]) * (z[t,h*D+d] + dt_bias[h*D+d]))
//   g, z: [T][H][D]     A_log: [H] (per head; the checkpoint pads it to 128, pass the first H)
//   dt_bias: [H*D]      lower_bound < 0 (K3: -5), so g lies in [lower_bound, 0] and alpha = exp(g) >= e^lower_bound.
void gate_forward(float* g, const float* z, const float* A_log, const float* dt_bias, float lower_bound, int64_t T,
                  int64_t H, int64_t D);

// The KDA recurrence (the specification). Per head h the state S[h] is Dk x Dv, key-major:
// S[h][c][j] lives at state[(h*Dk + c)*Dv + j]. For each token t:
//   S <- Diag(exp(g_t)) S;   u = S^T k_t;   S <- S + beta_t * k_t (v_t - u)^T;   o_t = S^T (q_t * scale)
//   q, k, g: [T][H][Dk]    v, o: [T][H][Dv]    beta: [T][H]    state: [H][Dk][Dv] fp64, in/out
// The caller zero-initialises state for a fresh sequence; calls can be chained to continue a sequence.
// K3: scale = Dk^-0.5.
void kda_recurrent_forward(float* o, const float* q, const float* k, const float* v, const float* g, const float* beta,
                           float scale, double* state, int64_t T, int64_t H, int64_t Dk, int64_t Dv);

// Same contract and result as kda_recurrent_forward, computed chunk by chunk (chunk_size >= 1; the last
// chunk may be shorter). Within a chunk, Gamma_t = sum of g from the chunk start through t (per key
// channel). With S0 the state entering the chunk, Ktilde_i = exp(Gamma_i) * k_i and, for j < i,
//   A_ij = sum_c k_i[c] k_j[c] exp(Gamma_i[c] - Gamma_j[c]),
// solve (I + diag(beta) StrictLower(A)) delta = diag(beta) (V - Ktilde S0) by forward substitution; then
//   o_t   = scale * [ S0^T (exp(Gamma_t) * q_t) + sum_{i<=t} (q_t . (k_i * exp(Gamma_t - Gamma_i))) delta_i ]
//   S_end = Diag(exp(Gamma_last)) S0 + sum_i Diag(exp(Gamma_last - Gamma_i)) k_i delta_i^T.
// Only differences Gamma_i - Gamma_j with j <= i are ever exponentiated (see kda_cpu.cpp for why), so any
// chunk size is overflow-free provided g <= 0 (a log-decay; gate_forward guarantees it). Decay factors below
// 2^-70 are treated as 0 (invisible at fp32 resolution; keeps denormals out of the matmuls). Matches the
// recurrence to ~2e-7 relative L2 in the tests. Allocates ~(5 Dk + 2 Dv + 2 chunk) * chunk floats of scratch
// per head per call (~256 KB at chunk 64, Dk = Dv = 128).
void kda_chunk_forward(float* o, const float* q, const float* k, const float* v, const float* g, const float* beta,
                       float scale, double* state, int64_t T, int64_t H, int64_t Dk, int64_t Dv, int chunk_size);

// Per-head gated output norm, K3's FusedRMSNormGated(activation="sigmoid"): normalise, then gate.
//   y[t,h,:] = o[t,h,:] / sqrt(mean(o[t,h,:]^2) + eps) * weight[:] * sigmoid(gate[t, h*Dv + :])
//   y, o, gate: [T][H][Dv]     weight: [Dv] (o_norm.weight, shared by all heads)     K3: eps = 1e-5
// y may alias o (each head row is read completely before it is written).
void gated_rmsnorm_forward(float* y, const float* o, const float* gate, const float* weight, float eps, int64_t T,
                           int64_t H, int64_t Dv);

}  // namespace k3::kda
