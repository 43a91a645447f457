// The Gated MLA attention core of the training model in float64 (K3-ARCHITECTURE.md §5.4), forward
// beside backward, in the expanded (per-head, non-absorbed) form, for ONE sequence of T tokens at
// positions 0..T-1. The fp32 inference forms are in mla.h.
//
// Per head h: S_ts = scale·(q_nope_h(t)·k_nope_h(s) + q_rot_h(t)·k_rot(s)) for s <= t (causal; NoPE,
// so k_rot is never rotated), P = max-subtracted softmax over s, o_h(t) = Σ_s P_ts v_h(s).
// Layouts are token-major with row strides: q [T, ldq] holds head h at columns h*(Dn+Dr) as
// [q_nope | q_rot]; kv [T, ldkv] holds head h at columns h*(Dn+Dv) as [k_nope | v] (kv_b's output);
// k_rot [T, ldr] holds Dr columns shared by all heads; o [T, ldo] holds head h at columns h*Dv.
// Dims::R is not read here.
#pragma once
#include <cstdint>

#include "kernels/mla/mla.h"

namespace k3::mla {

// o OVERWRITTEN (H*Dv columns per row). lse [H, T]: log Σ_s exp(S_ts) per head and query row, saved
// so the backward recomputes P instead of keeping [H, T, T].
// past > 0 (decoding; the backward knows only past = 0): the T query rows are positions past..past+T-1 of a
// sequence whose kv and k_rot hold all past + T rows, and query row t attends to rows 0..past+t.
void attention_forward_f64(double* o, int64_t ldo, double* lse, const double* q, int64_t ldq, const double* kv,
                           int64_t ldkv, const double* k_rot, int64_t ldr, int64_t T, const Dims& d, double scale,
                           int64_t past = 0);

// Backward of attention_forward_f64 given dO (same layout as o) and the saved lse:
//   dP_ts = do_t·v_s;  dv_s = Σ_t P_ts do_t;  dS_ts = P_ts (dP_ts - Σ_s' P_ts' dP_ts')
//   dq_t = scale Σ_s dS_ts k_s;  dk_s = scale Σ_t dS_ts q_t   with k_s = [k_nope_h(s) | k_rot(s)].
// dq (H*(Dn+Dr) columns), dkv (H*(Dn+Dv) columns: [dk_nope | dv] per head) and dk_rot (Dr columns,
// summed over the heads) are OVERWRITTEN; other columns of their rows are left alone.
void attention_backward_f64(double* dq, int64_t lddq, double* dkv, int64_t lddkv, double* dk_rot, int64_t lddr,
                            const double* dO, int64_t lddo, const double* q, int64_t ldq, const double* kv,
                            int64_t ldkv, const double* k_rot, int64_t ldr, const double* lse, int64_t T, const Dims& d,
                            double scale);

// The output gate of Gated MLA, elementwise over n values: gate = sigmoid(gate) in place (it holds
// g_proj x on entry and is saved for the backward), og = o ⊙ gate.
void output_gate_forward_f64(double* og, double* gate, const double* o, int64_t n);
// d_o = dog ⊙ gate; dz = dog ⊙ o ⊙ gate (1 - gate), the gradient of the pre-sigmoid g_proj x. Both OVERWRITTEN.
void output_gate_backward_f64(double* d_o, double* dz, const double* dog, const double* o, const double* gate,
                              int64_t n);

}  // namespace k3::mla
