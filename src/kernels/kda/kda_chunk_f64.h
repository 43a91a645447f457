// The KDA delta-rule recurrence in float64, chunked (WY/UT) form: forward and backward, for training.
//
// This is the recurrence core of the training KDA block (model/training/kda_block.h), i.e. only the part between the
// normalised, gated inputs and the per-head output; the projections, convs, norms and gates live there.
// Per head h, with the state S (Dk x Dv, key-major: S[c][j]) starting at 0 at the sequence start:
//   S' = Diag(exp(g_t)) S_{t-1};   u_t = beta_t (v_t - S'^T k_t);   S_t = S' + k_t u_t^T;   o_t = S_t^T (scale q_t)
// which is what kda_recurrent_forward_f64 (kda_f64.h, the token-by-token reference twin) computes.
//
// The chunked form (the inference prefill's, src/kernels/kda/kda.h kda_chunk_forward) computes the same
// result chunk by chunk. In a chunk of n <= C tokens (local index r = 0..n-1), with S0 the state entering
// it, Q = scale q (rows), Gamma_r = g_0 + ... + g_r (per key channel, from the chunk start) and, for s <= r,
// the pair decay W_rs = exp(Gamma_r - Gamma_s) (a vector over the key channels; W_rr = 1):
//   A_rs = sum_d k_r[d] k_s[d] W_rs[d]  (s < r)        M_rs = sum_d Q_r[d] k_s[d] W_rs[d]  (s <= r)
//   X_r  = v_r - (exp(Gamma_r) * k_r)^T S0 - sum_{s<r} A_rs u_s,   u_r = beta_r X_r
//          (forward substitution of (I + diag(beta) A) U = diag(beta) (V - Ktilde S0), unit lower triangular)
//   o_r  = S0^T (exp(Gamma_r) * Q_r) + sum_{s<=r} M_rs u_s
//   S_end = Diag(exp(Gamma_{n-1})) S0 + sum_s Diag(exp(Gamma_{n-1} - Gamma_s)) k_s u_s^T
// (Unroll S_r = Diag(exp(Gamma_r)) S0 + sum_{s<=r} Diag(W_rs) k_s u_s^T and substitute S_{r-1} into u_r.)
// Most of the work is then products of n x D blocks with D x D states, instead of D x D rank-1
// updates per token; the pairwise n x n x Dk terms remain as vectorised loops.
//
// The backward differentiates the chunked form directly (not the recurrence), chunk by chunk in reverse,
// carrying dS (the gradient w.r.t. the state leaving a chunk) between chunks. The derivation is in
// kda_chunk_f64.cpp. Every chunk is recomputed from its entering state, so the forward saves only that state
// per chunk: ceil(T/C) * H * Dk * Dv doubles (1/C of the per-token states; at C = 16, D = 64, H = 6 that
// is 12 KB per token).
//
// Layouts (as in the training KDA block): token-major, head-major inside a token:
//   q, k, g: [T, H*Dk]    v, o: [T, H*Dv]    beta: [T, H]    chunk_states: [ceil(T/C), H, Dk, Dv]
// g is the per-token log decay (<= 0 for KDA's gate; any finite g works, see kda_chunk_f64.cpp for the
// numerics). Output buffers must not alias inputs. T = 0 is a no-op. Heads run in parallel
// (`omp parallel for`), one thread per head, so results do not depend on the thread count.
#pragma once
#include <cstdint>

namespace k3::kda {

// K3's chunk (the tile of its kernels). Also the default spacing of the block tape's saved states.
constexpr int64_t kKdaChunk = 16;

// o = the recurrence output for every token (overwritten). chunk_states (may be nullptr) receives the
// state entering every chunk (chunk 0: zeros), which kda_chunk_backward_f64 needs. chunk >= 1.
void kda_chunk_forward_f64(double* o, double* chunk_states, const double* q, const double* k, const double* v,
                           const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                           int64_t Dv, int64_t chunk = kKdaChunk);

// Given d_o = dL/do, writes (OVERWRITES) dq, dk, dg [T, H*Dk], dv [T, H*Dv], dbeta [T, H]: the gradients
// w.r.t. the inputs of kda_chunk_forward_f64 (dg w.r.t. the per-token g, before any cumulative sum).
// chunk_states and chunk must be those of the forward on the same inputs.
void kda_chunk_backward_f64(double* dq, double* dk, double* dv, double* dg, double* dbeta, const double* d_o,
                            const double* chunk_states, const double* q, const double* k, const double* v,
                            const double* g, const double* beta, double scale, int64_t T, int64_t H, int64_t Dk,
                            int64_t Dv, int64_t chunk = kKdaChunk);

}  // namespace k3::kda
