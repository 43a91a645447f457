// Parameter counts from a K3Config, per component: the sum of the tensor table's `params`
// (tensor_table.h), which follows the tensor inventory of ../shared/docs/K3-ARCHITECTURE.md §4
// exactly (one entry per stored tensor element).
//
// `total` is what the checkpoint stores; `active` is what one text token touches: the top-k routed
// experts out of num_experts, every other weight of the text model, and the lm_head, but not the
// input embedding (a row gather, not a matmul) and not the vision tower.
//
// For the released config this gives, for the text model, 2,779,484,478,208 total (2.779T) and
// 104,189,614,848 active (104.2B); adding the vision tower (401.2M) and projector (46.1M) gives
// 2,779,931,837,184 (2.780T), the report's 2.78T.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace k3 {

struct ParamGroup {
  std::string name;
  int64_t total = 0;
  int64_t active = 0;
};

// Text model, in this order (groups that are empty for the config are left out):
//   "embedding"            [vocab, hidden]; active 0. With tie_word_embeddings it is also the
//                          lm_head, counted once, and then active (the lm_head uses it).
//   "lm_head"              [vocab, hidden] (absent when tied)
//   "KDA attention"        q/k/v/g_proj, 3 convs, f_a, f_b, A_log, dt_bias, b_proj, o_norm, o_proj.
//                          A_log is counted as the release stores it: padded to head_dim entries
//                          when head_dim > num_heads, else num_heads.
//   "MLA attention"        q_a + q_a_layernorm + q_b (or q_proj when q_lora_rank == 0), kv_a,
//                          kv_a_layernorm, kv_b, g_proj (if mla_use_output_gate), o_proj
//   "dense FFN"            gate/up/down of the layers below first_k_dense_replace
//   "router"               gate.weight [E, hidden] + e_score_correction_bias [E]
//   "latent down/up/norm"  routed_expert_down_proj, routed_expert_up_proj, routed_expert_norm
//   "routed experts"       w1/w3 [moe_inter, latent], w2 [latent, moe_inter] per expert;
//                          active: num_experts_per_token of them per layer
//   "shared experts"       gate/up/down of the fused shared MLP (moe_inter * num_shared wide)
//   "norms + AttnRes"      per layer: input/post norms, two AttnRes norms and two AttnRes
//                          pseudo-queries; model: norm, output_attn_res_norm/proj
std::vector<ParamGroup> count_parameters(const K3Config& cfg);

// Vision tower (MoonViT: patch embed, learned pos-emb, blocks, final norm) and projector
// (PatchMergerV2), from the `vision_config` of the config file at `config_path` (§2.3, §4.7).
// Returns {"vision tower", "vision projector"}, both with active 0 (a text token touches neither),
// or nothing when the file has no vision_config. Throws k3::Error naming the field on bad values.
// (K3Config does not keep the vision sizes, so the file is read again.)
std::vector<ParamGroup> count_vision_parameters(const std::string& config_path);
std::vector<ParamGroup> count_vision_parameters_json(const std::string& json_text, const std::string& source);

int64_t total_params(const std::vector<ParamGroup>& groups);
int64_t active_params(const std::vector<ParamGroup>& groups);

// 4 significant digits with a K/M/B/T suffix: "2.780T", "104.2B", "1.234M", "46.14M", "12.00K";
// below 1000 the plain integer ("999"). A value that rounds up to 1000 of a unit moves to the next
// unit ("1.000B").
std::string format_count(int64_t n);

}  // namespace k3
