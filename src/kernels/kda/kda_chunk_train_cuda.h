// The KDA recurrence core for TRAINING on the GPU (sm_90a), fp32: the CUDA twins of kda_chunk_forward_f64 and
// kda_chunk_backward_f64 (kda_chunk_f64.h) at chunk = 16, on a packed variable-length batch. Plain C++ (no
// CUDA headers): every pointer is a DEVICE pointer, kernels run on the default stream, and a call returns as
// soon as its kernels are queued.
//
// THE RECURRENCE (per sequence and head h; S is D x D, key-major S[c][j], S_0 = 0 at the sequence start):
//   S' = Diag(alpha_t) S_{t-1} (alpha = exp(g), g <= 0 per key channel);  u_t = beta_t (v_t - S'^T k_t);
//   S_t = S' + k_t u_t^T;  o_t = S_t^T (scale q_t)
// computed in the chunked form of kda_chunk_f64.h: in a chunk of n <= 16 tokens (local r, s = 0..n-1),
// entering state S0, Q = scale q, E_r = alpha_0 ... alpha_r (per channel, from the chunk start),
// W_rs = alpha_{s+1} ... alpha_r (s < r; W_rr = 1), P_s = W_{n-1,s}, Qt = E Q, Kt = E k, Kd = P k:
//   A_rs = sum_c k_r k_s W_rs (s < r)     M_rs = sum_c Q_r k_s W_rs (s <= r)
//   X_r = v_r - Kt_r^T S0 - sum_{s<r} A_rs u_s,  u_r = beta_r X_r        (forward substitution)
//   o_r = S0^T Qt_r + sum_{s<=r} M_rs u_s        S_end = Diag(E_{n-1}) S0 + Kd^T U
// The backward is kda_chunk_f64.cpp's derivation (dS = dL/dS_end carried from the next chunk, 0 after the
// last; dB_r = dU_r - sum_{r'>r} A_r'r dX_r' is the back substitution; dX = beta dB; dv = dX):
//   dU = Kd dS + M^T dO     dS0 = Diag(E_{n-1}) dS + Qt^T dO - Kt^T dX
//   dQt = dO S0^T   dKt = -dX S0^T   dKd = U dS^T   dM = dO U^T   dA = -dX U^T   dbeta_r = dB_r . X_r
//   dGamma_{n-1} += E_{n-1} rowsum(S0 * dS); then the elementwise terms of Qt, Kt, Kd and M's diagonal, the pair
//   terms of A and M (running decay product), dg = the reverse cumulative sum of dGamma inside the chunk.
//
// DESIGN (four kernels; 256 threads each; all products are fp32 FMA loops, no tensor cores, no atomics):
//   prep     (one block per chunk and head, all chunks in parallel): Q, k, alpha = expf(g), E, P, Qt, Kt, Kd, A,
//            M of the chunk; writes Qt, Kt, Kd, A, M, E_{n-1} to the workspace ("item", (3*16*D + 2*256 + D)
//            floats). The pair loop of A and M is one warp per column s (warp w takes s = w and 15 - w), a lane
//            per 1/32 of the channels, each carrying W_rs down r = s+1.. as a running product, then a warp
//            butterfly sum (fixed order).
//   fwd_seq  (one block per sequence, head and 16-column value slice, D/16 slices): walks the sequence's
//            chunks in order with its 16 columns of the state in shared memory (the recurrence never mixes
//            value columns: u_j = sum_c S'[c][j] k[c], so each column evolves alone given k, g, beta, v[:, j]).
//            Per chunk: saves S0, X = V - Kt S0, the forward substitution (one thread per column), O, S_end.
//   bwd_seq  (same grid, chunks in reverse): carries its 16 columns of dS; per chunk saves dS (the gradient
//            w.r.t. the state LEAVING the chunk) to the workspace, forms dU, the back substitution (writes dv
//            = dX, and dB to the workspace), then dS <- dS0. This is the only sequential part of the backward.
//   bwd_chunk (one block per chunk and head, all chunks in parallel): recomputes the prep quantities, then for
//            each value slice in order 0, 1, .. recomputes X, U from the saved S0 and accumulates dQt, dKt, dKd,
//            dM, dA, dbeta, rowsum(S0 * dS) over the slices (a fixed order: the deterministic sum over the
//            slices that the gradients of the channel-shared inputs need); then per key channel the elementwise
//            and pair terms and the reverse cumulative sum, and writes dq, dk, dg, dbeta.
// Every sequence's numbers are computed by the same code on its own rows only, and no block's arithmetic
// depends on which block or how many run, so results are bitwise reproducible and do not depend on the
// other sequences of the batch.
//
// NUMERICS (fp32 throughout; the f64 twin's algebra, kda_chunk_f64.cpp):
//   - Decays. No exp(+Gamma) or quotient E_r / E_s is ever formed. W_rs, P_s and E_r are running products
//     of the per-token alpha_t = expf(g_t) <= 1 in ascending t (as the f64 twin and the recurrence apply
//     them), so every factor is in (0, 1] and nothing can overflow for any g <= 0. At the lower bound
//     g = -5 the smallest product in a 16-token chunk is e^-80 = 1.8e-35, a normal fp32 number (min normal
//     1.2e-38 = e^-87.3); products of it with small k or q entries may fall to fp32 denormals or 0 (the build
//     keeps denormals: no fast math), and those are terms that have decayed away (|term| < 1e-35 against
//     O(1) totals). A running product of <= 16 factors (each expf within 2 ulp) is within ~2e-6 relative of
//     the exact value. exp of the difference of two fp32 cumulative sums near -80 would instead carry their
//     rounding, ~ulp(80) = 7.6e-6 absolute in the exponent, into every pair decay as relative error: most of
//     the 1e-5 budget, which is why such differences are never formed.
//   - Near g = 0 (alpha ~ 1 - 1e-4) nothing cancels: the decays are products of numbers just below 1.
//   - Sums are fp32 FMA chains of length <= D (state products), <= 16 (chunk products, substitutions) or a
//     D/16-term sum of per-slice partials; the recurrence is contractive in the state (|alpha| <= 1, the
//     delta rule's I - beta k k^T with ||k|| = 1 and beta in (0, 1)), so errors do not grow along a
//     sequence. Relative L2 error against the f64 twin on the test's inputs: 1e-7 .. 6e-7 (the bound is 1e-5;
//     largest with g near 0, where nothing decays and the whole 300-token history contributes).
//   - The subtraction X = V - (Kt S0) sums Kt S0 first and subtracts once; the forward substitution and the
//     back substitution subtract term by term (fmaf), as the f64 twin does.
//
// CONTRACT. Packed varlen batch: q, k, v, g [rows, H, D] (row-major [rows, H*D]), beta [rows, H]. Sequence b is
// rows [cu_seqlens[b], cu_seqlens[b+1]) (device, B+1 ascending entries, cu_seqlens[0] = 0, cu_seqlens[B] =
// rows); its chunks are 16-row pieces from its first row (the last may be shorter); chunk_offsets[b] =
// sum_{b'<b} ceil(len_b'/16) (device, B+1 entries, chunk_offsets[B] = chunks). These device arrays are not
// read on the host, so they are not validated: inconsistent ones make the kernels read out of bounds.
// Empty sequences are allowed. max_len is not needed by these kernels (accepted for the common contract).
// g may be any value <= 0 (K3's gate is in [-5, 0]); g > 0 is not supported (decays above 1 could overflow).
// Outputs must not alias inputs. The workspace (size from the ..._workspace_bytes function, 16-byte aligned,
// e.g. from cudaMalloc) is scratch owned by the caller; its content need not be preserved between calls.
#pragma once
#include <cstddef>
#include <cstdint>

namespace k3::kda::cuda {

// Packed varlen batch: q, k, v, g [rows, H, D] (row-major [rows, H*D]), beta [rows, H]. Sequence b is rows
// [cu_seqlens[b], cu_seqlens[b+1]); its chunks are 16-row pieces from its first row (the last may be shorter);
// chunk_offsets[b] = sum_{b'<b} ceil(len_b'/16) (device, B+1 entries).
// q, k, v [rows, H*D] of element type T (float here; bf16 bits, uint16_t, for the tensor-core kernels of
// kda_chunk_train_tc_cuda.h), g [rows, H*D] and beta [rows, H] fp32 in both.
template <class T>
struct KdaTrainParamsOf {
  const T *q = nullptr, *k = nullptr, *v = nullptr;
  const float *g = nullptr, *beta = nullptr;
  const int32_t* cu_seqlens = nullptr;
  const int32_t* chunk_offsets = nullptr;
  int B = 0;
  int64_t max_len = 0, rows = 0, chunks = 0;  // chunks = chunk_offsets[B]
  int H = 0, D = 0;                           // D = head dim (key = value dim), one of 32, 64, 128
  float scale = 0;                            // 1/sqrt(D)
};
using KdaTrainParams = KdaTrainParamsOf<float>;

// o [rows, H*D] OVERWRITTEN; states [chunks, H, D, D] OVERWRITTEN: the state entering each chunk (key-major
// S[dk][dv]; zeros for a sequence's first chunk), as the f64 forward's chunk_states.
// Workspace: chunks * H * (3*16*D + 2*256 + D) floats.
size_t kda_chunk_train_states_bytes(const KdaTrainParams& p);  // the states buffer: chunks * H * D * D floats
size_t kda_chunk_forward_train_workspace_bytes(const KdaTrainParams& p);
void kda_chunk_forward_train(const KdaTrainParams& p, float* o, float* states, void* workspace);

// Given d_o [rows, H*D] and the forward's states: dq, dk, dv, dg [rows, H*D] and dbeta [rows, H], all
// OVERWRITTEN (dg w.r.t. the per-token g). Workspace: the forward's, plus chunks * H * D * D floats (the state
// gradients at the chunk ends) and rows * H * D floats (dB).
size_t kda_chunk_backward_train_workspace_bytes(const KdaTrainParams& p);
void kda_chunk_backward_train(const KdaTrainParams& p, const float* d_o, const float* states, float* dq, float* dk,
                              float* dv, float* dg, float* dbeta, void* workspace);

}  // namespace k3::kda::cuda
