#include "model/vision_config.h"

#include <filesystem>

#include "core/error.h"
#include "core/json.h"
#include "io/file.h"
#include "model/config_fields.h"

namespace k3 {

using config_fields::Fields;
using config_fields::json;

namespace {

// A string field that must hold the release's value (`want`) when present.
void require_kind(const Fields& f, const std::string& k, const std::string& want, const char* what) {
  const std::string v = f.string(k, want);
  if (v != want) fail(f.where(k), ": unsupported \"", v, "\" (", what, " uses \"", want, "\")");
}

bool read_vision_config(const json& root, const std::string& src, VisionConfig* out,
                        int64_t text_hidden_size_fallback) {
  if (!root.is_object()) fail(src, ": expected a JSON object at the top level");
  if (!root.contains("vision_config") || root["vision_config"].is_null()) return false;
  if (!root["vision_config"].is_object()) fail(src, ": field 'vision_config' must be an object");
  const Fields f{root["vision_config"], "vision_config.", src};
  const Fields top{root, "", src};

  VisionConfig c;
  c.source = src;
  c.patch_size = f.positive("patch_size", 1 << 10);
  c.hidden_size = f.positive("vt_hidden_size");
  c.intermediate_size = f.positive("vt_intermediate_size");
  c.num_heads = f.positive("vt_num_attention_heads", 1 << 12);
  c.num_layers = f.positive("vt_num_hidden_layers", 1 << 12);
  c.qkv_hidden_size = f.has("qkv_hidden_size") ? f.positive("qkv_hidden_size") : c.hidden_size;
  if (c.qkv_hidden_size % c.num_heads != 0)
    fail(f.where("qkv_hidden_size"), " = ", c.qkv_hidden_size,
         " is not a multiple of vt_num_attention_heads = ", c.num_heads);
  if (c.head_dim() % 4 != 0)
    fail(f.where("qkv_hidden_size"), ": the head dim ", c.head_dim(),
         " must be a multiple of 4 (2D RoPE turns pairs by row and by column)");
  c.pos_emb_height = f.positive("init_pos_emb_height", 1 << 12);
  c.pos_emb_width = f.positive("init_pos_emb_width", 1 << 12);
  c.pos_emb_time = f.positive("init_pos_emb_time", 1 << 12);
  if (f.has("merge_kernel_size")) {
    const json& m = f.j["merge_kernel_size"];
    if (!m.is_array() || m.size() != 2 || !m[0].is_number_integer() || !m[1].is_number_integer() ||
        m[0].get<int64_t>() <= 0 || m[1].get<int64_t>() <= 0 || m[0].get<int64_t>() > 64 || m[1].get<int64_t>() > 64)
      fail(f.where("merge_kernel_size"), " must be two integers in [1, 64], got ", m.dump());
    c.merge_h = m[0].get<int64_t>();
    c.merge_w = m[1].get<int64_t>();
  }
  c.mm_hidden_size = f.has("mm_hidden_size") ? f.positive("mm_hidden_size") : c.hidden_size;
  if (c.mm_hidden_size != c.hidden_size)
    fail(f.where("mm_hidden_size"), " = ", c.mm_hidden_size, " must equal vt_hidden_size = ", c.hidden_size,
         " (the projector takes the tower's merged patches)");
  c.projector_eps = f.number_in("projector_ln_eps", 1e-5, 0, 1, /*lo_open=*/true);
  c.attn_bias = f.boolean("attn_bias", false);
  c.linear_bias = f.boolean("linear_bias", false);
  c.patch_embed_bias = f.boolean("patch_embed_proj_bias", false);

  require_kind(f, "norm_type", "rmsnorm", "MoonViT-V2");
  require_kind(f, "mlp_type", "mlp2", "MoonViT-V2");
  require_kind(f, "activation_func", "gelu_pytorch_tanh", "MoonViT-V2");
  require_kind(f, "pos_emb_type", "divided_fixed", "MoonViT-V2");
  require_kind(f, "pos_emb_interpolation_mode", "bilinear", "MoonViT-V2");
  require_kind(f, "merge_type", "sd2_tpool", "K3");
  require_kind(f, "mm_projector_type", "patchmergerv2", "K3");
  require_kind(f, "projector_hidden_act", "gelu", "K3's projector");

  // The text width: vision_config's, the top level's, or the text model's (text_config.hidden_size, or a flat
  // config's hidden_size; else the caller's fallback); those given must agree.
  if (const json& t = root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
      t.contains("hidden_size") && t["hidden_size"].is_number_integer() && t["hidden_size"].get<int64_t>() > 0)
    text_hidden_size_fallback = t["hidden_size"].get<int64_t>();
  int64_t text_h = 0;
  std::string text_h_from;
  for (const Fields* g : {&f, &top}) {
    if (!g->has("text_hidden_size")) continue;
    const int64_t v = g->positive("text_hidden_size");
    if (text_h != 0 && v != text_h)
      fail(g->where("text_hidden_size"), " = ", v, " disagrees with ", text_h_from, " = ", text_h);
    text_h = v;
    text_h_from = g->where("text_hidden_size");
  }
  if (text_h != 0 && text_hidden_size_fallback > 0 && text_h != text_hidden_size_fallback)
    fail(text_h_from, " = ", text_h, " disagrees with the text model's hidden_size = ", text_hidden_size_fallback);
  if (text_h == 0) text_h = text_hidden_size_fallback;
  if (text_h <= 0) fail(f.where("text_hidden_size"), " is missing (and there is no text model to take it from)");
  c.text_hidden_size = text_h;
  *out = c;
  return true;
}

}  // namespace

bool parse_vision_config(const std::string& text, const std::string& src, VisionConfig* out,
                         int64_t text_hidden_size_fallback) {
  return read_vision_config(parse_json(text, src), src, out, text_hidden_size_fallback);
}

VisionConfig load_vision_config(const std::string& path) {
  std::error_code ec;
  const std::string file =
      std::filesystem::is_directory(path, ec) ? (std::filesystem::path(path) / "config.json").string() : path;
  VisionConfig c;
  if (!parse_vision_config(read_file(file, "config"), file, &c))
    fail(file, ": no vision_config (this model has no vision tower)");
  return c;
}

void check_vision_biases(const VisionConfig& c, const std::string& where) {
  if (c.attn_bias || c.linear_bias || c.patch_embed_bias)
    fail(where,
         ": vision_config asks for biases (attn_bias, linear_bias or patch_embed_proj_bias); MoonViT-V2 has none, "
         "and k3cpp neither loads nor writes them");
}

}  // namespace k3
