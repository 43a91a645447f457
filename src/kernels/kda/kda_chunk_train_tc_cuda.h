// The KDA recurrence core for TRAINING on the GPU (sm_90a) on TENSOR CORES: the bf16-operand twin of
// kda_chunk_forward_train / kda_chunk_backward_train (kda_chunk_train_cuda.h: same KdaTrainParams, same packed
// varlen contract, same outputs and overwrite rules; the states travel in a tape, below). Every 16x16, 16xD and DxD product
// is mma.sync m16n8k16 with bf16 operands and fp32 accumulators; the state, the state gradient, the decays and
// the gate math stay fp32. Plain C++ (no CUDA headers): DEVICE pointers, the default stream, asynchronous.
//
// THE CHUNKED FORM (chunk 16, as kda_chunk_train_cuda.h; in a chunk of n tokens r, s = 0..n-1 with entering
// state S0, Q = scale q, Gamma_r = g_0 + .. + g_r per key channel, E_r = exp(Gamma_r), El = E_{n-1}):
//   Qt = Q E, Kt = k E, Kd_r = k_r exp(Gamma_{n-1} - Gamma_r)                 (against the chunk's S0 / S_end)
//   Qr_r = Q_r exp(Gamma_r - Gamma_m), Kr_r = k_r exp(Gamma_r - Gamma_m), Ki_s = k_s exp(Gamma_m - Gamma_s)
//   A = StrictLower(Kr Ki^T), M = Lower(Qr Ki^T)            (m = 7: the chunk's midpoint, see NUMERICS)
//   Aw = (I + Diag(beta) A)^-1 Diag(beta)                   (so U = Aw Y is the forward substitution)
//   Y = V - Kt S0,  U = Aw Y,  X = Y - A U,  O = Qt S0 + M U,  S_end = Diag(El) S0 + Kd^T U
// Backward (dS = dL/dS_end, 0 after a sequence's last chunk):
//   dU = Kd dS + M^T dO,  dX = Aw^T dU (= dv),  dB = dU - A^T dX,  dS0 = Diag(El) dS + Qt^T dO - Kt^T dX
//   dQt = dO S0^T, dKt = -dX S0^T, dKd = U dS^T, dM = StrictLower(dO U^T), dMd_r = (dO U^T)_rr,
//   dA = StrictLower(-dX U^T), dQr = dM Ki, dKr = dA Ki, dKi = dA^T Kr + dM^T Qr, dbeta_r = dB_r . X_r
//   then per element: dq = scale (dQt E + dQr e^{Gamma-Gamma_m} + dMd k), dk = dKt E + dKd e^{Gamma_{n-1}-Gamma} +
//   dKr e^{Gamma-Gamma_m} + dKi e^{Gamma_m-Gamma} + dMd Q, dGamma = dQt Qt + dKt Kt - dKd Kd + dQr Qr + dKr Kr -
//   dKi Ki (Kd's term left out at r = n-1, where Kd = k), dGamma_{n-1} += sum_{r<n-1} dKd_r Kd_r + El rowsum(S0 dS),
//   dg = reverse cumulative sum of dGamma in the chunk.
//   (Gamma_m is held constant: A and M do not depend on it, so its gradient terms sum to exactly 0. M's diagonal
//   and Kd_{n-1} do not depend on Gamma either; routing them through the decays would add two O(1) terms that
//   cancel exactly in exact arithmetic but leave bf16 rounding noise in dg, which is small where g is at its
//   bound: docs/NUMERICS.md, "bf16 tensor-core KDA training".)
//
// DESIGN (four kernels; warps of 32 lanes own 16 output columns; no atomics):
//   prep     one CTA (max(D, 64) threads) per chunk and head, all chunks in parallel: the elementwise decays (fp32), A and
//            M (tensor cores), Aw (a 16x16 unit-triangular solve, one lane per column), written to an "item"
//            of bf16 tiles Kt, Qt, Kd [16][D], Aw, A, M [16][16] and fp32 El [D], stored with the padded rows the
//            other kernels hold them in (100 D + 3072 bytes, copied as one flat run). Runs once, in the forward:
//            the items are part of the tape the backward reads.
//   fwd_seq  one CTA of 4 warps (2 at D = 32) per (sequence, head, 64 (32) value columns): each warp keeps its 16
//            columns of S^T (16 x D, fp32 mma accumulators in registers) across the sequence's chunks; the
//            accumulator tiles of S^T, Y^T and U^T are repacked in registers as the A operand of the next product.
//            A chunk's item and its V tile arrive by cp.async three chunks ahead (4 stages), so a step waits on no
//            memory. Saves S0^T per chunk (bf16, through stmatrix and one bulk copy per warp), writes O.
//   bwd_seq  the same grid, chunks in reverse, dS^T in registers, dO staged as V is; saves dS^T (bf16) per chunk,
//            writes dv = dX and dB (bf16, workspace).
//   bwd_chunk one CTA (2D threads, D/16 warps) per chunk and head, all chunks in parallel, two CTAs per SM at
//            D = 128 (100 KB of shared memory each): S0^T, dS^T, dO, dX and the item's tiles arrive by cp.async while
//            the decays load; Y^T, U^T, X^T from S0^T (value rows per warp, as fwd_seq), then every
//            product above (key columns per warp), then the elementwise chain and the reverse cumsum. Qr, Kr, Ki
//            are built where S0^T was, once its products are done.
// The saved states are bf16 because every product that reads them takes bf16 operands anyway (the rounding the
// backward would apply on loading them); the state itself is carried in fp32 through the sequential walks.
// Every sequence's numbers come from its own rows only by the same code; results are bitwise reproducible and
// independent of the other sequences of the batch.
//
// NUMERICS (bar: relative L2 <= 1e-2 against the float64 twin; operands bf16 = 8 significant bits):
//   - Range: K3's gate is in [-5, 0], so inside a 16-token chunk |Gamma_r - Gamma_s| <= 80 and every factor
//     exp(Gamma_r), exp(Gamma_{n-1} - Gamma_r) is in [e^-80, 1] (e^-80 = 1.8e-35, a normal fp32 / bf16 number).
//     A and M are formed by re-referencing at the midpoint m = 7 (fla's safe_gate trick): the factors of Kr, Qr,
//     Ki are within e^+-40, far inside bf16's range (max e^88.7), so the masked products Kr Ki^T never overflow
//     and the kept pair decays e^{Gamma_r - Gamma_s} (r >= s, <= 1) come as one product of two bf16 numbers:
//     ~2^-8 relative per term. The masks are selects, never multiplications (the discarded upper triangle
//     holds up to e^75 |k|^2, finite in fp32 accumulators).
//   - Exponent rounding: the decays are expf of differences of fp32 cumulative sums (|Gamma| <= 80: ~8e-6
//     absolute in the exponent), far below bf16's 4e-3.
//   - q, k, v, dO are bf16 inputs, dq, dk, dv bf16 outputs (CONTRACT); dX and dB pass from bwd_seq to bwd_chunk in
//     bf16 (the first is a bf16 output anyway, the second feeds only dbeta's dot with X).
//   - U, Y, dU, dX, dO, S0, dS are rounded to bf16 where they are operands; the state S and the state gradient
//     dS are carried in fp32 accumulators, so rounding does not compound along a sequence (the recurrence is
//     contractive). g must be >= -5 per token for these range claims (K3's bound); g > 0 is not supported.
//
// CONTRACT: as kda_chunk_train_cuda.h (D in {32, 64, 128}; tape and workspace 16-byte aligned, caller-owned), with
// bf16 where the products take bf16 operands anyway: q, k, v and d_o come in as bf16 (uint16_t bits, 16-byte
// aligned), dq, dk and dv leave as bf16; g (16-byte aligned), beta, o, dg and dbeta stay fp32 (the decays are
// exponentials of cumulative sums of g, the one input whose rounding would compound, and o feeds an fp32 RMSNorm).
// That is fla's contract for chunk_kda, and it halves the bytes of the kernels' dominant traffic (NUMERICS above:
// bf16 q, k, v, dO are the values the products read in any case; the bar is met given the same bf16 inputs).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/kda/kda_chunk_train_cuda.h"

namespace k3::kda::cuda {

using KdaTrainBf16Params = KdaTrainParamsOf<uint16_t>;  // q, k, v bf16; g, beta fp32

// The forward's tape for the backward ("saved", caller-owned, 16-byte aligned): bf16 S0^T per chunk, value-major
// [chunks, H, D (value), D (key)] with each row's 16-byte pieces permuted (the layout the forward writes without
// bank conflicts; kda_chunk_train_bf16_states undoes it), then the chunk items [chunks, H] of 100 D + 3072 bytes.
size_t kda_chunk_train_bf16_saved_bytes(const KdaTrainBf16Params& p);

// o [rows, H*D] (fp32) and saved OVERWRITTEN. No workspace beyond the tape.
void kda_chunk_forward_train_bf16(const KdaTrainBf16Params& p, float* o, void* saved);

// dq, dk, dv [rows, H*D] (bf16), dg [rows, H*D] and dbeta [rows, H] (fp32) OVERWRITTEN (dg w.r.t. the per-token
// g), given d_o (bf16) and the forward's tape. Workspace: chunks * H * D * D bf16 (dS^T per chunk) and
// rows * H * D bf16 (dB).
size_t kda_chunk_backward_train_bf16_workspace_bytes(const KdaTrainBf16Params& p);
void kda_chunk_backward_train_bf16(const KdaTrainBf16Params& p, const uint16_t* d_o, const void* saved, uint16_t* dq,
                                   uint16_t* dk, uint16_t* dv, float* dg, float* dbeta, void* workspace);

// The tape's states as fp32 key-major S[dk][dv] per chunk and head, [chunks, H, D, D] OVERWRITTEN (the layout of
// kda_chunk_forward_train's states): for tests and inspection.
void kda_chunk_train_bf16_states(const KdaTrainBf16Params& p, const void* saved, float* states);

}  // namespace k3::kda::cuda
