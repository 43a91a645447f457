#include "model/param_count.h"

#include <array>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "io/file.h"
#include "model/tensor_table.h"

namespace k3 {

std::vector<ParamGroup> count_parameters(const K3Config& c) {
  // Every tensor of the table counts for its component; active is what one token reads: not the input
  // embedding (a row gather) unless it is also the head, and num_experts_per_token of the experts.
  std::array<ParamGroup, size_t(ParamComponent::kCount)> g;
  for (int i = 0; i < int(ParamComponent::kCount); ++i) g[size_t(i)].name = component_name(ParamComponent(i));
  const TensorTable table(c);
  for (const TensorEntry& e : table.entries()) {
    ParamGroup& x = g[size_t(e.info().component)];
    x.total += e.params;
    const bool active = e.kind == TensorKind::TokenEmbd ? c.tie_word_embeddings
                        : e.expert >= 0                 ? e.expert < c.num_experts_per_token
                                                        : true;
    if (active) x.active += e.params;
  }
  std::vector<ParamGroup> out;
  for (const ParamGroup& x : g)
    if (x.total > 0) out.push_back(x);
  return out;
}

std::vector<ParamGroup> count_vision_parameters_json(const std::string& text, const std::string& src) {
  using json = nlohmann::json;
  const json root = parse_json(text, src);
  if (!root.is_object() || !root.contains("vision_config") || root["vision_config"].is_null()) return {};
  const json& v = root["vision_config"];
  if (!v.is_object()) fail(src, ": field 'vision_config' must be an object");
  auto where = [&](const std::string& k) { return src + ": field 'vision_config." + k + "'"; };
  auto positive = [&](const std::string& k) -> int64_t {
    if (!v.contains(k) || v[k].is_null()) fail(where(k), " is missing");
    if (!v[k].is_number_integer() || v[k].get<int64_t>() <= 0)
      fail(where(k), " must be a positive integer, got ", v[k].dump());
    return v[k].get<int64_t>();
  };
  auto flag = [&](const std::string& k) -> bool {
    if (!v.contains(k) || v[k].is_null()) return false;
    if (!v[k].is_boolean()) fail(where(k), " must be true or false, got ", v[k].dump());
    return v[k].get<bool>();
  };
  auto str = [&](const std::string& k, const std::string& def) -> std::string {
    if (!v.contains(k) || v[k].is_null()) return def;
    if (!v[k].is_string()) fail(where(k), " must be a string, got ", v[k].dump());
    return v[k].get<std::string>();
  };
  const int64_t p = positive("patch_size"), w = positive("vt_hidden_size"), inter = positive("vt_intermediate_size");
  const int64_t layers = positive("vt_num_hidden_layers"), qkv = positive("qkv_hidden_size");
  const int64_t ph = positive("init_pos_emb_height"), pw = positive("init_pos_emb_width");
  const int64_t mm = positive("mm_hidden_size"), text_h = positive("text_hidden_size");
  int64_t mh = 2, mw = 2;
  if (v.contains("merge_kernel_size")) {
    const json& m = v["merge_kernel_size"];
    if (!m.is_array() || m.size() != 2 || !m[0].is_number_integer() || !m[1].is_number_integer() ||
        m[0].get<int64_t>() <= 0 || m[1].get<int64_t>() <= 0)
      fail(where("merge_kernel_size"), " must be two positive integers, got ", m.dump());
    mh = m[0].get<int64_t>();
    mw = m[1].get<int64_t>();
  }
  const std::string norm = str("norm_type", "rmsnorm"), mlp = str("mlp_type", "mlp2");
  const std::string proj = str("mm_projector_type", "patchmergerv2"), pos = str("pos_emb_type", "divided_fixed");
  if (norm != "rmsnorm") fail(where("norm_type"), ": unsupported \"", norm, "\" (MoonViT-V2 uses \"rmsnorm\")");
  if (mlp != "mlp2") fail(where("mlp_type"), ": unsupported \"", mlp, "\" (MoonViT-V2 uses \"mlp2\")");
  if (proj != "patchmergerv2")
    fail(where("mm_projector_type"), ": unsupported \"", proj, "\" (K3 uses \"patchmergerv2\")");
  if (pos != "divided_fixed")
    fail(where("pos_emb_type"), ": unsupported \"", pos, "\" (MoonViT-V2 uses \"divided_fixed\")");
  const bool attn_bias = flag("attn_bias"), lin_bias = flag("linear_bias"), pe_bias = flag("patch_embed_proj_bias");

  int64_t tower = w * 3 * p * p + (pe_bias ? w : 0);  // patch_embed.proj [w, 3, p, p]
  tower += ph * pw * w;                               // patch_embed.pos_emb [ph, pw, w] (time emb is fixed sin-cos)
  int64_t block = 3 * qkv * w + (attn_bias ? 3 * qkv : 0);   // wqkv
  block += w * qkv + (attn_bias ? w : 0);                    // wo
  block += 2 * w;                                            // norm0, norm1
  block += inter * w + (lin_bias ? inter : 0);               // mlp.fc0
  block += w * inter + (lin_bias ? w : 0);                   // mlp.fc1
  tower += layers * block + w;                               // blocks + final_layernorm
  const int64_t in = mm * mh * mw;                           // merged patch width
  const int64_t projector = in * in + text_h * in + text_h;  // proj.0, proj.2, post_norm
  return {{"vision tower", tower, 0}, {"vision projector", projector, 0}};
}

std::vector<ParamGroup> count_vision_parameters(const std::string& path) {
  return count_vision_parameters_json(read_file(path, "config"), path);
}

int64_t total_params(const std::vector<ParamGroup>& g) {
  int64_t n = 0;
  for (auto& x : g) n += x.total;
  return n;
}

int64_t active_params(const std::vector<ParamGroup>& g) {
  int64_t n = 0;
  for (auto& x : g) n += x.active;
  return n;
}

std::string format_count(int64_t n) {
  if (n < 0) {
    std::string s(1, '-');
    s += format_count(n == INT64_MIN ? INT64_MAX : -n);
    return s;
  }
  if (n < 1000) return std::to_string(n);
  static const char* suffix[] = {"K", "M", "B", "T", "P", "E"};
  int u = 0;
  double scale = 1e3;
  while (u < 5 && double(n) >= scale * 1e3) {
    scale *= 1e3;
    ++u;
  }
  double m = double(n) / scale;  // in [1, 1000)
  for (;;) {
    const int decimals = m < 10 ? 3 : m < 100 ? 2 : 1;
    const double p = std::pow(10.0, decimals);
    const double r = std::round(m * p) / p;
    // Rounding may carry into another decade (9.9996 -> 10.00) or unit (999.96 -> 1.000 next unit).
    if (r >= 1000 && u < 5) {
      m = r / 1000;
      ++u;
      continue;
    }
    const int d2 = r < 10 ? 3 : r < 100 ? 2 : 1;
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f%s", d2, r, suffix[u]);
    return buf;
  }
}

}  // namespace k3
