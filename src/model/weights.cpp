#include "model/weights.h"

#include "core/error.h"

namespace k3 {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  TensorView t;
  t.shape = s;
  return t.shape_str();
}

class Binder {
 public:
  Binder(const K3Config& cfg, const SafeTensors& st) : cfg_(cfg), st_(st) {
    if (st.has("language_model.model.embed_tokens.weight")) {
      prefix_ = "language_model.model.";
      head_ = "language_model.lm_head.weight";
    } else if (st.has("model.embed_tokens.weight")) {
      prefix_ = "model.";
      head_ = "lm_head.weight";
    } else {
      fail(st.path(), ": missing tensor 'language_model.model.embed_tokens.weight' (release naming) or "
                      "'model.embed_tokens.weight' (flat naming)");
    }
  }
  const std::string& head_name() const { return head_; }
  std::string full(const std::string& n) const { return prefix_ + n; }

  const TensorView& view(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& t = st_.get(name);
    if (t.shape != shape)
      fail(*t.file, ": tensor '", name, "' has shape ", t.shape_str(), ", expected ", shape_str(shape),
           " from ", cfg_.source);
    return t;
  }

  WeightRef matrix_abs(const std::string& name, int64_t rows, int64_t cols) const {
    const TensorView& t = view(name, {rows, cols});
    WeightRef w;
    w.rows = rows;
    w.cols = cols;
    w.data = t.data;
    switch (t.dtype) {
      case DType::F32: w.format = WeightRef::Format::F32; break;
      case DType::BF16: w.format = WeightRef::Format::BF16; break;
      case DType::F16: w.format = WeightRef::Format::F16; break;
      default: fail(*t.file, ": tensor '", name, "' has dtype ", dtype_name(t.dtype), ", expected F32, BF16 or F16");
    }
    return w;
  }
  WeightRef matrix(const std::string& n, int64_t rows, int64_t cols) const { return matrix_abs(full(n), rows, cols); }

  // A Linear that may be stored plain (`<n>.weight`) or MXFP4 (`<n>.weight_packed` + `<n>.weight_scale`).
  WeightRef maybe_mxfp4(const std::string& n, int64_t rows, int64_t cols) const {
    const std::string packed = full(n + ".weight_packed");
    if (!st_.has(packed)) return matrix(n + ".weight", rows, cols);
    if (cols % 32 != 0) fail(st_.path(), ": tensor '", packed, "': MXFP4 needs in-features divisible by 32, got ", cols);
    const TensorView& p = view(packed, {rows, cols / 2});
    const TensorView& s = view(full(n + ".weight_scale"), {rows, cols / 32});
    for (const TensorView* t : {&p, &s})
      if (t->dtype != DType::U8) fail(*t->file, ": tensor '", t->name, "' has dtype ", dtype_name(t->dtype), ", expected U8");
    WeightRef w;
    w.format = WeightRef::Format::MXFP4;
    w.rows = rows;
    w.cols = cols;
    w.data = p.data;
    w.scales = s.data;
    return w;
  }

  std::vector<float> vec(const std::string& n, const std::vector<int64_t>& shape) const {
    return st_.read_f32(full(n), shape);
  }
  std::vector<float> vec_abs(const std::string& n, const std::vector<int64_t>& shape) const {
    return st_.read_f32(n, shape);
  }
  bool has(const std::string& n) const { return st_.has(full(n)); }
  const SafeTensors& st() const { return st_; }

 private:
  const K3Config& cfg_;
  const SafeTensors& st_;
  std::string prefix_, head_;
};

std::vector<float> fold_query(const Binder& b, const std::string& norm, const std::string& proj, int64_t hidden) {
  std::vector<float> q = b.vec(norm, {hidden});
  std::vector<float> p = b.vec(proj, {1, hidden});
  for (int64_t i = 0; i < hidden; ++i) q[size_t(i)] *= p[size_t(i)];
  return q;
}

GluFfnWeights bind_glu(const Binder& b, const std::string& p, int64_t inter, int64_t in) {
  GluFfnWeights f;
  f.gate_proj = b.matrix(p + "gate_proj.weight", inter, in);
  f.up_proj = b.matrix(p + "up_proj.weight", inter, in);
  f.down_proj = b.matrix(p + "down_proj.weight", in, inter);
  return f;
}

void bind_kda(const Binder& b, const K3Config& c, const std::string& p, KdaWeights& w) {
  const int64_t hid = c.hidden_size, H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, K = c.short_conv_kernel_size;
  w.q_proj = b.matrix(p + "q_proj.weight", HD, hid);
  w.k_proj = b.matrix(p + "k_proj.weight", HD, hid);
  w.v_proj = b.matrix(p + "v_proj.weight", HD, hid);
  w.f_a_proj = b.matrix(p + "f_a_proj.weight", D, hid);
  w.f_b_proj = b.matrix(p + "f_b_proj.weight", HD, D);
  w.b_proj = b.matrix(p + "b_proj.weight", H, hid);
  w.g_proj = b.matrix(p + "g_proj.weight", HD, hid);
  w.o_proj = b.matrix(p + "o_proj.weight", hid, HD);
  for (auto [name, dst] : {std::pair{"q_conv1d.weight", &w.q_conv}, {"k_conv1d.weight", &w.k_conv}, {"v_conv1d.weight", &w.v_conv}}) {
    const std::string n = b.full(p + name);
    const TensorView& t = b.st().get(n);
    if (t.shape == std::vector<int64_t>{HD, 1, K}) *dst = b.vec_abs(n, {HD, 1, K});
    else *dst = b.vec_abs(n, {HD, K});  // also accept the squeezed [C, K] layout
  }
  // A_log is per head; the release pads it with zeros to head_dim entries. Accept any length >= H.
  const std::string alog = b.full(p + "A_log");
  const TensorView& t = b.st().get(alog);
  if (t.shape.size() != 1 || t.shape[0] < H)
    fail(*t.file, ": tensor '", alog, "' has shape ", t.shape_str(), ", expected [", H, "] (one per head, possibly padded)");
  w.A_log = b.vec_abs(alog, t.shape);
  w.A_log.resize(size_t(H));
  w.dt_bias = b.vec(p + "dt_bias", {HD});
  w.o_norm = b.vec(p + "o_norm.weight", {D});
}

void bind_mla(const Binder& b, const K3Config& c, const std::string& p, MlaWeights& w) {
  const int64_t hid = c.hidden_size, H = c.num_attention_heads, dq = c.q_head_dim(), R = c.kv_lora_rank;
  if (c.q_lora_rank > 0) {
    w.q_a_proj = b.matrix(p + "q_a_proj.weight", c.q_lora_rank, hid);
    w.q_a_layernorm = b.vec(p + "q_a_layernorm.weight", {c.q_lora_rank});
    w.q_b_proj = b.matrix(p + "q_b_proj.weight", H * dq, c.q_lora_rank);
  } else {
    w.q_proj = b.matrix(p + "q_proj.weight", H * dq, hid);
  }
  w.kv_a_proj_with_mqa = b.matrix(p + "kv_a_proj_with_mqa.weight", R + c.qk_rope_head_dim, hid);
  w.kv_a_layernorm = b.vec(p + "kv_a_layernorm.weight", {R});
  w.kv_b_proj = b.matrix(p + "kv_b_proj.weight", H * (c.qk_nope_head_dim + c.v_head_dim), R);
  if (c.mla_use_output_gate) w.g_proj = b.matrix(p + "g_proj.weight", H * c.v_head_dim, hid);
  w.o_proj = b.matrix(p + "o_proj.weight", hid, H * c.v_head_dim);
}

void bind_moe(const Binder& b, const K3Config& c, const std::string& p, MoeWeights& w) {
  const int64_t hid = c.hidden_size, E = c.num_experts, lat = c.routed_expert_hidden_size, I = c.moe_intermediate_size;
  w.router = b.matrix(p + "gate.weight", E, hid);
  w.router_bias = b.has(p + "gate.e_score_correction_bias") ? b.vec(p + "gate.e_score_correction_bias", {E})
                                                            : std::vector<float>(size_t(E), 0.0f);
  w.latent_down = b.matrix(p + "routed_expert_down_proj.weight", lat, hid);
  w.latent_up = b.matrix(p + "routed_expert_up_proj.weight", hid, lat);
  if (c.latent_moe_use_norm) w.latent_norm = b.vec(p + "routed_expert_norm.weight", {lat});
  w.experts.resize(size_t(E));
  for (int64_t e = 0; e < E; ++e) {
    const std::string ep = p + "experts." + std::to_string(e) + ".";
    w.experts[size_t(e)].w1 = b.maybe_mxfp4(ep + "w1", I, lat);
    w.experts[size_t(e)].w3 = b.maybe_mxfp4(ep + "w3", I, lat);
    w.experts[size_t(e)].w2 = b.maybe_mxfp4(ep + "w2", lat, I);
  }
  if (c.num_shared_experts > 0) w.shared = bind_glu(b, p + "shared_experts.", c.shared_intermediate(), hid);
}

}  // namespace

ModelWeights bind_weights(const K3Config& c, const SafeTensors& st) {
  Binder b(c, st);
  const int64_t hid = c.hidden_size;
  ModelWeights m;
  m.embed_tokens = b.matrix("embed_tokens.weight", c.vocab_size, hid);
  if (c.tie_word_embeddings && !st.has(b.head_name())) m.lm_head = m.embed_tokens;
  else m.lm_head = b.matrix_abs(b.head_name(), c.vocab_size, hid);
  m.norm = b.vec("norm.weight", {hid});
  m.output_res_query = fold_query(b, "output_attn_res_norm.weight", "output_attn_res_proj.weight", hid);
  m.layers.resize(size_t(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& L = m.layers[size_t(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    L.kind = c.layer_kind[size_t(l)];
    L.is_moe = c.is_moe_layer(l);
    L.input_layernorm = b.vec(p + "input_layernorm.weight", {hid});
    L.post_attention_layernorm = b.vec(p + "post_attention_layernorm.weight", {hid});
    L.attn_res_query = fold_query(b, p + "self_attention_res_norm.weight", p + "self_attention_res_proj.weight", hid);
    L.mlp_res_query = fold_query(b, p + "mlp_res_norm.weight", p + "mlp_res_proj.weight", hid);
    if (L.kind == AttnKind::KDA) bind_kda(b, c, p + "self_attn.", L.kda);
    else bind_mla(b, c, p + "self_attn.", L.mla);
    if (L.is_moe) bind_moe(b, c, p + "block_sparse_moe.", L.moe);
    else L.dense = bind_glu(b, p + "mlp.", c.intermediate_size, hid);
  }
  return m;
}

}  // namespace k3
