// Training forward/backward of the Gated MLA attention block (K3-ARCHITECTURE.md §5.4), float64.
//
// The EXPANDED (per-head, non-absorbed) form of src/model/mla_layer.cpp, for ONE sequence of T
// tokens at positions 0..T-1 (causal). Same math as inference:
//   q     = q_b(RMSNorm(q_a x; q_a_layernorm))           (or q_proj x when q_lora_rank == 0)
//   c     = kv_a_proj_with_mqa x = [c_lat (R) | k_rot (Dr)]
//   lat   = RMSNorm(c_lat; kv_a_layernorm)                (k_rot: no norm, NO rotation: K3 is NoPE)
//   kv_h  = kv_b_h(lat) = [k_nope_h (Dn) | v_h (Dv)]
//   S_h   = (q_nope_h·k_nope_h + q_rot_h·k_rot) / sqrt(Dn + Dr), causal, softmax -> P_h
//   o_h   = P_h v_h;  o <- o ⊙ sigmoid(g_proj x) when mla_use_output_gate;  y = o_proj o
// RMSNorm here is weight * x / sqrt(mean(x²) + eps) with eps = c.mla_norm_eps (the inference code's
// choice: the reference passes no eps to these two norms, so the class default 1e-6 applies).
//
// Parameters: the MLA kinds of the tensor table (model/tensor_table.h), named under `prefix` (the
// layer's, "language_model.model.layers.L.") by tensor_name_at:
//   MlaQA [q_lora, hidden], MlaQANorm [q_lora], MlaQB [H*(Dn+Dr), q_lora]  (or MlaQ [H*(Dn+Dr), hidden]),
//   MlaKvA [R+Dr, hidden], MlaKvANorm [R], MlaKvB [H*(Dn+Dv), R], MlaG [H*Dv, hidden] (when gated),
//   MlaO [hidden, H*Dv].
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/params.h"

namespace k3::train {

// Activations saved by mla_block_forward for mla_block_backward (all row-major, T rows).
struct MlaBlockTape {
  int64_t T = 0;
  std::vector<double> x;        // [T, hidden] block input
  std::vector<double> qa_hat;   // [T, q_lora] q_a x / rms (before the norm weight); empty without q_lora
  std::vector<double> qa_rs;    // [T] 1/rms of q_a x
  std::vector<double> qa;       // [T, q_lora] normed and weighted: the input of q_b
  std::vector<double> q;        // [T, H*(Dn+Dr)]
  std::vector<double> ckv;      // [T, R+Dr] kv_a output (raw; k_rot = columns R..R+Dr)
  std::vector<double> lat_hat;  // [T, R] c_lat / rms
  std::vector<double> lat_rs;   // [T] 1/rms of c_lat
  std::vector<double> lat;      // [T, R] normed and weighted latent: the input of kv_b
  std::vector<double> kv;       // [T, H*(Dn+Dv)]
  std::vector<double> lse;      // [H, T] log Σ_s exp(score) per query row: the backward recomputes the
                                // probabilities from it instead of saving [H, T, T] (memory O(H·T))
  std::vector<double> o;        // [T, H*Dv] attention output before the gate
  std::vector<double> gate;     // [T, H*Dv] sigmoid(g_proj x); empty when not gated
  std::vector<double> og;       // [T, H*Dv] gated output: the input of o_proj
};

// What a decoding sequence carries from one forward to the next (model/training/engine_f64.h): every earlier
// position's keys and values, in the expanded form.
struct MlaDecodeState {
  int64_t length = 0;
  std::vector<double> kv;     // [length, H*(Dn+Dv)] kv_b's output
  std::vector<double> k_rot;  // [length, Dr]
};

// x: [T, hidden], the already-RMS-normalised block input; y: [T, hidden] (overwritten).
// tape: nullptr for no saving. state (decoding, with no tape): the T tokens are positions length..length+T-1 of
// the sequence `state` holds, and `state` then holds them too.
void mla_block_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                       const double* x, int64_t T, double* y, MlaBlockTape* tape, MlaDecodeState* state = nullptr);

// dy: [T, hidden]; dx: [T, hidden] (OVERWRITTEN). Parameter gradients are ACCUMULATED into P.g(...).
void mla_block_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t layer,
                        const MlaBlockTape& tape, const double* dy, double* dx);

}  // namespace k3::train
