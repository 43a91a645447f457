// The K3 text model's parameters, bound by name to a checkpoint (SafeTensors) and shape-checked:
// bind_weights walks the tensor table of the config (tensor_table.h), which says each tensor's name,
// shape and how it is stored; the structs below are where the forward finds them.
//
// Matrices stay where the checkpoint has them (mmap'ed, BF16/F32/F16, or MXFP4 for routed experts)
// and are widened on use; only small vectors (norm weights, gate parameters, conv taps, router
// bias, AttnRes queries) are copied to fp32 at bind time. Names accepted: the release's
// `language_model.model.*` / `language_model.lm_head.weight` and the flat `model.*` / `lm_head.weight`.
#pragma once
#include <string>
#include <vector>

#include "model/config.h"
#include "io/safetensors.h"
#include "kernels/gemm/linear.h"

namespace k3 {

struct KdaWeights {
  WeightRef q_proj, k_proj, v_proj;  // [H*D, hidden]
  WeightRef f_a_proj;                // [D, hidden]   (rank D bottleneck of the decay gate)
  WeightRef f_b_proj;                // [H*D, D]
  WeightRef b_proj;                  // [H, hidden]
  WeightRef g_proj;                  // [H*D, hidden]
  WeightRef o_proj;                  // [hidden, H*D]
  std::vector<float> q_conv, k_conv, v_conv;  // [H*D, K]
  std::vector<float> A_log;                   // [H] (checkpoint may pad it; the first H are used)
  std::vector<float> dt_bias;                 // [H*D]
  std::vector<float> o_norm;                  // [D]
};

struct MlaWeights {
  WeightRef q_a_proj;            // [q_lora, hidden]           (absent when q_lora_rank == 0)
  WeightRef q_b_proj;            // [H*(Dn+Dr), q_lora]
  WeightRef q_proj;              // [H*(Dn+Dr), hidden]        (only when q_lora_rank == 0)
  WeightRef kv_a_proj_with_mqa;  // [R + Dr, hidden]
  WeightRef kv_b_proj;           // [H*(Dn+Dv), R]
  WeightRef g_proj;              // [H*Dv, hidden]             (absent when mla_use_output_gate is false)
  WeightRef o_proj;              // [hidden, H*Dv]
  std::vector<float> q_a_layernorm, kv_a_layernorm;
};

struct GluFfnWeights {
  WeightRef gate_proj, up_proj;  // [I, in]
  WeightRef down_proj;           // [in, I]
  bool empty() const { return gate_proj.empty(); }
};

struct ExpertWeights {
  WeightRef w1, w3;  // gate, up: [moe_I, latent]
  WeightRef w2;      // down: [latent, moe_I]
};

struct MoeWeights {
  WeightRef router;                        // gate.weight [E, hidden]
  std::vector<float> router_bias;          // gate.e_score_correction_bias [E] (zeros if absent)
  WeightRef latent_down, latent_up;        // [latent, hidden], [hidden, latent]
  std::vector<float> latent_norm;          // routed_expert_norm.weight [latent]
  std::vector<ExpertWeights> experts;      // [E]
  GluFfnWeights shared;                    // fused shared experts (empty if none)
};

struct LayerWeights {
  AttnKind kind = AttnKind::KDA;
  bool is_moe = false;
  std::vector<float> input_layernorm, post_attention_layernorm;  // [hidden]
  std::vector<float> attn_res_query, mlp_res_query;              // res_norm ⊙ res_proj, [hidden]
  KdaWeights kda;
  MlaWeights mla;
  GluFfnWeights dense;
  MoeWeights moe;
};

struct ModelWeights {
  WeightRef embed_tokens;  // [V, hidden]
  WeightRef lm_head;       // [V, hidden]
  std::vector<float> norm;             // [hidden]
  std::vector<float> output_res_query; // output_attn_res_norm ⊙ output_attn_res_proj
  std::vector<LayerWeights> layers;
};

// Throws k3::Error naming the checkpoint and the tensor on a missing tensor, wrong shape or dtype.
ModelWeights bind_weights(const K3Config& cfg, const SafeTensors& st);

}  // namespace k3
