// K3Config: every architecture field of a Kimi K3 / Kimi Linear `config.json`
// (../shared/docs/K3-ARCHITECTURE.md §2.2), read from the released nested form
// (`KimiK3ForConditionalGeneration` with `text_config` and `vision_config`) or the flat
// `KimiLinearForCausalLM` form, and validated. Layer lists are 1-based in the file and stored
// here as a per-layer kind (0-based index), so nothing downstream deals with the off-by-one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3 {

enum class AttnKind { KDA, MLA };
enum class Activation { SiTU, SiLU };

struct K3Config {
  std::string source;  // file it was read from (for messages)

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense FFN (layers < first_k_dense_replace)
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;  // MLA heads
  int64_t num_key_value_heads = 0;
  Activation hidden_act = Activation::SiTU;
  std::string hidden_act_name = "situ";
  float situ_beta = 4.0f;          // gate cap (activation_situ_beta)
  float situ_linear_beta = 25.0f;  // up cap (activation_situ_linear_beta)
  double rms_norm_eps = 1e-5;      // double: the float64 training path uses it as the reference does (Python float)

  // Gated MLA (NoPE).
  int64_t q_lora_rank = 0;  // 0: no q low-rank (q_proj directly)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;  // never rotated (NoPE), but scored and cached
  int64_t v_head_dim = 0;
  bool mla_use_output_gate = true;
  double mla_norm_eps = 1e-6;  // q_a/kv_a layernorm: the reference passes no eps (class default 1e-6)

  // Stable LatentMoE.
  int64_t num_experts = 0;
  int64_t num_experts_per_token = 0;
  int64_t num_shared_experts = 0;
  int64_t moe_intermediate_size = 0;
  int64_t routed_expert_hidden_size = 0;  // latent width
  bool latent_moe_use_norm = true;
  bool moe_renormalize = true;
  float routed_scaling_factor = 1.0f;
  bool use_grouped_topk = true;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;
  std::string topk_method = "noaux_tc";
  int64_t first_k_dense_replace = 1;
  int64_t moe_layer_freq = 1;

  int64_t attn_res_block_size = 0;
  int64_t max_position_embeddings = 0;
  int64_t num_nextn_predict_layers = 0;
  bool tie_word_embeddings = false;
  int64_t bos_token_id = -1, eos_token_id = -1, pad_token_id = -1;
  float initializer_range = 0.02f;

  // KDA (linear_attn_config).
  int64_t kda_num_heads = 0;
  int64_t kda_head_dim = 0;
  int64_t short_conv_kernel_size = 4;
  float gate_lower_bound = -5.0f;
  std::vector<AttnKind> layer_kind;  // [num_hidden_layers], 0-based

  // Present in the file but not used by the text model yet.
  bool has_vision_config = false;
  bool experts_mxfp4 = false;  // quantization_config: compressed-tensors mxfp4-pack-quantized

  // Derived helpers.
  bool is_moe_layer(int64_t l) const {
    return num_experts > 0 && l >= first_k_dense_replace && (l % moe_layer_freq) == 0;
  }
  int64_t q_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t kda_dim() const { return kda_num_heads * kda_head_dim; }
  int64_t shared_intermediate() const { return moe_intermediate_size * num_shared_experts; }
};

// Reads and validates; throws k3::Error naming the file and the field.
K3Config load_config(const std::string& path);
K3Config parse_config(const std::string& json_text, const std::string& source);

}  // namespace k3
