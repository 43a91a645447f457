// `k3 inspect --config FILE`: reads a K3 config.json (nested release form or flat text-model
// form), prints a summary of the architecture and the parameter count per component
// (total and active per token), then the totals.
#include <cmath>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/validate.h"
#include "model/config.h"
#include "model/param_count.h"
#include "model/placement.h"

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

std::string gib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", double(bytes) / double(uint64_t(1) << 30));
  return buf;
}

// The placement plan of model/placement.h for `o.gpus` GPUs.
void print_placement(const std::string& path, const PlacementOptions& o) {
  const K3Config c = load_config(path);
  const Placement p = plan_placement(c, path, o);
  std::printf("\nplacement on %lld GPUs of %s (%s reserved on each for caches and activations):\n", (long long)o.gpus,
              gib(o.gpu_bytes).c_str(), gib(o.reserve_bytes).c_str());
  std::printf("  stored: %s (%llu bytes): trunk %s, %lld routed experts of %llu bytes (%s), vision %s\n",
              gib(p.bytes.total()).c_str(), (unsigned long long)p.bytes.total(), gib(p.bytes.trunk).c_str(),
              (long long)p.bytes.experts, (unsigned long long)p.bytes.expert,
              gib(uint64_t(p.bytes.experts) * p.bytes.expert).c_str(), gib(p.bytes.vision).c_str());
  std::printf("  trunk split over the GPUs: %s per GPU\n", gib(p.trunk_per_gpu).c_str());
  std::printf("  experts per rank: %lld; in HBM: %lld (%.1f%%); in pinned host memory: %lld (%s per rank, %s in all)\n",
              (long long)p.experts_per_rank, (long long)p.experts_on_gpu, 100.0 * p.resident_fraction,
              (long long)(p.experts_per_rank - p.experts_on_gpu), gib(p.host_bytes_per_rank).c_str(),
              gib(p.host_bytes_per_rank * uint64_t(o.gpus)).c_str());
  std::printf("  with the whole trunk copied to every GPU instead: %lld experts per GPU fit\n",
              (long long)p.experts_on_gpu_replicated);
  std::printf("  decode at batch 1 reads %s per token: HBM ceiling %.1f tok/s (%.1f TB/s per GPU)",
              gib(p.decode_bytes).c_str(), p.hbm_ceiling, o.hbm_bytes_per_s / 1e12);
  if (std::isfinite(p.pcie_ceiling))
    std::printf("; host experts over PCIe (%.0f GB/s per GPU): ceiling %.1f tok/s\n", o.pcie_bytes_per_s / 1e9,
                p.pcie_ceiling);
  else std::printf("; no expert is in host memory\n");
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
  auto place = std::make_shared<PlacementOptions>();
  auto gpu_gib = std::make_shared<double>(139), reserve_gib = std::make_shared<double>(16);
  CLI::Option* gpus = sub->add_option("--gpus", place->gpus,
                                      "also print where the weights go on this many GPUs: trunk split over them, "
                                      "experts split by expert parallelism, what does not fit in pinned host "
                                      "memory, and the decode bandwidth ceilings");
  sub->add_option("--gpu-gib", *gpu_gib, "memory per GPU, GiB (with --gpus)")->capture_default_str();
  sub->add_option("--reserve-gib", *reserve_gib, "per GPU, kept for caches and activations, GiB (with --gpus)")
      ->capture_default_str();
  sub->callback([path, place, gpus, gpu_gib, reserve_gib] {
    run_inspect(*path);
    if (gpus->count() == 0) return;
    require_number("--gpu-gib", *gpu_gib, 0, 1e6, /*lo_open=*/true);
    require_number("--reserve-gib", *reserve_gib, 0, 1e6);
    require_integer("--gpus", place->gpus, 1, 1 << 20);
    place->gpu_bytes = uint64_t(*gpu_gib * double(uint64_t(1) << 30));
    place->reserve_bytes = uint64_t(*reserve_gib * double(uint64_t(1) << 30));
    print_placement(*path, *place);
  });
}

}  // namespace k3::cli
