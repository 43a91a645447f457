// The vision pathway's config: MoonViT-V2 (the tower) and PatchMergerMLPV2 (the projector to the text width),
// from config.json's `vision_config` (K3-ARCHITECTURE.md §2.3; field names as released).
//
// The text width the projector writes is `vision_config.text_hidden_size`, or a top-level `text_hidden_size`
// (a directory that holds only a vision tower and projector), or the text model's hidden_size; where more than
// one is given they must agree. Kinds other than the release's (norm, MLP, position embedding, merge, projector,
// activations) are refused with the field named; biases are counted by param_count but refused by the model.
#pragma once
#include <cstdint>
#include <string>

namespace k3 {

struct VisionConfig {
  std::string source;  // the config file, for messages
  int64_t patch_size = 14;
  int64_t hidden_size = 0;        // vt_hidden_size: the tower's width
  int64_t intermediate_size = 0;  // vt_intermediate_size
  int64_t num_heads = 0;          // vt_num_attention_heads
  int64_t num_layers = 0;         // vt_num_hidden_layers
  int64_t qkv_hidden_size = 0;    // heads * head dim (1536 in the release, not the width)
  int64_t pos_emb_height = 0, pos_emb_width = 0, pos_emb_time = 0;  // init_pos_emb_*
  int64_t merge_h = 2, merge_w = 2;                                 // merge_kernel_size
  int64_t mm_hidden_size = 0;  // the tower width the projector takes (= hidden_size)
  int64_t text_hidden_size = 0;
  double projector_eps = 1e-5;  // projector_ln_eps
  bool attn_bias = false, linear_bias = false, patch_embed_bias = false;

  int64_t head_dim() const { return qkv_hidden_size / num_heads; }
  int64_t patch_values() const { return 3 * patch_size * patch_size; }         // one patch: (C, p, p)
  int64_t merged_width() const { return mm_hidden_size * merge_h * merge_w; }  // the projector's input
  // The merged tokens of an h x w patch grid (each frame's, pooled over a clip's frames): what the image adds.
  int64_t merged_tokens(int64_t h, int64_t w) const { return (h / merge_h) * (w / merge_w); }
};

// `text` holds a config.json. Returns false (and leaves *out alone) when it has no vision_config; any
// malformed or unsupported field is a k3::Error naming src and the field. The text width falls back to the
// file's text model (text_config.hidden_size, or a flat config's hidden_size), else to
// text_hidden_size_fallback (> 0), when neither vision_config.text_hidden_size nor a top-level one is given.
bool parse_vision_config(const std::string& text, const std::string& src, VisionConfig* out,
                         int64_t text_hidden_size_fallback = 0);
// The same from a file: a config.json, or a model directory holding one. A k3::Error when it has no
// vision_config.
VisionConfig load_vision_config(const std::string& path);
// A k3::Error naming `where` when the config asks for biases (attn_bias, linear_bias, patch_embed_proj_bias):
// MoonViT-V2 has none, and neither the model nor k3 init has a place for them.
void check_vision_biases(const VisionConfig& c, const std::string& where);

}  // namespace k3
