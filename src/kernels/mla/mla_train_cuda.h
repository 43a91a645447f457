// The Gated MLA attention core and output gate of the TRAINING model on the GPU, in fp32: the CUDA
// twins of attention_forward_f64 / attention_backward_f64 / output_gate_forward_f64 /
// output_gate_backward_f64 (kernels/mla/mla_f64.h; the math and the layouts are described there).
// Plain C++ (no CUDA headers): every pointer is a DEVICE pointer, every kernel runs on the default
// stream, and a function returns as soon as its kernels are queued.
//
// Packed variable-length batch: sequence b is rows [cu_seqlens[b], cu_seqlens[b+1]) of every
// [rows, ...] operand (cu_seqlens: device, B+1 ascending int32 offsets, cu_seqlens[0] = 0,
// cu_seqlens[B] = rows); attention never crosses sequences (row cu_seqlens[b] is position 0).
// max_len (host) is >= every sequence's length: it sizes the grids, so a longer sequence would be
// partly skipped. Per head h (K3's NoPE form, k_rot never rotated):
//   S_ts = scale·(q_nope_h(t)·k_nope_h(s) + q_rot_h(t)·k_rot(s)),  s <= t;  P = softmax_s(S);
//   o_h(t) = Σ_s P_ts v_h(s);  lse_h(t) = log Σ_s exp(S_ts)  (natural log, of the SCALED scores).
// With causal = false (the vision tower's bidirectional attention, model/cuda/training/vision_train.cpp)
// every query sees every key of its sequence: s < len in place of s <= t, the same kernels otherwise.
// Any Dn >= 0, Dr >= 0 with 1 <= Dn + Dr <= 256 and 1 <= Dv <= 256 (K3: 128, 64, 128); any H >= 1.
//
// DESIGN (flash-attention in fp32 SIMT FMAs; tensor cores come later). Every block works on one
// (sequence, head) and one tile of rows aligned to the sequence's start; rows past the sequence's
// end are zero-filled in shared memory and masked by SELECTION (never multiplied by a 0/1 mask),
// so no stale value or inf reaches an output. 256 threads as a 16 x 16 grid: thread (ty, tx) owns
// rows ty + 16i and columns tx + 16j of every product, so one row's 16 owners are one half-warp
// (row reductions are 4 shuffles) and every shared-memory access is conflict-free (row strides of
// the tiles are odd: D | 1). Operand columns are contracted in ascending order with fp32 FMAs.
//   forward: block = 64 queries; loops over 64-key tiles up to the causal end. S tile in registers,
//            online softmax (running max m and sum l per row, O rescaled by exp(m_old - m_new)),
//            P through shared memory into O += P V. o = O / l, lse = m + log l. Never [T, T].
//   backward: Delta_t = dO_t·O_t per (row, head) (Σ_s P_ts dP_ts, as the f64 twin sums it), then
//            (a) dK/dV: block = 32 keys, loops over the 64-query tiles that see them, recomputing
//                P = exp(S - lse) and dS = P (dP - Delta), dP = dO V^T; dV += P^T dO, dK += dS^T Q;
//            (b) dQ:   block = 32 queries, loops over the 64-key tiles they see; dQ += dS K;
//            each output element is owned by one thread that sums in a fixed order: NO atomics.
//            dk_rot: each head's share goes to a scratch [H, rows, Dr], then one kernel sums it over
//            h = 0..H-1 in that order. Results are bitwise reproducible and a sequence's results do
//            not depend on what else is packed with it (tiles start at the sequence's first row).
//   Shared memory (opt-in above 48 KB): forward 64·(2·(Dqk|1) + (Dv|1) + 65)·4 B (148 KB at K3's
//   Dqk = Dn+Dr = 192, Dv = 128; 214 KB at 256, 256); backward 96·((Dqk|1) + (Dv|1))·4 B plus at
//   most 17 KB (141 KB at K3, 215 KB at 256, 256). One block per SM at K3's dims.
// NUMERICS. fp32 storage and arithmetic throughout, with expf/logf (not the fast intrinsics):
//   - softmax max-subtracted (forward: running max; backward: exp(S - lse) <= ~1), so exp never
//     overflows whatever T (64K positions included) and the scaled scores' size;
//   - a row with nothing seen yet has max -inf and uses 0 as the subtrahend (no inf - inf);
//   - l >= 1 for every real row (its largest term is exp(0)), so 1/l and log l are safe;
//   - Delta's dot product over Dv is accumulated in double (it is subtracted from dP: cancellation),
//     then rounded once to fp32; so is dk_rot's sum over the heads;
//   - the sums over keys (l, O, dQ) and over queries (dK, dV) are sequential fp32 chains, one per
//     output element, so a row of T terms carries ~sqrt(T)·2^-24 relative error: ~5e-7 at T = 130,
//     ~4e-6 for the last row of a 64K sequence (a float64 simulation of the forward's order).
// Agreement with the f64 twins on random inputs: relative L2 ~1e-7 .. 1e-6 at T <= 130 (checked in
// tests/test_cuda_train_mla.cpp against a 1e-5 bound, as is a 64K-position sequence's sampled rows).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/error.h"       // defines: k3::fail (the no-CUDA stubs)
#include "kernels/mla/mla.h"  // defines: mla::Dims (H, Dn, Dr, Dv used; R ignored)

namespace k3::mla::cuda {

#ifdef K3_HAVE_CUDA

// o [rows, ldo] (head h at columns h*Dv, OVERWRITTEN; other columns left alone) and lse [H, rows]
// (OVERWRITTEN) from q [rows, ldq] (head h at columns h*(Dn+Dr): [q_nope | q_rot]), kv [rows, ldkv]
// (head h at columns h*(Dn+Dv): [k_nope | v]) and k_rot [rows, ldr] (Dr columns shared by the heads).
void attention_forward_train(float* o, int64_t ldo, float* lse, const float* q, int64_t ldq, const float* kv,
                             int64_t ldkv, const float* k_rot, int64_t ldr, const int32_t* cu_seqlens, int B,
                             int64_t max_len, int64_t rows, const Dims& d, float scale, bool causal = true);

// Scratch of attention_backward_train: Delta [H, rows] and the per-head dk_rot [H, rows, Dr], fp32.
size_t attention_backward_workspace_bytes(int64_t rows, const Dims& d);

// Backward of attention_forward_train given dO (d_o, layout and stride of o), the forward's o and lse.
// dq [rows, lddq] (H*(Dn+Dr) columns), dkv [rows, lddkv] (H*(Dn+Dv) columns: [dk_nope | dv] per head)
// and dk_rot [rows, lddr] (Dr columns: the sum over the heads, in head order) are OVERWRITTEN; other
// columns of their rows are left alone. workspace: attention_backward_workspace_bytes(rows, d) bytes.
void attention_backward_train(float* dq, int64_t lddq, float* dkv, int64_t lddkv, float* dk_rot, int64_t lddr,
                              const float* d_o, int64_t ldo, const float* o, const float* q, int64_t ldq,
                              const float* kv, int64_t ldkv, const float* k_rot, int64_t ldr, const float* lse,
                              const int32_t* cu_seqlens, int B, int64_t max_len, int64_t rows, const Dims& d,
                              float scale, void* workspace, bool causal = true);

// The output gate, elementwise over n values, as output_gate_forward_f64: gate holds the pre-sigmoid
// g_proj x on entry and sigma(gate) on return (IN PLACE; the backward reads it), og = o ⊙ sigma.
// og is OVERWRITTEN. sigma is split by sign (1/(1+e^-z) or e^z/(1+e^z)) so expf never overflows.
void output_gate_forward_train(float* og, float* gate, const float* o, int64_t n);
// d_o = dog ⊙ gate, dz = dog ⊙ o ⊙ gate (1 - gate), with gate = sigma as left by the forward; the
// gradient of the pre-sigmoid input. Both OVERWRITTEN.
void output_gate_backward_train(float* d_o, float* dz, const float* dog, const float* o, const float* gate, int64_t n);

#else  // a build without the CUDA backend: every entry point says so

inline void attention_forward_train(float*, int64_t, float*, const float*, int64_t, const float*, int64_t, const float*,
                                    int64_t, const int32_t*, int, int64_t, int64_t, const Dims&, float, bool = true) {
  fail("mla::cuda::attention_forward_train: this build has no CUDA backend");
}
inline size_t attention_backward_workspace_bytes(int64_t, const Dims&) {
  fail("mla::cuda::attention_backward_workspace_bytes: this build has no CUDA backend");
}
inline void attention_backward_train(float*, int64_t, float*, int64_t, float*, int64_t, const float*, int64_t,
                                     const float*, const float*, int64_t, const float*, int64_t, const float*, int64_t,
                                     const float*, const int32_t*, int, int64_t, int64_t, const Dims&, float, void*,
                                     bool = true) {
  fail("mla::cuda::attention_backward_train: this build has no CUDA backend");
}
inline void output_gate_forward_train(float*, float*, const float*, int64_t) {
  fail("mla::cuda::output_gate_forward_train: this build has no CUDA backend");
}
inline void output_gate_backward_train(float*, float*, const float*, const float*, const float*, int64_t) {
  fail("mla::cuda::output_gate_backward_train: this build has no CUDA backend");
}

#endif

}  // namespace k3::mla::cuda
