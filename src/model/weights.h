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

#include "io/safetensors.h"
#include "kernels/gemm/linear.h"
#include "model/config.h"
#include "model/tensor_table.h"

namespace k3 {

struct KdaWeights {
  WeightRef q_proj, k_proj, v_proj;           // [H*D, hidden]
  WeightRef f_a_proj;                         // [D, hidden]   (rank D bottleneck of the decay gate)
  WeightRef f_b_proj;                         // [H*D, D]
  WeightRef b_proj;                           // [H, hidden]
  WeightRef g_proj;                           // [H*D, hidden]
  WeightRef o_proj;                           // [hidden, H*D]
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
  WeightRef router;                    // gate.weight [E, hidden]
  std::vector<float> router_bias;      // gate.e_score_correction_bias [E] (zeros if absent)
  WeightRef latent_down, latent_up;    // [latent, hidden], [hidden, latent]
  std::vector<float> latent_norm;      // routed_expert_norm.weight [latent]
  std::vector<ExpertWeights> experts;  // [E]
  GluFfnWeights shared;                // fused shared experts (empty if none)
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
  WeightRef embed_tokens;               // [V, hidden]
  WeightRef lm_head;                    // [V, hidden]
  std::vector<float> norm;              // [hidden]
  std::vector<float> output_res_query;  // output_attn_res_norm ⊙ output_attn_res_proj
  std::vector<LayerWeights> layers;
};

// Throws k3::Error naming the checkpoint and the tensor on a missing tensor, wrong shape or dtype.
ModelWeights bind_weights(const K3Config& cfg, const SafeTensors& st);

// The float-like tensor `name` of st (F32, BF16 or F16, kept where it lies) as a linear layer's weight: rows =
// shape[0], cols = the product of the rest (a conv kernel [out, C, p, p] is the matrix [out, C p p]). Its shape
// must be `shape`; errors name the file, the tensor and cfg_source (the config the shape came from).
WeightRef matrix_weight(const SafeTensors& st, const std::string& name, const std::vector<int64_t>& shape,
                        const std::string& cfg_source);

// The field of a layer that holds tensor kind k: for LayerWeights, and for a backend's mirror of it
// with the same field names (the GPU's LayerDev, model/cuda/cuda_model_impl.h), so that binding and
// uploading map kinds to fields in one place. nullptr for kinds that are no field of that sort: the
// routed experts are kept per expert here and stacked on the GPU, so their callers place them.
template <class Layer>
auto layer_matrix(Layer& L, TensorKind k) -> decltype(&L.kda.q_proj) {
  using K = TensorKind;
  switch (k) {
    case K::KdaQ: return &L.kda.q_proj;
    case K::KdaK: return &L.kda.k_proj;
    case K::KdaV: return &L.kda.v_proj;
    case K::KdaG: return &L.kda.g_proj;
    case K::KdaFA: return &L.kda.f_a_proj;
    case K::KdaFB: return &L.kda.f_b_proj;
    case K::KdaB: return &L.kda.b_proj;
    case K::KdaO: return &L.kda.o_proj;
    case K::MlaQA: return &L.mla.q_a_proj;
    case K::MlaQB: return &L.mla.q_b_proj;
    case K::MlaQ: return &L.mla.q_proj;
    case K::MlaKvA: return &L.mla.kv_a_proj_with_mqa;
    case K::MlaKvB: return &L.mla.kv_b_proj;
    case K::MlaG: return &L.mla.g_proj;
    case K::MlaO: return &L.mla.o_proj;
    case K::DenseGate: return &L.dense.gate_proj;
    case K::DenseUp: return &L.dense.up_proj;
    case K::DenseDown: return &L.dense.down_proj;
    case K::MoeRouter: return &L.moe.router;
    case K::MoeLatentDown: return &L.moe.latent_down;
    case K::MoeLatentUp: return &L.moe.latent_up;
    case K::SharedGate: return &L.moe.shared.gate_proj;
    case K::SharedUp: return &L.moe.shared.up_proj;
    case K::SharedDown: return &L.moe.shared.down_proj;
    default: return nullptr;
  }
}

// As layer_matrix, for the vectors. An AttnRes norm and its pseudo-query projection share one field:
// the query the forward reads is their product (norm ⊙ proj), folded at bind.
template <class Layer>
auto layer_vector(Layer& L, TensorKind k) -> decltype(&L.input_layernorm) {
  using K = TensorKind;
  switch (k) {
    case K::InputNorm: return &L.input_layernorm;
    case K::PostAttnNorm: return &L.post_attention_layernorm;
    case K::AttnResNorm:
    case K::AttnResProj: return &L.attn_res_query;
    case K::MlpResNorm:
    case K::MlpResProj: return &L.mlp_res_query;
    case K::KdaQConv: return &L.kda.q_conv;
    case K::KdaKConv: return &L.kda.k_conv;
    case K::KdaVConv: return &L.kda.v_conv;
    case K::KdaALog: return &L.kda.A_log;
    case K::KdaDtBias: return &L.kda.dt_bias;
    case K::KdaONorm: return &L.kda.o_norm;
    case K::MlaQANorm: return &L.mla.q_a_layernorm;
    case K::MlaKvANorm: return &L.mla.kv_a_layernorm;
    case K::MoeRouterBias: return &L.moe.router_bias;
    case K::MoeLatentNorm: return &L.moe.latent_norm;
    default: return nullptr;
  }
}

}  // namespace k3
