#include "model/tensor_table.h"

#include <array>

#include "core/error.h"

namespace k3 {

namespace {

// The pieces every name is made of (K3-ARCHITECTURE.md §4). A release name is kNamespace + the flat name.
constexpr const char* kNamespace = "language_model.";
constexpr const char* kModel = "model.";
constexpr const char* kLayers = "layers.";
constexpr const char* kAttn = "self_attn.";
constexpr const char* kMlp = "mlp.";
constexpr const char* kMoe = "block_sparse_moe.";
constexpr const char* kShared = "block_sparse_moe.shared_experts.";
constexpr const char* kExperts = "block_sparse_moe.experts.";
constexpr const char* kPacked = "_packed";  // MXFP4 (compressed-tensors mxfp4-pack-quantized): `<name>_packed`,
constexpr const char* kScale = "_scale";    // `<name>_scale` in place of `<name>` = `...w1.weight`

using S = TensorScope;
using St = TensorStore;
using In = TensorInit;
using C = ParamComponent;
using Hs = HeadSplit;
constexpr DType BF16 = DType::BF16, F32 = DType::F32;

// One row per TensorKind, in enum order (checked below).
//  module    leaf                                 scope     store            dtype init             component         heads          muon   train  optional
constexpr std::array<TensorInfo, kTensorKinds> kInfo = {{
    {"", "embed_tokens.weight", S::Model, St::Matrix, BF16, In::Normal, C::Embedding, Hs::None, false, true, false},
    {"", "lm_head.weight", S::Head, St::Matrix, BF16, In::Normal, C::LmHead, Hs::None, false, true, false},
    {"", "norm.weight", S::Model, St::Vector, BF16, In::One, C::NormsAttnRes, Hs::None, false, true, false},
    {"", "output_attn_res_norm.weight", S::Model, St::Vector, BF16, In::One, C::NormsAttnRes, Hs::None, false, true,
     false},
    {"", "output_attn_res_proj.weight", S::Model, St::Vector, BF16, In::AttnResProj, C::NormsAttnRes, Hs::None, false,
     true, false},
    {"", "input_layernorm.weight", S::Layer, St::Vector, BF16, In::One, C::NormsAttnRes, Hs::None, false, true, false},
    {"", "post_attention_layernorm.weight", S::Layer, St::Vector, BF16, In::One, C::NormsAttnRes, Hs::None, false, true,
     false},
    {"", "self_attention_res_norm.weight", S::Layer, St::Vector, BF16, In::One, C::NormsAttnRes, Hs::None, false, true,
     false},
    {"", "self_attention_res_proj.weight", S::Layer, St::Vector, BF16, In::AttnResProj, C::NormsAttnRes, Hs::None,
     false, true, false},
    {"", "mlp_res_norm.weight", S::Layer, St::Vector, BF16, In::One, C::NormsAttnRes, Hs::None, false, true, false},
    {"", "mlp_res_proj.weight", S::Layer, St::Vector, BF16, In::AttnResProj, C::NormsAttnRes, Hs::None, false, true,
     false},
    {kAttn, "q_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::KdaHeads, true, true, false},
    {kAttn, "k_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::KdaHeads, true, true, false},
    {kAttn, "v_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::KdaHeads, true, true, false},
    {kAttn, "g_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::None, true, true, false},
    {kAttn, "q_conv1d.weight", S::Layer, St::Conv, F32, In::ConvUniform, C::KdaAttention, Hs::None, false, true, false},
    {kAttn, "k_conv1d.weight", S::Layer, St::Conv, F32, In::ConvUniform, C::KdaAttention, Hs::None, false, true, false},
    {kAttn, "v_conv1d.weight", S::Layer, St::Conv, F32, In::ConvUniform, C::KdaAttention, Hs::None, false, true, false},
    {kAttn, "f_a_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::None, true, true, false},
    {kAttn, "f_b_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::None, true, true, false},
    {kAttn, "b_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::None, true, true, false},
    {kAttn, "A_log", S::Layer, St::HeadVector, F32, In::ALog, C::KdaAttention, Hs::None, false, true, false},
    {kAttn, "dt_bias", S::Layer, St::Vector, F32, In::DtBias, C::KdaAttention, Hs::None, false, true, false},
    {kAttn, "o_norm.weight", S::Layer, St::Vector, F32, In::One, C::KdaAttention, Hs::None, false, true, false},
    {kAttn, "o_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::KdaAttention, Hs::None, true, true, false},
    {kAttn, "q_a_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::None, true, true, false},
    {kAttn, "q_a_layernorm.weight", S::Layer, St::Vector, BF16, In::One, C::MlaAttention, Hs::None, false, true, false},
    {kAttn, "q_b_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::MlaQHeads, true, true,
     false},
    {kAttn, "q_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::MlaQHeads, true, true, false},
    {kAttn, "kv_a_proj_with_mqa.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::None, true, true,
     false},
    {kAttn, "kv_a_layernorm.weight", S::Layer, St::Vector, BF16, In::One, C::MlaAttention, Hs::None, false, true,
     false},
    {kAttn, "kv_b_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::MlaKvHeads, true, true,
     false},
    {kAttn, "g_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::None, true, true, false},
    {kAttn, "o_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::MlaAttention, Hs::None, true, true, false},
    {kMlp, "gate_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::DenseFfn, Hs::None, true, true, false},
    {kMlp, "up_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::DenseFfn, Hs::None, true, true, false},
    {kMlp, "down_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::DenseFfn, Hs::None, true, true, false},
    {kMoe, "gate.weight", S::Layer, St::Matrix, BF16, In::Normal, C::Router, Hs::None, true, true, false},
    {kMoe, "gate.e_score_correction_bias", S::Layer, St::Vector, F32, In::RouterBias, C::Router, Hs::None, false, false,
     true},
    {kMoe, "routed_expert_down_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::Latent, Hs::None, true, true,
     false},
    {kMoe, "routed_expert_up_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::Latent, Hs::None, true, true,
     false},
    {kMoe, "routed_expert_norm.weight", S::Layer, St::Vector, BF16, In::One, C::Latent, Hs::None, false, true, false},
    {kExperts, "w1.weight", S::Expert, St::ExpertMatrix, BF16, In::Normal, C::RoutedExperts, Hs::None, true, true,
     false},
    {kExperts, "w2.weight", S::Expert, St::ExpertMatrix, BF16, In::Normal, C::RoutedExperts, Hs::None, true, true,
     false},
    {kExperts, "w3.weight", S::Expert, St::ExpertMatrix, BF16, In::Normal, C::RoutedExperts, Hs::None, true, true,
     false},
    {kShared, "gate_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::SharedExperts, Hs::None, true, true,
     false},
    {kShared, "up_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::SharedExperts, Hs::None, true, true, false},
    {kShared, "down_proj.weight", S::Layer, St::Matrix, BF16, In::Normal, C::SharedExperts, Hs::None, true, true,
     false},
}};

// The rows above must follow the enum: a few spot checks that fail the build when a row is missing.
constexpr bool leaf_is(TensorKind k, std::string_view leaf) { return std::string_view(kInfo[size_t(k)].leaf) == leaf; }
static_assert(leaf_is(TensorKind::MlpResProj, "mlp_res_proj.weight"));
static_assert(leaf_is(TensorKind::KdaO, "o_proj.weight") &&
              kInfo[size_t(TensorKind::KdaO)].component == C::KdaAttention);
static_assert(leaf_is(TensorKind::MlaO, "o_proj.weight") &&
              kInfo[size_t(TensorKind::MlaO)].component == C::MlaAttention);
static_assert(leaf_is(TensorKind::DenseDown, "down_proj.weight") &&
              kInfo[size_t(TensorKind::DenseDown)].module == kMlp);
static_assert(leaf_is(TensorKind::MoeLatentNorm, "routed_expert_norm.weight"));
static_assert(leaf_is(TensorKind::ExpertUp, "w3.weight"));
static_assert(leaf_is(TensorKind::SharedDown, "down_proj.weight") &&
              kInfo[size_t(TensorKind::SharedDown)].module == kShared);

constexpr std::array<const char*, size_t(ParamComponent::kCount)> kComponentNames = {
    "embedding",           "lm_head",        "KDA attention",  "MLA attention",  "dense FFN", "router",
    "latent down/up/norm", "routed experts", "shared experts", "norms + AttnRes"};

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Reads "<digits>." off the front of s into n; false when s does not start that way.
bool take_index(std::string_view& s, int64_t* n) {
  size_t i = 0;
  int64_t v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9' && i < 12) v = v * 10 + (s[i++] - '0');
  if (i == 0 || i >= s.size() || s[i] != '.') return false;
  *n = v;
  s.remove_prefix(i + 1);
  return true;
}

// s == module + leaf of k.
bool names_kind(std::string_view s, TensorKind k) {
  const TensorInfo& t = kInfo[size_t(k)];
  const std::string_view m(t.module), l(t.leaf);
  return s.size() == m.size() + l.size() && starts_with(s, m) && ends_with(s, l);
}

// The shape of kind k under config c (as k3 init writes it).
std::vector<int64_t> kind_shape(const K3Config& c, TensorKind k) {
  using K = TensorKind;
  const int64_t hid = c.hidden_size, H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, Hm = c.num_attention_heads;
  const int64_t E = c.num_experts, lat = c.routed_expert_hidden_size, I = c.moe_intermediate_size;
  switch (k) {
    case K::TokenEmbd:
    case K::LmHead: return {c.vocab_size, hid};
    case K::OutputNorm:
    case K::OutputAttnResNorm:
    case K::InputNorm:
    case K::PostAttnNorm:
    case K::AttnResNorm:
    case K::MlpResNorm: return {hid};
    case K::OutputAttnResProj:
    case K::AttnResProj:
    case K::MlpResProj: return {1, hid};
    case K::KdaQ:
    case K::KdaK:
    case K::KdaV:
    case K::KdaG: return {HD, hid};
    case K::KdaQConv:
    case K::KdaKConv:
    case K::KdaVConv: return {HD, 1, c.short_conv_kernel_size};
    case K::KdaFA: return {D, hid};
    case K::KdaFB: return {HD, D};
    case K::KdaB: return {H, hid};
    case K::KdaALog: return {H};
    case K::KdaDtBias: return {HD};
    case K::KdaONorm: return {D};
    case K::KdaO: return {hid, HD};
    case K::MlaQA: return {c.q_lora_rank, hid};
    case K::MlaQANorm: return {c.q_lora_rank};
    case K::MlaQB: return {Hm * c.q_head_dim(), c.q_lora_rank};
    case K::MlaQ: return {Hm * c.q_head_dim(), hid};
    case K::MlaKvA: return {c.kv_lora_rank + c.qk_rope_head_dim, hid};
    case K::MlaKvANorm: return {c.kv_lora_rank};
    case K::MlaKvB: return {Hm * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank};
    case K::MlaG: return {Hm * c.v_head_dim, hid};
    case K::MlaO: return {hid, Hm * c.v_head_dim};
    case K::DenseGate:
    case K::DenseUp: return {c.intermediate_size, hid};
    case K::DenseDown: return {hid, c.intermediate_size};
    case K::MoeRouter: return {E, hid};
    case K::MoeRouterBias: return {E};
    case K::MoeLatentDown: return {lat, hid};
    case K::MoeLatentUp: return {hid, lat};
    case K::MoeLatentNorm: return {lat};
    case K::ExpertGate:
    case K::ExpertUp: return {I, lat};
    case K::ExpertDown: return {lat, I};
    case K::SharedGate:
    case K::SharedUp: return {c.shared_intermediate(), hid};
    case K::SharedDown: return {hid, c.shared_intermediate()};
    case K::kCount: break;
  }
  K3_ASSERT(false);
  return {};
}

}  // namespace

const TensorInfo& tensor_info(TensorKind k) {
  K3_ASSERT(int(k) < kTensorKinds);
  return kInfo[size_t(k)];
}

const char* component_name(ParamComponent c) {
  K3_ASSERT(c < ParamComponent::kCount);
  return kComponentNames[size_t(c)];
}

std::string model_root(TensorNaming n) {
  return n == TensorNaming::Release ? std::string(kNamespace) + kModel : std::string(kModel);
}

std::string layer_prefix(TensorNaming n, int64_t layer) {
  K3_ASSERT(layer >= 0);
  return model_root(n) + kLayers + std::to_string(layer) + ".";
}

std::string tensor_name_at(const std::string& prefix, TensorKind k, int64_t expert) {
  const TensorInfo& t = tensor_info(k);
  K3_ASSERT(t.scope != TensorScope::Head);
  if (t.scope != TensorScope::Expert) return prefix + t.module + t.leaf;
  K3_ASSERT(expert >= 0);
  return prefix + t.module + std::to_string(expert) + "." + t.leaf;
}

std::string tensor_name(TensorNaming n, TensorKind k, int64_t layer, int64_t expert) {
  const TensorInfo& t = tensor_info(k);
  switch (t.scope) {
    case TensorScope::Head: return (n == TensorNaming::Release ? std::string(kNamespace) : std::string()) + t.leaf;
    case TensorScope::Model: return tensor_name_at(model_root(n), k);
    case TensorScope::Layer:
    case TensorScope::Expert: return tensor_name_at(layer_prefix(n, layer), k, expert);
  }
  K3_ASSERT(false);
  return {};
}

std::string mxfp4_packed_name(const std::string& weight_name) { return weight_name + kPacked; }
std::string mxfp4_scale_name(const std::string& weight_name) { return weight_name + kScale; }
bool is_mxfp4_scale_name(std::string_view name) { return ends_with(name, std::string(".weight") + kScale); }
bool is_mxfp4_name(std::string_view name) {
  return is_mxfp4_scale_name(name) || ends_with(name, std::string(".weight") + kPacked);
}

TensorPlace tensor_place(std::string_view name) {
  TensorPlace p;
  p.text = starts_with(name, kNamespace) || starts_with(name, kModel) || starts_with(name, "lm_head.");
  if (!p.text) return p;
  if (starts_with(name, kNamespace)) name.remove_prefix(std::string_view(kNamespace).size());
  const std::string layers = std::string(kModel) + kLayers;
  if (!starts_with(name, layers)) return p;
  name.remove_prefix(layers.size());
  int64_t l = -1;
  if (take_index(name, &l)) p.layer = l;
  return p;
}

std::optional<TensorId> parse_tensor_name(std::string_view name, const K3Config* c) {
  TensorId id;
  if (is_mxfp4_name(name)) {
    id.part = ends_with(name, kPacked) ? TensorPart::Mxfp4Packed : TensorPart::Mxfp4Scale;
    name.remove_suffix(std::string_view(id.part == TensorPart::Mxfp4Packed ? kPacked : kScale).size());
  }
  id.naming = starts_with(name, kNamespace) ? TensorNaming::Release : TensorNaming::Flat;
  if (id.naming == TensorNaming::Release) name.remove_prefix(std::string_view(kNamespace).size());
  auto found = [&](TensorKind k) -> std::optional<TensorId> {
    if (id.part != TensorPart::Whole && kInfo[size_t(k)].store != TensorStore::ExpertMatrix) return std::nullopt;
    id.kind = k;
    return id;
  };
  if (name == kInfo[size_t(TensorKind::LmHead)].leaf) return found(TensorKind::LmHead);
  if (!starts_with(name, kModel)) return std::nullopt;
  name.remove_prefix(std::string_view(kModel).size());
  if (!starts_with(name, kLayers)) {
    for (int k = 0; k < kTensorKinds; ++k)
      if (kInfo[size_t(k)].scope == TensorScope::Model && names_kind(name, TensorKind(k))) return found(TensorKind(k));
    return std::nullopt;
  }
  name.remove_prefix(std::string_view(kLayers).size());
  if (!take_index(name, &id.layer)) return std::nullopt;
  if (starts_with(name, kExperts)) {
    std::string_view rest = name.substr(std::string_view(kExperts).size());
    if (!take_index(rest, &id.expert)) return std::nullopt;
    for (int k = 0; k < kTensorKinds; ++k)
      if (kInfo[size_t(k)].scope == TensorScope::Expert && rest == kInfo[size_t(k)].leaf) return found(TensorKind(k));
    return std::nullopt;
  }
  // A leaf KDA and MLA share: the layer's attention kind decides when the config says it.
  const bool mla = c && id.layer < int64_t(c->layer_kind.size()) && c->layer_kind[size_t(id.layer)] == AttnKind::MLA;
  std::optional<TensorKind> first;
  for (int k = 0; k < kTensorKinds; ++k) {
    const TensorKind kind = TensorKind(k);
    if (kInfo[size_t(k)].scope != TensorScope::Layer || !names_kind(name, kind)) continue;
    const ParamComponent comp = kInfo[size_t(k)].component;
    if (comp == (mla ? C::KdaAttention : C::MlaAttention) && c) continue;
    if (!first) first = kind;
  }
  if (!first) return std::nullopt;
  return found(*first);
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

HeadBlocks head_blocks(const K3Config& c, TensorKind k) {
  switch (tensor_info(k).heads) {
    case HeadSplit::None: return {};
    case HeadSplit::KdaHeads: return {c.kda_num_heads, c.kda_head_dim};
    case HeadSplit::MlaQHeads: return {c.num_attention_heads, c.q_head_dim()};
    case HeadSplit::MlaKvHeads: return {c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim};
  }
  K3_ASSERT(false);
  return {};
}

TensorTable::TensorTable(const K3Config& c) : cfg_(c) {
  using K = TensorKind;
  auto add = [&](K k, int64_t layer = -1, int64_t expert = -1) {
    TensorEntry e;
    e.kind = k;
    e.layer = int32_t(layer);
    e.expert = int32_t(expert);
    e.shape = kind_shape(c, k);
    e.params = e.numel();
    // The release stores A_log padded with zeros to head_dim entries (K3-ARCHITECTURE.md §4.3) and the
    // parameter count follows the release; the reference's parameter (and k3 init) has num_heads.
    if (k == K::KdaALog) e.params = std::max(c.kda_head_dim, c.kda_num_heads);
    entries_.push_back(std::move(e));
  };
  add(K::TokenEmbd);
  if (!c.tie_word_embeddings) add(K::LmHead);
  for (K k : {K::OutputNorm, K::OutputAttnResNorm, K::OutputAttnResProj}) add(k);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    for (K k : {K::InputNorm, K::PostAttnNorm, K::AttnResNorm, K::AttnResProj, K::MlpResNorm, K::MlpResProj}) add(k, l);
    if (c.layer_kind.at(size_t(l)) == AttnKind::KDA) {
      for (K k : {K::KdaQ, K::KdaK, K::KdaV, K::KdaG, K::KdaQConv, K::KdaKConv, K::KdaVConv, K::KdaFA, K::KdaFB,
                  K::KdaB, K::KdaALog, K::KdaDtBias, K::KdaONorm, K::KdaO})
        add(k, l);
    } else {
      if (c.q_lora_rank > 0) {
        for (K k : {K::MlaQA, K::MlaQANorm, K::MlaQB}) add(k, l);
      } else {
        add(K::MlaQ, l);
      }
      for (K k : {K::MlaKvA, K::MlaKvANorm, K::MlaKvB}) add(k, l);
      if (c.mla_use_output_gate) add(K::MlaG, l);
      add(K::MlaO, l);
    }
    if (c.is_moe_layer(l)) {
      for (K k : {K::MoeRouter, K::MoeRouterBias, K::MoeLatentDown, K::MoeLatentUp}) add(k, l);
      if (c.latent_moe_use_norm) add(K::MoeLatentNorm, l);
      for (int64_t e = 0; e < c.num_experts; ++e)
        for (K k : {K::ExpertGate, K::ExpertDown, K::ExpertUp}) add(k, l, e);
      if (c.num_shared_experts > 0)
        for (K k : {K::SharedGate, K::SharedUp, K::SharedDown}) add(k, l);
    } else {
      for (K k : {K::DenseGate, K::DenseUp, K::DenseDown}) add(k, l);
    }
  }
}

std::string TensorTable::name(const TensorEntry& e, TensorNaming n) const {
  return tensor_name(n, e.kind, e.layer, e.expert);
}

// ---- The vision tower and projector ----

namespace {

constexpr const char* kVisionTower = "vision_tower.";
constexpr const char* kVisionBlocks = "vision_tower.encoder.blocks.";
constexpr const char* kProjector = "mm_projector.";

}  // namespace

std::string vision_tensor_name(VisionTensorKind k, int64_t block) {
  using K = VisionTensorKind;
  const auto in_block = [&](const char* leaf) {
    K3_ASSERT(block >= 0);
    return kVisionBlocks + std::to_string(block) + "." + leaf;
  };
  switch (k) {
    case K::PatchEmbed: return std::string(kVisionTower) + "patch_embed.proj.weight";
    case K::PosEmb: return std::string(kVisionTower) + "patch_embed.pos_emb.weight";
    case K::Norm0: return in_block("norm0.weight");
    case K::Norm1: return in_block("norm1.weight");
    case K::Wqkv: return in_block("wqkv.weight");
    case K::Wo: return in_block("wo.weight");
    case K::Fc0: return in_block("mlp.fc0.weight");
    case K::Fc1: return in_block("mlp.fc1.weight");
    case K::FinalNorm: return std::string(kVisionTower) + "encoder.final_layernorm.weight";
    case K::Proj0: return std::string(kProjector) + "proj.0.weight";
    case K::Proj2: return std::string(kProjector) + "proj.2.weight";
    case K::PostNorm: return std::string(kProjector) + "post_norm.weight";
    case K::kCount: break;
  }
  K3_ASSERT(false);
  return {};
}

std::vector<int64_t> vision_tensor_shape(const VisionConfig& c, VisionTensorKind k) {
  using K = VisionTensorKind;
  const int64_t w = c.hidden_size, q = c.qkv_hidden_size, I = c.intermediate_size, p = c.patch_size;
  const int64_t M = c.merged_width(), text = c.text_hidden_size;
  switch (k) {
    case K::PatchEmbed: return {w, 3, p, p};
    case K::PosEmb: return {c.pos_emb_height, c.pos_emb_width, w};
    case K::Norm0:
    case K::Norm1:
    case K::FinalNorm: return {w};
    case K::Wqkv: return {3 * q, w};
    case K::Wo: return {w, q};
    case K::Fc0: return {I, w};
    case K::Fc1: return {w, I};
    case K::Proj0: return {M, M};
    case K::Proj2: return {text, M};
    case K::PostNorm: return {text};
    case K::kCount: break;
  }
  K3_ASSERT(false);
  return {};
}

int64_t VisionTensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<VisionTensorEntry> vision_tensor_table(const VisionConfig& c) {
  using K = VisionTensorKind;
  std::vector<VisionTensorEntry> out;
  auto add = [&](K k, int64_t block = -1) {
    VisionTensorEntry e;
    e.kind = k;
    e.block = block;
    e.name = vision_tensor_name(k, block);
    e.shape = vision_tensor_shape(c, k);
    e.init =
        k == K::Norm0 || k == K::Norm1 || k == K::FinalNorm || k == K::PostNorm ? TensorInit::One : TensorInit::Normal;
    out.push_back(std::move(e));
  };
  add(K::PatchEmbed);
  add(K::PosEmb);
  for (int64_t b = 0; b < c.num_layers; ++b)
    for (K k : {K::Norm0, K::Norm1, K::Wqkv, K::Wo, K::Fc0, K::Fc1}) add(k, b);
  add(K::FinalNorm);
  for (K k : {K::Proj0, K::Proj2, K::PostNorm}) add(k);
  return out;
}

}  // namespace k3
