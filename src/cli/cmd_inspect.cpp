// `k3 inspect --config FILE`: reads a K3 config.json (nested release form or flat text-model
// form), prints a summary of the architecture and the parameter count per component
// (total and active per token), then the totals.
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "model/config.h"
#include "model/param_count.h"

namespace k3::cli {
namespace {

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}

std::string num(double x) {
  std::ostringstream s;
  s << x;
  return s.str();
}

void run_inspect(const std::string& path) {
  const K3Config c = load_config(path);
  const std::vector<ParamGroup> text = count_parameters(c);
  const std::vector<ParamGroup> vision = count_vision_parameters(path);

  const int64_t L = c.num_hidden_layers;
  std::vector<int64_t> mla, dense, boundaries;
  for (int64_t l = 0; l < L; ++l) {
    if (c.layer_kind[size_t(l)] == AttnKind::MLA) mla.push_back(l);
    if (!c.is_moe_layer(l)) dense.push_back(l);
    if (l % c.attn_res_block_size == 0) boundaries.push_back(l);
  }
  const int64_t n_mla = int64_t(mla.size()), n_kda = L - n_mla, n_moe = L - int64_t(dense.size());

  std::printf("config: %s\n", path.c_str());
  std::printf("layers: %lld (%lld KDA, %lld MLA); MLA at 0-based layers %s\n", (long long)L, (long long)n_kda,
              (long long)n_mla, mla.empty() ? "(none)" : join(mla).c_str());
  std::printf("hidden: %lld, vocab: %lld, rms_norm_eps: %s, tie_word_embeddings: %s\n", (long long)c.hidden_size,
              (long long)c.vocab_size, num(c.rms_norm_eps).c_str(), c.tie_word_embeddings ? "yes" : "no");
  std::printf("KDA: %lld heads x %lld, short conv %lld, gate lower bound %s\n", (long long)c.kda_num_heads,
              (long long)c.kda_head_dim, (long long)c.short_conv_kernel_size, num(c.gate_lower_bound).c_str());
  std::printf("MLA: %lld heads, q_lora %lld, kv_lora %lld, qk_nope %lld, qk_rope %lld (NoPE), v %lld, output gate %s\n",
              (long long)c.num_attention_heads, (long long)c.q_lora_rank, (long long)c.kv_lora_rank,
              (long long)c.qk_nope_head_dim, (long long)c.qk_rope_head_dim, (long long)c.v_head_dim,
              c.mla_use_output_gate ? "yes" : "no");
  std::printf("FFN: activation %s", c.hidden_act_name.c_str());
  if (c.hidden_act == Activation::SiTU)
    std::printf(" (beta %s / %s)", num(c.situ_beta).c_str(), num(c.situ_linear_beta).c_str());
  std::printf("; dense (intermediate %lld) at 0-based layers %s\n", (long long)c.intermediate_size,
              dense.empty()        ? "(none)"
              : dense.size() <= 16 ? join(dense).c_str()
                                   : "(many)");
  if (n_moe > 0)
    std::printf(
        "MoE: %lld LatentMoE layers, %lld routed experts, top-%lld, %lld shared (intermediate %lld), "
        "latent %lld, expert intermediate %lld, sigmoid router, routed scaling %s\n",
        (long long)n_moe, (long long)c.num_experts, (long long)c.num_experts_per_token, (long long)c.num_shared_experts,
        (long long)c.shared_intermediate(), (long long)c.routed_expert_hidden_size, (long long)c.moe_intermediate_size,
        num(c.routed_scaling_factor).c_str());
  std::printf("AttnRes: block size %lld, %zu blocks (boundaries at 0-based layers %s), %zu sources at the output\n",
              (long long)c.attn_res_block_size, boundaries.size(), join(boundaries).c_str(), boundaries.size() + 1);
  std::printf("vision_config: %s; routed experts MXFP4: %s\n", c.has_vision_config ? "present" : "absent",
              c.experts_mxfp4 ? "yes" : "no");

  std::printf("\n%-22s %10s %17s %10s %17s\n", "component", "total", "(exact)", "active", "(exact)");
  auto row = [](const ParamGroup& g) {
    std::printf("%-22s %10s %17lld %10s %17lld\n", g.name.c_str(), format_count(g.total).c_str(), (long long)g.total,
                format_count(g.active).c_str(), (long long)g.active);
  };
  for (const auto& g : text) row(g);
  const int64_t text_total = total_params(text), active = active_params(text);
  std::printf("%s\n", std::string(22 + 4 * 11 + 2 * 7, '-').c_str());
  row({"text model", text_total, active});
  for (const auto& g : vision) row(g);
  const int64_t total = text_total + total_params(vision);

  std::printf("\n");
  if (vision.empty()) std::printf("total parameters: %s\n", format_count(total).c_str());
  else
    std::printf("total parameters: %s (text model %s + vision %s)\n", format_count(total).c_str(),
                format_count(text_total).c_str(), format_count(total_params(vision)).c_str());
  std::printf("active parameters: %s (excluding the input embedding)\n", format_count(active).c_str());
}

}  // namespace

void register_inspect(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  CLI::App* sub = app.add_subcommand(
      "inspect",
      "Read a Kimi K3 config.json (nested KimiK3ForConditionalGeneration or flat KimiLinearForCausalLM) and "
      "print the architecture (layer map, heads, dims, experts, AttnRes blocks, vision/MXFP4), the parameter "
      "count per component (total and active per token), and the total and active parameter counts. "
      "Needs no weights.");
  sub->add_option("--config", *path, "config.json to read")->required();
  sub->callback([path] { run_inspect(*path); });
}

}  // namespace k3::cli
