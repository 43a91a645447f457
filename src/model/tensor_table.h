// The K3 text model's tensor table: every tensor a config has, each name spelled once (in the
// manner of llama.cpp's src/llama-arch.cpp: an enum of tensor kinds, one name map, per-kind facts).
// The vision tower's and projector's tensors have a smaller table of their own at the end.
//
// TensorKind is one tensor of the architecture (KDA's f_a_proj, a layer's input norm, an expert's
// w1). tensor_info(kind) holds what is fixed per kind: where its name sits and how it ends, how a
// checkpoint stores it and bind_weights reads it, how k3 init draws it, which `k3 inspect` component
// counts it, and how the optimizer treats it (Muon or AdamW, Per-Head Muon blocks, trainable).
// TensorTable(cfg) lists the tensors one config has, with their shapes, in the order k3 init draws and
// writes them (one random stream runs through them in that order, so the order is part of the init's
// output: reordering the table changes every `k3 init` file and every training run of a seed).
//
// Names: the release's `language_model.model.layers.3.self_attn.q_proj.weight` and
// `language_model.lm_head.weight`, or the flat text-model form `model.layers.3.self_attn.q_proj.weight`
// and `lm_head.weight` (TensorNaming). Every literal tensor name of src/ lives in tensor_table.cpp;
// bind_weights, k3 init, the parameter count, training's ParamStore, its blocks and the optimizer
// ask here (K3-ARCHITECTURE.md §4 is the inventory this follows).
//
// Notation: hid = hidden_size, V = vocab_size, H/D = KDA heads/head dim, HD = H*D, K = conv taps,
// E = num_experts, lat = routed_expert_hidden_size, I = moe_intermediate_size.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "model/vision_config.h"

namespace k3 {

// One tensor of the architecture, in the order k3 init writes a layer's tensors (see TensorTable).
enum class TensorKind : uint8_t {
  // Model scope.
  TokenEmbd,          // embed_tokens.weight              [V, hid]
  LmHead,             // lm_head.weight                   [V, hid]   (absent when tie_word_embeddings)
  OutputNorm,         // norm.weight                      [hid]
  OutputAttnResNorm,  // output_attn_res_norm.weight      [hid]
  OutputAttnResProj,  // output_attn_res_proj.weight      [1, hid]   (the output's AttnRes pseudo-query)
  // Every layer: pre-norms and Block AttnRes before the attention and before the MLP.
  InputNorm,     // input_layernorm.weight           [hid]
  PostAttnNorm,  // post_attention_layernorm.weight  [hid]
  AttnResNorm,   // self_attention_res_norm.weight   [hid]
  AttnResProj,   // self_attention_res_proj.weight   [1, hid]
  MlpResNorm,    // mlp_res_norm.weight              [hid]
  MlpResProj,    // mlp_res_proj.weight              [1, hid]
  // KDA layer (self_attn.).
  KdaQ,
  KdaK,
  KdaV,  // {q,k,v}_proj.weight              [HD, hid]
  KdaG,  // g_proj.weight                    [HD, hid]  (output gate)
  KdaQConv,
  KdaKConv,
  KdaVConv,   // {q,k,v}_conv1d.weight [HD, 1, K]
  KdaFA,      // f_a_proj.weight                  [D, hid]   (decay gate, rank D)
  KdaFB,      // f_b_proj.weight                  [HD, D]
  KdaB,       // b_proj.weight                    [H, hid]   (beta)
  KdaALog,    // A_log                            [H]        (the release pads it to head_dim)
  KdaDtBias,  // dt_bias                          [HD]
  KdaONorm,   // o_norm.weight                    [D]        (shared by all heads)
  KdaO,       // o_proj.weight                    [hid, HD]
  // Gated MLA layer (self_attn.). Dq = qk_nope + qk_rope, R = kv_lora_rank.
  MlaQA,       // q_a_proj.weight                  [q_lora, hid]       (q_lora_rank > 0)
  MlaQANorm,   // q_a_layernorm.weight             [q_lora]            (q_lora_rank > 0)
  MlaQB,       // q_b_proj.weight                  [H*Dq, q_lora]      (q_lora_rank > 0)
  MlaQ,        // q_proj.weight                    [H*Dq, hid]         (q_lora_rank == 0)
  MlaKvA,      // kv_a_proj_with_mqa.weight        [R + qk_rope, hid]
  MlaKvANorm,  // kv_a_layernorm.weight            [R]
  MlaKvB,      // kv_b_proj.weight                 [H*(qk_nope + v), R]
  MlaG,        // g_proj.weight                    [H*v, hid]          (mla_use_output_gate)
  MlaO,        // o_proj.weight                    [hid, H*v]
  // Dense FFN (layers below first_k_dense_replace; mlp.).
  DenseGate,
  DenseUp,    // {gate,up}_proj.weight           [intermediate, hid]
  DenseDown,  // down_proj.weight                [hid, intermediate]
  // Stable LatentMoE (block_sparse_moe.).
  MoeRouter,      // gate.weight                      [E, hid]
  MoeRouterBias,  // gate.e_score_correction_bias     [E]        (selection only; not trained)
  MoeLatentDown,  // routed_expert_down_proj.weight   [lat, hid]
  MoeLatentUp,    // routed_expert_up_proj.weight     [hid, lat]
  MoeLatentNorm,  // routed_expert_norm.weight        [lat]      (latent_moe_use_norm)
  ExpertGate,     // experts.<e>.w1.weight            [I, lat]
  ExpertDown,     // experts.<e>.w2.weight            [lat, I]
  ExpertUp,       // experts.<e>.w3.weight            [I, lat]
  SharedGate,
  SharedUp,    // shared_experts.{gate,up}_proj.weight  [I*num_shared, hid]
  SharedDown,  // shared_experts.down_proj.weight       [hid, I*num_shared]
  kCount
};
constexpr int kTensorKinds = int(TensorKind::kCount);

// Where a kind's name sits: under the model root, the lm_head (beside the root), in a layer, or in
// one routed expert of a layer.
enum class TensorScope : uint8_t { Model, Head, Layer, Expert };

// How a checkpoint stores a kind and bind_weights reads it.
enum class TensorStore : uint8_t {
  Matrix,        // a Linear [out, in], bound where the checkpoint keeps it (BF16, F32 or F16)
  ExpertMatrix,  // as Matrix, or MXFP4: `<name>_packed` U8 [out, in/2] + `<name>_scale` U8 [out, in/32]
  Vector,        // small; copied to f32 at bind (any float dtype), shape checked
  Conv,          // depthwise conv taps [C, 1, K], also accepted squeezed as [C, K]; copied to f32
  HeadVector,    // A_log: one per head [H]; any length >= H is accepted (the release pads it to head_dim
                 // with zeros) and the first H are used
};

// How k3 init (and training from scratch) draws a kind (tensor_init.h). One mt19937_64 stream runs
// through the table in order; kinds that "draw nothing" leave it untouched.
enum class TensorInit : uint8_t {
  Normal,       // N(0, initializer_range), one std::normal_distribution per tensor
  One,          // 1 (norm gains); draws nothing
  AttnResProj,  // 0 (the paper's init: uniform mixing; draws nothing), or Normal with random_attnres_queries
  ConvUniform,  // U(-1/sqrt(K), 1/sqrt(K))
  ALog,         // log U(1, 16)
  DtBias,       // U(-0.5, 0.5)
  RouterBias,   // N(0, router_bias_std) from a fresh distribution per element; 0 (no draws) when the std is 0
};

// The `k3 inspect` components (param_count.h), in the order they are printed.
enum class ParamComponent : uint8_t {
  Embedding,
  LmHead,
  KdaAttention,
  MlaAttention,
  DenseFfn,
  Router,
  Latent,
  RoutedExperts,
  SharedExperts,
  NormsAttnRes,
  kCount
};
const char* component_name(ParamComponent c);  // "embedding", "lm_head", "KDA attention", ...

// Per-Head Muon: the row blocks a q/k/v projection is orthogonalised in (head_blocks()).
enum class HeadSplit : uint8_t { None, KdaHeads, MlaQHeads, MlaKvHeads };

struct TensorInfo {
  const char* module;  // after the scope's prefix, before the leaf: "self_attn.", "block_sparse_moe.experts.", ""
  const char* leaf;    // "f_a_proj.weight", "A_log", "w1.weight"
  TensorScope scope;
  TensorStore store;
  DType dtype;  // as the release stores it and k3 init writes it (routed experts: BF16, or MXFP4 by choice)
  TensorInit init;
  ParamComponent component;
  HeadSplit heads;
  bool muon;       // a linear map whose spectrum Muon orthogonalises (when it has two dimensions above 1);
                   // false: AdamW (the embedding, the head, norms, vectors, conv taps, the [1, hid] AttnRes
                   // pseudo-queries)
  bool trainable;  // false: the router's selection bias (Quantile Balancing owns it)
  bool optional;   // a checkpoint may leave it out; bind_weights then uses zeros
};
const TensorInfo& tensor_info(TensorKind k);

// ---- Names ----

enum class TensorNaming { Release, Flat };

// "language_model.model." (Release) or "model." (Flat).
std::string model_root(TensorNaming n);
// model_root(n) + "layers.<layer>."
std::string layer_prefix(TensorNaming n, int64_t layer);
// The full name of a tensor. layer: for Layer and Expert kinds; expert: for Expert kinds.
std::string tensor_name(TensorNaming n, TensorKind k, int64_t layer = -1, int64_t expert = -1);
// For code that holds a prefix already: prefix + module (+ "<expert>." for Expert kinds) + leaf, where
// prefix is layer_prefix(...) for Layer/Expert kinds and model_root(...) for Model kinds (not LmHead).
// The training blocks take their layer's prefix from their caller and name their tensors with this.
std::string tensor_name_at(const std::string& prefix, TensorKind k, int64_t expert = -1);

// Names bound to one naming, for a schedule that names many tensors (llama.cpp's `tn`):
//   const TensorNames tn(naming);  P.p(tn(TensorKind::AttnResNorm, l))
struct TensorNames {
  TensorNaming naming = TensorNaming::Release;
  std::string operator()(TensorKind k, int64_t layer = -1, int64_t expert = -1) const {
    return tensor_name(naming, k, layer, expert);
  }
};

// The naming of a checkpoint or parameter store, told by which embedding name `has` knows; nullopt
// when it knows neither.
template <class Has>
std::optional<TensorNaming> detect_naming(Has&& has) {
  for (TensorNaming n : {TensorNaming::Release, TensorNaming::Flat})
    if (has(tensor_name(n, TensorKind::TokenEmbd))) return n;
  return std::nullopt;
}

// The MXFP4 pair that replaces an ExpertMatrix's `<name>` (e.g. `...experts.3.w1.weight`).
std::string mxfp4_packed_name(const std::string& weight_name);  // `<name>_packed`
std::string mxfp4_scale_name(const std::string& weight_name);   // `<name>_scale`
bool is_mxfp4_name(std::string_view name);                      // ends in `_packed` or `_scale` of a weight
bool is_mxfp4_scale_name(std::string_view name);

// ---- Reading names back ----

enum class TensorPart : uint8_t { Whole, Mxfp4Packed, Mxfp4Scale };

struct TensorId {
  TensorKind kind = TensorKind::TokenEmbd;
  int64_t layer = -1, expert = -1;
  TensorNaming naming = TensorNaming::Release;
  TensorPart part = TensorPart::Whole;
};

// The kind of a text-model tensor name in either naming (MXFP4 parts parse as their matrix, with
// `part` set); nullopt for any other name. KDA and MLA layers share the leaves q_proj, g_proj and
// o_proj: with a config the layer's kind decides, without one the KDA kind is returned (the two
// agree in every per-kind fact but the Per-Head Muon split).
std::optional<TensorId> parse_tensor_name(std::string_view name, const K3Config* c = nullptr);

// Where a name sits, for names the table may not know (a checkpoint's extra tensors): whether it is
// under a text-model root (`[language_model.]model.` or `[language_model.]lm_head.`) and its layer
// (-1: outside the layers).
struct TensorPlace {
  bool text = false;
  int64_t layer = -1;
};
TensorPlace tensor_place(std::string_view name);

// ---- The table of one config ----

struct TensorEntry {
  TensorKind kind = TensorKind::TokenEmbd;
  int32_t layer = -1, expert = -1;
  std::vector<int64_t> shape;  // as k3 init writes it and bind_weights expects it (A_log [H], conv [C, 1, K])
  int64_t params = 0;          // the parameters it counts for: its numel, but A_log as the release
                               // stores it, padded to head_dim entries when head_dim > num_heads
  int64_t numel() const;
  const TensorInfo& info() const { return tensor_info(kind); }
};

// Per-Head Muon row blocks of a tensor: `heads` blocks of `rows` rows each (heads == 0: no split).
struct HeadBlocks {
  int64_t heads = 0, rows = 0;
};
HeadBlocks head_blocks(const K3Config& c, TensorKind k);

class TensorTable {
 public:
  // Every tensor of the text model of `c`, in k3 init's order: the model-scope tensors, then per layer
  // the norms and AttnRes pairs, the attention (KDA or MLA), the FFN (dense, or the router, latent
  // projections, experts 0..E-1 as w1 w2 w3, shared experts).
  explicit TensorTable(const K3Config& c);

  const K3Config& config() const { return cfg_; }
  const std::vector<TensorEntry>& entries() const { return entries_; }
  std::string name(const TensorEntry& e, TensorNaming n = TensorNaming::Release) const;

 private:
  K3Config cfg_;
  std::vector<TensorEntry> entries_;
};

// ---- The vision tower and projector ----
//
// Beside the text model, a multimodal checkpoint holds MoonViT-V2's `vision_tower.*` and PatchMergerMLPV2's
// `mm_projector.*` (K3-ARCHITECTURE.md §8), no biases. VisionModel::load (model/vision.h) reads them and k3 init
// writes them (init_random.h); both take names and shapes from here. Notation: w = vt_hidden_size, p =
// patch_size, qkv = qkv_hidden_size, I = vt_intermediate_size, M = merged_width() (w * merge_h * merge_w),
// text = text_hidden_size, H0/W0 = init_pos_emb_height/width.

// One vision tensor, in the order k3 init writes a block's tensors (see vision_tensor_table).
enum class VisionTensorKind : uint8_t {
  PatchEmbed,  // vision_tower.patch_embed.proj.weight             [w, 3, p, p]  (the 14 x 14 conv)
  PosEmb,      // vision_tower.patch_embed.pos_emb.weight          [H0, W0, w]   (learned; resized per grid)
  Norm0,       // vision_tower.encoder.blocks.<b>.norm0.weight     [w]
  Norm1,       // vision_tower.encoder.blocks.<b>.norm1.weight     [w]
  Wqkv,        // vision_tower.encoder.blocks.<b>.wqkv.weight      [3 qkv, w]
  Wo,          // vision_tower.encoder.blocks.<b>.wo.weight        [w, qkv]
  Fc0,         // vision_tower.encoder.blocks.<b>.mlp.fc0.weight   [I, w]
  Fc1,         // vision_tower.encoder.blocks.<b>.mlp.fc1.weight   [w, I]
  FinalNorm,   // vision_tower.encoder.final_layernorm.weight      [w]
  Proj0,       // mm_projector.proj.0.weight                       [M, M]
  Proj2,       // mm_projector.proj.2.weight                       [text, M]
  PostNorm,    // mm_projector.post_norm.weight                    [text]
  kCount
};

// The full name of a vision tensor; block: for the per-block kinds (Norm0 .. Fc1).
std::string vision_tensor_name(VisionTensorKind k, int64_t block = -1);
// Its shape under c, as VisionModel expects it and k3 init writes it.
std::vector<int64_t> vision_tensor_shape(const VisionConfig& c, VisionTensorKind k);

struct VisionTensorEntry {
  VisionTensorKind kind = VisionTensorKind::PatchEmbed;
  int64_t block = -1;
  std::string name;
  std::vector<int64_t> shape;
  // How k3 init draws it (tensor_init.h): Normal, N(0, initializer_range), for the matrices and the position
  // table; One for the norm gains.
  TensorInit init = TensorInit::Normal;
  // How k3 init stores it: BF16, as it stores the text model's matrices and norms.
  DType dtype = DType::BF16;
  int64_t numel() const;
};

// Every tensor of the tower and projector of c, in k3 init's order (after the text model's: see TensorTable):
// the patch embedding and position table, each block's norm0 norm1 wqkv wo fc0 fc1, the final norm, then the
// projector's proj.0, proj.2 and post_norm.
std::vector<VisionTensorEntry> vision_tensor_table(const VisionConfig& c);

}  // namespace k3
