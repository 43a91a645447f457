// The Gated MLA attention core of the TRAINING model on the GPU with bf16 TENSOR-CORE operands: the
// same semantics, layouts, arguments and results as attention_forward_train /
// attention_backward_train (kernels/mla/mla_train_cuda.h, whose comment describes the math, the
// packed varlen batch and the argument conventions), for the trainer's bf16 mode.
// Plain C++ (no CUDA headers): every pointer is a DEVICE pointer, every kernel runs on the default
// stream, and a function returns as soon as its kernels are queued.
//
// INPUTS stay fp32 buffers (the trainer's interface does not change): q, k (k_nope | k_rot), v and
// dO are rounded to bf16 (nearest even) ONCE, by a packing kernel, into head-major bf16 copies in
// the caller's workspace ([H][rows][W], W the head dim rounded up to 16, zero-filled); o, lse and
// every gradient are fp32. Any Dn >= 0, Dr >= 0 with 1 <= Dn + Dr <= 256 and 1 <= Dv <= 256 (K3: 128,
// 64, 128); any H >= 1. causal = false: every query sees its whole sequence (attention_forward_train's
// comment); the Hopper kernels below are causal only, so that form always runs the mma.sync kernels.
//
// At K3's head dims (Dn + Dr padded to 192, Dv = 128) the forward and the backward run on Hopper's
// warpgroup MMA instead (mla_train_wgmma_cuda.cu, mla_train_wgmma_bwd_cuda.cu: the same semantics and
// determinism; the backward forms dS from P as rounded to bf16 for dV). Every other shape runs the
// kernels described here.
// DESIGN (FlashAttention-2 on mma.sync.m16n8k16 bf16 -> fp32). 128 threads =
// 4 warps per block; every warp owns 16 rows of the block's tile. Tiles move global -> shared by
// cp.async, 16 bytes at a time, DOUBLE-BUFFERED: the next tile's copy runs under this tile's
// products. Fragments come from shared memory by ldmatrix (.trans for the B operand of P V, dS K,
// Pᵀ dO and dSᵀ Q, so nothing is stored transposed); rows are padded by 16 bytes, so every ldmatrix
// is free of bank conflicts. Rows past a sequence's end are zero-filled and masked by SELECTION
// (never multiplied by a 0/1 mask); tiles start at the sequence's first row.
//   forward: block = 64 queries of one (sequence, head); loops over 64-key tiles up to the causal
//            end. S = Q Kᵀ in fp32 accumulators, online softmax in fp32 (running max, per-thread
//            partial sums), P rounded to bf16 in registers for O += P V. o = O / l, lse = m + log l.
//   backward: Delta_t = bf16(dO_t)·O_t per (row, head) in double, rounded once, then
//            (a) dK/dV: block = 64 keys, loops over the 32-query tiles that see them:
//                Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, Pᵀ = exp(Sᵀ - lse), dSᵀ = Pᵀ (dPᵀ - Delta);
//                dV += bf16(Pᵀ) dO, dK += bf16(dSᵀ) Q;
//            (b) dQ: block = 64 queries, loops over the 32-key tiles they see; dQ += bf16(dS) K;
//            each output element is owned by one thread of one block and summed in a fixed order
//            (mma.sync's own order is fixed): NO atomics. dk_rot: per-head scratch [H, rows, Dr],
//            summed over h = 0..H-1 in that order by one kernel. Bitwise reproducible, and a
//            sequence's results do not depend on what else is packed with it.
//   Recomputing S and dP in both backward kernels costs 1.44x the backward's nominal products
//   (K3's dims) and buys the absence of atomics, hence the reproducibility above.
// NUMERICS: operands bf16 (8 significant bits), every product accumulated in fp32 by the tensor
//   cores; softmax max-subtracted in fp32 with exp2 (log2(e)·scale folded into the scores), the sum
//   l of the UNROUNDED fp32 probabilities; lse natural log, fp32. Masked scores are -inf by
//   selection and a row with nothing seen yet uses 0 as its subtrahend (no inf - inf). Agreement
//   with the float64 twins: relative L2 ~ a few 1e-3 (bf16's rounding of the operands), checked in
//   tests/test_cuda_train_mla_tc.cpp against 1e-2.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/error.h"       // defines: k3::fail (the no-CUDA stubs)
#include "kernels/mla/mla.h"  // defines: mla::Dims (H, Dn, Dr, Dv used; R ignored)

namespace k3::mla::cuda {

#ifdef K3_HAVE_CUDA

// Scratch of attention_forward_train_bf16: the bf16 copies of q, k and v (2·H·rows·(2·pad16(Dn + Dr)
// + pad16(Dv)) bytes, each part rounded up to 256).
size_t attention_forward_workspace_bytes_bf16(int64_t rows, const Dims& d);

// As attention_forward_train: o [rows, ldo] (head h at columns h*Dv) and lse [H, rows] OVERWRITTEN,
// from q [rows, ldq] ([q_nope | q_rot] per head), kv [rows, ldkv] ([k_nope | v] per head) and
// k_rot [rows, ldr] (shared by the heads); operands rounded to bf16 into `workspace`
// (attention_forward_workspace_bytes_bf16(rows, d) bytes).
void attention_forward_train_bf16(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq, const float* kv,
                                  int64_t ldkv, const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int B,
                                  int64_t max_len, int64_t rows, const Dims& d, float scale, void* workspace,
                                  bool causal = true);

// Scratch of attention_backward_train_bf16: Delta and log2(e)·lse [H, rows] and the per-head dk_rot
// [H, rows, Dr] in fp32, then the bf16 copies of q, k, v and dO.
size_t attention_backward_workspace_bytes_bf16(int64_t rows, const Dims& d);

// As attention_backward_train: dq, dkv ([dk_nope | dv] per head) and dk_rot (the sum over the heads,
// in head order) OVERWRITTEN, given dO (layout and stride of o), the forward's o and lse (from either
// forward). workspace: attention_backward_workspace_bytes_bf16(rows, d) bytes.
void attention_backward_train_bf16(float* dq, int64_t lddq, float* dkv, int64_t lddkv, float* dk_rot, int64_t lddr,
                                   const float* d_o, int64_t ldo, const float* o, const float* q, int64_t ldq,
                                   const float* kv, int64_t ldkv, const float* k_rot, int64_t ldr, const float* lse,
                                   const int32_t* cu_seqlens, int B, int64_t max_len, int64_t rows, const Dims& d,
                                   float scale, void* workspace, bool causal = true);

#else  // a build without the CUDA backend: every entry point says so

inline size_t attention_forward_workspace_bytes_bf16(int64_t, const Dims&) {
  fail("mla::cuda::attention_forward_workspace_bytes_bf16: this build has no CUDA backend");
}
inline void attention_forward_train_bf16(float*, int64_t, float*, const float*, int64_t, const float*, int64_t,
                                         const float*, int64_t, const int32_t*, int, int64_t, int64_t, const Dims&,
                                         float, void*, bool = true) {
  fail("mla::cuda::attention_forward_train_bf16: this build has no CUDA backend");
}
inline size_t attention_backward_workspace_bytes_bf16(int64_t, const Dims&) {
  fail("mla::cuda::attention_backward_workspace_bytes_bf16: this build has no CUDA backend");
}
inline void attention_backward_train_bf16(float*, int64_t, float*, int64_t, float*, int64_t, const float*, int64_t,
                                          const float*, const float*, int64_t, const float*, int64_t, const float*,
                                          int64_t, const float*, const int32_t*, int, int64_t, int64_t, const Dims&,
                                          float, void*, bool = true) {
  fail("mla::cuda::attention_backward_train_bf16: this build has no CUDA backend");
}

#endif

}  // namespace k3::mla::cuda
