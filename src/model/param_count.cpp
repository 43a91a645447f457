#include "model/param_count.h"

#include <array>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "io/file.h"
#include "model/tensor_table.h"
#include "model/vision_config.h"

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
  VisionConfig v;
  if (!parse_vision_config(text, src, &v)) return {};
  const int64_t p = v.patch_size, w = v.hidden_size, inter = v.intermediate_size, qkv = v.qkv_hidden_size;
  int64_t tower = w * 3 * p * p + (v.patch_embed_bias ? w : 0);  // patch_embed.proj [w, 3, p, p]
  tower += v.pos_emb_height * v.pos_emb_width * w;  // patch_embed.pos_emb [ph, pw, w] (time emb is fixed sin-cos)
  int64_t block = 3 * qkv * w + (v.attn_bias ? 3 * qkv : 0);  // wqkv
  block += w * qkv + (v.attn_bias ? w : 0);                   // wo
  block += 2 * w;                                             // norm0, norm1
  block += inter * w + (v.linear_bias ? inter : 0);           // mlp.fc0
  block += w * inter + (v.linear_bias ? w : 0);               // mlp.fc1
  tower += v.num_layers * block + w;                          // blocks + final_layernorm
  const int64_t in = v.merged_width(), text_w = v.text_hidden_size;
  const int64_t projector = in * in + text_w * in + text_w;  // proj.0, proj.2, post_norm
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
