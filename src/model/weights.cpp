#include "model/weights.h"

#include "core/error.h"

namespace k3 {
namespace {

using K = TensorKind;

std::string shape_str(const std::vector<int64_t>& s) {
  TensorView t;
  t.shape = s;
  return t.shape_str();
}

// Reads tensors of one checkpoint by name, checking shapes and dtypes (errors name the file and tensor).
class Binder {
 public:
  Binder(const K3Config& cfg, const SafeTensors& st) : cfg_(cfg), st_(st) {
    const auto n = detect_naming([&](const std::string& name) { return st.has(name); });
    if (!n)
      fail(st.path(), ": missing tensor '", tensor_name(TensorNaming::Release, K::TokenEmbd), "' (release naming) or '",
           tensor_name(TensorNaming::Flat, K::TokenEmbd), "' (flat naming)");
    naming_ = *n;
  }
  TensorNaming naming() const { return naming_; }
  bool has(const std::string& name) const { return st_.has(name); }

  const TensorView& view(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& t = st_.get(name);
    if (t.shape != shape)
      fail(*t.file, ": tensor '", name, "' has shape ", t.shape_str(), ", expected ", shape_str(shape), " from ",
           cfg_.source);
    return t;
  }

  // TensorStore::Matrix: where the checkpoint keeps it, as BF16, F32 or F16.
  WeightRef matrix(const std::string& name, int64_t rows, int64_t cols) const {
    return matrix_weight(st_, name, {rows, cols}, cfg_.source);
  }

  // TensorStore::ExpertMatrix: plain (`name`) or MXFP4 (`name`_packed + `name`_scale).
  WeightRef maybe_mxfp4(const std::string& name, int64_t rows, int64_t cols) const {
    const std::string packed = mxfp4_packed_name(name);
    if (!st_.has(packed)) return matrix(name, rows, cols);
    if (cols % 32 != 0)
      fail(st_.path(), ": tensor '", packed, "': MXFP4 needs in-features divisible by 32, got ", cols);
    const TensorView& p = view(packed, {rows, cols / 2});
    const TensorView& s = view(mxfp4_scale_name(name), {rows, cols / 32});
    for (const TensorView* t : {&p, &s})
      if (t->dtype != DType::U8)
        fail(*t->file, ": tensor '", t->name, "' has dtype ", dtype_name(t->dtype), ", expected U8");
    WeightRef w;
    w.format = WeightRef::Format::MXFP4;
    w.rows = rows;
    w.cols = cols;
    w.data = p.data;
    w.scales = s.data;
    return w;
  }

  // TensorStore::Vector.
  std::vector<float> vec(const std::string& name, const std::vector<int64_t>& shape) const {
    return st_.read_f32(name, shape);
  }

  // TensorStore::Conv: [C, 1, K], or the squeezed [C, K].
  std::vector<float> conv(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& t = st_.get(name);
    if (t.shape == shape) return st_.read_f32(name, shape);
    return st_.read_f32(name, {shape[0], shape[2]});
  }

  // TensorStore::HeadVector (A_log): per head; the release pads it with zeros to head_dim entries, so any
  // length >= heads is accepted and the first `heads` are kept.
  std::vector<float> head_vector(const std::string& name, int64_t heads) const {
    const TensorView& t = st_.get(name);
    if (t.shape.size() != 1 || t.shape[0] < heads)
      fail(*t.file, ": tensor '", name, "' has shape ", t.shape_str(), ", expected [", heads,
           "] (one per head, possibly padded)");
    std::vector<float> v = st_.read_f32(name, t.shape);
    v.resize(size_t(heads));
    return v;
  }

 private:
  const K3Config& cfg_;
  const SafeTensors& st_;
  TensorNaming naming_ = TensorNaming::Release;
};

// The field of `m` a matrix entry binds to.
WeightRef& matrix_slot(ModelWeights& m, const TensorEntry& e) {
  if (e.kind == K::TokenEmbd) return m.embed_tokens;
  if (e.kind == K::LmHead) return m.lm_head;
  LayerWeights& L = m.layers.at(size_t(e.layer));
  if (e.expert >= 0) {
    ExpertWeights& x = L.moe.experts.at(size_t(e.expert));
    return e.kind == K::ExpertGate ? x.w1 : e.kind == K::ExpertUp ? x.w3 : x.w2;
  }
  WeightRef* w = layer_matrix(L, e.kind);
  K3_ASSERT(w != nullptr);
  return *w;
}

// The field of `m` a vector entry binds to (an AttnRes norm and its projection share one: weights.h).
std::vector<float>& vector_slot(ModelWeights& m, const TensorEntry& e) {
  if (e.kind == K::OutputNorm) return m.norm;
  if (e.kind == K::OutputAttnResNorm || e.kind == K::OutputAttnResProj) return m.output_res_query;
  std::vector<float>* v = layer_vector(m.layers.at(size_t(e.layer)), e.kind);
  K3_ASSERT(v != nullptr);
  return *v;
}

bool is_attnres_proj(TensorKind k) { return k == K::OutputAttnResProj || k == K::AttnResProj || k == K::MlpResProj; }

}  // namespace

WeightRef matrix_weight(const SafeTensors& st, const std::string& name, const std::vector<int64_t>& shape,
                        const std::string& cfg_source) {
  const TensorView& t = st.get(name);
  if (t.shape != shape)
    fail(*t.file, ": tensor '", name, "' has shape ", t.shape_str(), ", expected ", shape_str(shape), " from ",
         cfg_source);
  WeightRef w;
  w.rows = shape.empty() ? 0 : shape[0];
  w.cols = w.rows > 0 ? t.numel() / w.rows : 0;
  w.data = t.data;
  switch (t.dtype) {
    case DType::F32: w.format = WeightRef::Format::F32; break;
    case DType::BF16: w.format = WeightRef::Format::BF16; break;
    case DType::F16: w.format = WeightRef::Format::F16; break;
    default: fail(*t.file, ": tensor '", name, "' has dtype ", dtype_name(t.dtype), ", expected F32, BF16 or F16");
  }
  return w;
}

ModelWeights bind_weights(const K3Config& c, const SafeTensors& st) {
  const TensorTable table(c);
  const Binder b(c, st);
  ModelWeights m;
  m.layers.resize(size_t(c.num_hidden_layers));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& L = m.layers[size_t(l)];
    L.kind = c.layer_kind[size_t(l)];
    L.is_moe = c.is_moe_layer(l);
    if (L.is_moe) L.moe.experts.resize(size_t(c.num_experts));
  }
  for (const TensorEntry& e : table.entries()) {
    const std::string name = table.name(e, b.naming());
    const TensorInfo& t = e.info();
    switch (t.store) {
      case TensorStore::Matrix: matrix_slot(m, e) = b.matrix(name, e.shape[0], e.shape[1]); break;
      case TensorStore::ExpertMatrix: matrix_slot(m, e) = b.maybe_mxfp4(name, e.shape[0], e.shape[1]); break;
      case TensorStore::Conv: vector_slot(m, e) = b.conv(name, e.shape); break;
      case TensorStore::HeadVector: vector_slot(m, e) = b.head_vector(name, e.shape[0]); break;
      case TensorStore::Vector: {
        std::vector<float>& dst = vector_slot(m, e);
        if (t.optional && !b.has(name)) {
          dst.assign(size_t(e.numel()), 0.0f);  // e.g. a router without e_score_correction_bias
        } else if (is_attnres_proj(e.kind)) {
          const std::vector<float> proj = b.vec(name, e.shape);
          K3_ASSERT(dst.size() == proj.size());  // the table puts each AttnRes norm before its projection
          for (size_t i = 0; i < dst.size(); ++i) dst[i] *= proj[i];
        } else {
          dst = b.vec(name, e.shape);
        }
        break;
      }
    }
  }
  // A tied head is the embedding, unless the checkpoint stores one anyway.
  if (c.tie_word_embeddings) {
    const std::string head = tensor_name(b.naming(), K::LmHead);
    m.lm_head = st.has(head) ? b.matrix(head, c.vocab_size, c.hidden_size) : m.embed_tokens;
  }
  return m;
}

}  // namespace k3
