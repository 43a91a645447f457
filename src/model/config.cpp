#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "core/validate.h"
#include "io/file.h"
#include "model/config_fields.h"

using json = nlohmann::json;

namespace k3 {
namespace {

using config_fields::Fields;

void read_layer_kinds(K3Config& c, const Fields& la) {
  const int64_t L = c.num_hidden_layers;
  std::vector<int> seen(size_t(L), 0);
  c.layer_kind.assign(size_t(L), AttnKind::KDA);
  for (const char* key : {"kda_layers", "full_attn_layers"}) {
    const bool mla = std::string(key) == "full_attn_layers";
    for (int64_t n : la.int_list(key)) {
      if (n < 1 || n > L)
        fail(la.where(key), ": entry ", n, " is outside 1..", L,
             n == 0 ? " (the layer lists are 1-based: layer 0 of the code is entry 1)" : "");
      if (seen[size_t(n - 1)]++)
        fail(la.where(key), ": layer ", n, " (1-based) is listed more than once across kda_layers/full_attn_layers");
      c.layer_kind[size_t(n - 1)] = mla ? AttnKind::MLA : AttnKind::KDA;
    }
  }
  for (int64_t l = 0; l < L; ++l)
    if (!seen[size_t(l)])
      fail(la.where("kda_layers"), ": layer ", l + 1, " (1-based) is in neither kda_layers nor full_attn_layers");
}

}  // namespace

K3Config parse_config(const std::string& text, const std::string& src) {
  const json root = parse_json(text, src);
  if (!root.is_object()) fail(src, ": expected a JSON object at the top level");
  const bool nested = root.contains("text_config");
  if (nested && !root["text_config"].is_object()) fail(src, ": field 'text_config' must be an object");
  const json& tj = nested ? root["text_config"] : root;
  Fields f{tj, nested ? "text_config." : "", src};
  Fields top{root, "", src};

  K3Config c;
  c.source = src;
  c.has_vision_config = root.contains("vision_config") && root["vision_config"].is_object();
  c.vocab_size = f.positive("vocab_size");
  c.hidden_size = f.positive("hidden_size");
  c.num_hidden_layers = f.positive("num_hidden_layers", 1 << 16);
  c.num_attention_heads = f.positive("num_attention_heads");
  c.num_key_value_heads = f.integer("num_key_value_heads", c.num_attention_heads);
  if (c.num_key_value_heads != c.num_attention_heads)
    fail(f.where("num_key_value_heads"), " = ", c.num_key_value_heads,
         " must equal num_attention_heads = ", c.num_attention_heads,
         " (MLA expands every head from the shared latent)");
  c.hidden_act_name = f.string("hidden_act", "situ");
  if (c.hidden_act_name == "situ") c.hidden_act = Activation::SiTU;
  else if (c.hidden_act_name == "silu" || c.hidden_act_name == "swiglu") c.hidden_act = Activation::SiLU;
  else
    fail(f.where("hidden_act"), ": unsupported activation \"", c.hidden_act_name, "\" (supported: \"situ\", \"silu\")");
  c.situ_beta = float(f.number_in("activation_situ_beta", 4.0, 0, 1e4, /*lo_open=*/true));
  c.situ_linear_beta = float(f.number_in("activation_situ_linear_beta", 25.0, 0, 1e4, /*lo_open=*/true));
  c.rms_norm_eps = f.number_in("rms_norm_eps", 1e-5, 0, 1, /*lo_open=*/true);

  // MLA.
  c.q_lora_rank = f.integer("q_lora_rank", 0);
  if (c.q_lora_rank < 0 || c.q_lora_rank > (1 << 24))
    fail(f.where("q_lora_rank"), " must be positive (at most 2^24) or null");
  c.kv_lora_rank = f.positive("kv_lora_rank");
  c.qk_nope_head_dim = f.positive("qk_nope_head_dim");
  c.qk_rope_head_dim = f.integer("qk_rope_head_dim", 0);
  if (c.qk_rope_head_dim < 0 || c.qk_rope_head_dim > (1 << 24))
    fail(f.where("qk_rope_head_dim"), " must be in 0..2^24, got ", c.qk_rope_head_dim);
  c.v_head_dim = f.positive("v_head_dim");
  if (!f.boolean("mla_use_nope", true))
    fail(f.where("mla_use_nope"), " is false: rotary MLA is not part of K3 and not supported");
  c.mla_use_output_gate = f.boolean("mla_use_output_gate", true);

  // MoE.
  c.intermediate_size = f.positive("intermediate_size");
  c.num_experts = f.integer("num_experts", 0);
  if (c.num_experts < 0 || c.num_experts > (1 << 20)) fail(f.where("num_experts"), " must be in 0..", 1 << 20);
  c.first_k_dense_replace = f.integer("first_k_dense_replace", 1);
  c.moe_layer_freq = f.integer("moe_layer_freq", 1);
  if (c.first_k_dense_replace < 0) fail(f.where("first_k_dense_replace"), " must be >= 0");
  if (c.moe_layer_freq < 1) fail(f.where("moe_layer_freq"), " must be >= 1");
  if (c.num_experts > 0) {
    c.num_experts_per_token = f.positive("num_experts_per_token");
    if (c.num_experts_per_token > c.num_experts)
      fail(f.where("num_experts_per_token"), " = ", c.num_experts_per_token, " exceeds num_experts = ", c.num_experts);
    c.num_shared_experts = f.integer("num_shared_experts", 0);
    if (c.num_shared_experts < 0 || c.num_shared_experts > 4096)
      fail(f.where("num_shared_experts"), " must be in 0..4096");
    c.moe_intermediate_size = f.positive("moe_intermediate_size");
    c.routed_expert_hidden_size =
        f.has("routed_expert_hidden_size") ? f.positive("routed_expert_hidden_size") : c.hidden_size;
    c.latent_moe_use_norm = f.boolean("latent_moe_use_norm", true);
    const std::string act = f.string("moe_router_activation_func", "sigmoid");
    if (act != "sigmoid")
      fail(f.where("moe_router_activation_func"), ": unsupported router function \"", act, "\" (K3 uses \"sigmoid\")");
    c.moe_renormalize = f.boolean("moe_renormalize", true);
    c.routed_scaling_factor = float(f.number_in("routed_scaling_factor", 1.0, 0, 1e4, /*lo_open=*/true));
    c.use_grouped_topk = f.boolean("use_grouped_topk", true);
    c.num_expert_group = f.integer("num_expert_group", 1);
    c.topk_group = f.integer("topk_group", 1);
    if (c.num_expert_group < 1 || c.num_experts % c.num_expert_group != 0)
      fail(f.where("num_expert_group"), " = ", c.num_expert_group, " must divide num_experts = ", c.num_experts);
    if (c.topk_group < 1 || c.topk_group > c.num_expert_group)
      fail(f.where("topk_group"), " = ", c.topk_group, " must be in 1..num_expert_group");
    c.topk_method = f.string("topk_method", "noaux_tc");
    if (c.topk_method != "noaux_tc")
      fail(f.where("topk_method"), ": unsupported \"", c.topk_method, "\" (K3 uses \"noaux_tc\")");
  }

  c.attn_res_block_size = f.positive("attn_res_block_size");
  c.max_position_embeddings =
      f.has("max_position_embeddings") ? f.positive("max_position_embeddings", int64_t(1) << 40) : 1048576;
  c.num_nextn_predict_layers = f.integer("num_nextn_predict_layers", 0);
  if (c.num_nextn_predict_layers < 0 || c.num_nextn_predict_layers > 64)
    fail(f.where("num_nextn_predict_layers"), " must be in 0..64, got ", c.num_nextn_predict_layers);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", top.boolean("tie_word_embeddings", false));
  // The ids may sit in text_config or at the top level of the release's nested layout.
  for (auto [key, dst] : {std::pair{"bos_token_id", &c.bos_token_id},
                          {"eos_token_id", &c.eos_token_id},
                          {"pad_token_id", &c.pad_token_id}})
    *dst = f.has(key) ? f.token_id(key, -1, c.vocab_size) : top.token_id(key, -1, c.vocab_size);
  c.initializer_range = float(f.number_in("initializer_range", 0.02, 0, 1e3, /*lo_open=*/false));

  // KDA.
  if (!f.has("linear_attn_config") || !tj["linear_attn_config"].is_object())
    fail(f.where("linear_attn_config"), " is missing (it holds the KDA sizes and the layer map)");
  Fields la{tj["linear_attn_config"], f.prefix + "linear_attn_config.", src};
  c.kda_num_heads = la.positive("num_heads");
  c.kda_head_dim = la.positive("head_dim");
  c.short_conv_kernel_size = la.integer("short_conv_kernel_size", 4);
  if (c.short_conv_kernel_size < 1 || c.short_conv_kernel_size > 64)
    fail(la.where("short_conv_kernel_size"), " must be in 1..64, got ", c.short_conv_kernel_size);
  if (!la.has("gate_lower_bound"))
    fail(la.where("gate_lower_bound"),
         " is missing: K3's KDA uses the lower-bounded gate (-5); the unbounded Kimi Linear gate is not supported");
  c.gate_lower_bound = float(la.number_in("gate_lower_bound", 0, -1e4, 0, /*lo_open=*/false, /*hi_open=*/true));
  if (!la.boolean("use_full_rank_gate", true))
    fail(la.where("use_full_rank_gate"), " is false: only the full-rank (per-channel) gate of K3 is supported");
  read_layer_kinds(c, la);

  // The largest stored tensor group, routed experts, bounds everything else: refuse a config whose
  // parameter count cannot be represented (computed in double, so this check itself cannot overflow).
  const double expert_params = double(c.num_hidden_layers) * double(c.num_experts) * 3.0 *
                               double(c.moe_intermediate_size) * double(c.routed_expert_hidden_size);
  const double H = double(c.num_attention_heads), hid = double(c.hidden_size);
  const double per_layer = 8.0 * double(c.kda_dim()) * (hid + double(c.kda_head_dim)) +
                           H * double(c.q_head_dim()) * (hid + double(c.q_lora_rank)) +
                           H * double(c.qk_nope_head_dim + c.v_head_dim) * double(c.kv_lora_rank) +
                           2.0 * H * double(c.v_head_dim) * hid + 3.0 * double(c.intermediate_size) * hid +
                           double(c.num_experts) * hid +
                           3.0 * double(c.moe_intermediate_size) * double(c.num_shared_experts) * hid +
                           2.0 * double(c.routed_expert_hidden_size) * hid;
  const double other = double(c.num_hidden_layers) * per_layer + 2.0 * double(c.vocab_size) * hid;
  if (expert_params + other > 0x1p62)
    fail(src,
         ": the sizes in this config imply more than 2^62 parameters (check num_experts, moe_intermediate_size, "
         "hidden_size, vocab_size)");

  // Quantisation: only the release's MXFP4 routed experts.
  if (f.has("quantization_config") || top.has("quantization_config")) {
    const json& q = f.has("quantization_config") ? tj["quantization_config"] : root["quantization_config"];
    Fields qf{q, f.has("quantization_config") ? f.prefix + "quantization_config." : "quantization_config.", src};
    const std::string method = qf.string("quant_method", ""), format = qf.string("format", "");
    if (method != "compressed-tensors" || format != "mxfp4-pack-quantized")
      fail(qf.where("format"), ": unsupported quantisation \"", method, "\"/\"", format,
           "\" (supported: compressed-tensors mxfp4-pack-quantized)");
    c.experts_mxfp4 = true;
  }
  return c;
}

K3Config load_config(const std::string& path) { return parse_config(read_file(path, "config"), path); }

}  // namespace k3
