#include "model/model.h"

#include <deque>
#include <filesystem>

#include "core/error.h"
#include "kernels/attnres/attnres.h"
#include "kernels/norm/norm.h"
#include "model/decoder.h"
#include "model/nonfinite.h"

namespace k3 {

std::unique_ptr<Model> Model::load(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(dir, ": not a model directory (expected config.json and safetensors inside)");
  return load((fs::path(dir) / "config.json").string(), dir);
}

std::unique_ptr<Model> Model::load(const std::string& config_path, const std::string& weights_path) {
  auto m = std::unique_ptr<Model>(new Model());
  m->cfg_ = load_config(config_path);
  m->st_ = SafeTensors::open(weights_path);
  m->w_ = bind_weights(m->cfg_, m->st_);
  for (const std::string& n : m->st_.names()) {
    const TensorView& t = m->st_.get(n);
    m->weight_bytes_ += size_t(t.numel()) * dtype_size(t.dtype);
  }
  return m;
}

void check_new_tokens(const K3Config& c, size_t b, const std::vector<int32_t>& tokens, int64_t cached_length) {
  const int64_t V = c.vocab_size;
  K3_CHECK(!tokens.empty(), "forward: sequence ", b, " has no new tokens");
  for (int32_t id : tokens)
    K3_CHECK(id >= 0 && id < V, "token id ", id, " in sequence ", b, " is outside the vocabulary [0, ", V, ")");
  K3_CHECK(cached_length + int64_t(tokens.size()) <= c.max_position_embeddings, "sequence ", b, " would reach ",
           cached_length + int64_t(tokens.size()),
           " tokens, past max_position_embeddings = ", c.max_position_embeddings, " of ", c.source);
}

namespace {

// The CPU backend of the decoder schedule (model/decoder.h): fp32 activations, the kernels' fp64
// accumulation, a check of every block output for non-finite values. Buffers live in `store_`, which
// keeps them for the whole forward (a deque: handles stay valid as it grows).
class CpuBackend {
 public:
  using Act = float*;

  CpuBackend(const K3Config& c, const SafeTensors& st, const ModelWeights& w, const PathOptions& opt,
             const std::vector<Segment>& segs, const std::vector<std::vector<int32_t>>& tokens, int64_t N,
             bool all_positions, const ForwardHooks* hooks)
      : c_(c),
        st_(st),
        w_(w),
        opt_(opt),
        segs_(segs),
        tokens_(tokens),
        N_(N),
        D_(c.hidden_size),
        all_positions_(all_positions),
        hooks_(hooks),
        h_(size_t(N * D_)),
        xn_(size_t(N * D_)),
        out_(size_t(N * D_)) {}

  bool profiling() const { return opt_.profile; }
  void synchronize() {}

  Act embed() {  // no scaling
    float* e = new_buffer();
    int64_t r = 0;
    for (const auto& seq : tokens_)
      for (int32_t id : seq) w_.embed_tokens.rows_to_f32(e + r++ * D_, id, 1);
    if (hooks_)
      for (const auto& [row, x] : input_rows_of(*hooks_, segs_, D_)) std::copy_n(x, D_, e + row * D_);
    check_block_finite(c_, st_, "embedding", -1, e, N_, D_);
    return e;
  }

  void mix(MixSite site, int64_t l, const std::vector<Act>& blocks, Act partial) {
    const LayerWeights* L = l >= 0 ? &w_.layers[size_t(l)] : nullptr;
    const std::vector<float>& query = site == MixSite::AttnIn  ? L->attn_res_query
                                      : site == MixSite::FfnIn ? L->mlp_res_query
                                                               : w_.output_res_query;
    if (blocks.empty()) {
      std::copy_n(partial, N_ * D_, h_.data());
    } else {
      srcs_.assign(blocks.begin(), blocks.end());
      srcs_.push_back(partial);
      attnres_forward(h_.data(), srcs_.data(), int(srcs_.size()), N_, D_, query.data(), c_.rms_norm_eps);
      opt_.bf16(h_.data(), N_ * D_);  // the GPU's fused AttnRes + norm reads h rounded to its output type
    }
    if (site == MixSite::Output) return;  // head() normalises only the rows it keeps
    const std::vector<float>& norm = site == MixSite::AttnIn ? L->input_layernorm : L->post_attention_layernorm;
    rmsnorm_forward(xn_.data(), h_.data(), norm.data(), c_.rms_norm_eps, N_, D_);
    opt_.bf16(xn_);
    if (hooks_ && hooks_->tensor) hooks_->tensor(site == MixSite::AttnIn ? "attn_in" : "ffn_in", l, xn_.data(), N_, D_);
  }

  Act attention(int64_t l) {
    const LayerWeights& L = w_.layers[size_t(l)];
    if (L.kind == AttnKind::KDA) kda_attention_forward(out_.data(), xn_.data(), N_, segs_, l, L.kda, c_, opt_);
    else mla_attention_forward(out_.data(), xn_.data(), N_, segs_, l, L.mla, c_, opt_);
    return out_.data();
  }

  Act ffn(int64_t l) {
    const LayerWeights& L = w_.layers[size_t(l)];
    if (L.is_moe) moe_ffn_forward(out_.data(), xn_.data(), N_, l, L.moe, c_, hooks_, opt_);
    else dense_ffn_forward(out_.data(), xn_.data(), N_, L.dense, c_, opt_);
    return out_.data();
  }

  void block_output(const char* name, int64_t l, Act out) {
    if (hooks_ && hooks_->tensor) hooks_->tensor(name, l, out, N_, D_);
    if (hooks_ && hooks_->replace) hooks_->replace(name, l, out, N_, D_);
    check_block_finite(c_, st_, name, l, out, N_, D_);
  }

  Act start_partial(Act out) {
    float* p = new_buffer();
    std::copy_n(out, N_ * D_, p);
    return p;
  }
  void add_partial(Act& partial, Act out) {
    for (int64_t i = 0; i < N_ * D_; ++i) partial[i] += out[i];
  }

  // Output: the selected rows of the final AttnRes, the final norm, lm_head (no soft-cap, no scaling).
  std::vector<float> head() {
    std::vector<int64_t> rows;
    if (all_positions_)
      for (int64_t r = 0; r < N_; ++r) rows.push_back(r);
    else
      for (const Segment& s : segs_) rows.push_back(s.row0 + s.n - 1);
    const int64_t M = int64_t(rows.size()), V = c_.vocab_size;
    std::vector<float> hn(size_t(M * D_));
    for (int64_t i = 0; i < M; ++i) std::copy_n(&h_[size_t(rows[size_t(i)] * D_)], D_, &hn[size_t(i * D_)]);
    rmsnorm_forward(hn.data(), hn.data(), w_.norm.data(), c_.rms_norm_eps, M, D_);
    opt_.bf16(hn);
    std::vector<float> logits(size_t(M * V));
    linear_forward(logits.data(), hn.data(), M, w_.lm_head);
    check_block_finite(c_, st_, "logits", -1, logits.data(), M, V);
    return logits;
  }

 private:
  float* new_buffer() { return store_.emplace_back(size_t(N_ * D_)).data(); }

  const K3Config& c_;
  const SafeTensors& st_;
  const ModelWeights& w_;
  const PathOptions& opt_;
  const std::vector<Segment>& segs_;
  const std::vector<std::vector<int32_t>>& tokens_;
  const int64_t N_, D_;
  const bool all_positions_;
  const ForwardHooks* hooks_;
  std::deque<std::vector<float>> store_;  // the partial sums and completed blocks
  std::vector<float> h_, xn_, out_;       // the last mix's AttnRes output and its norm; a block output
  std::vector<const float*> srcs_;
};

}  // namespace

std::vector<std::pair<int64_t, const float*>> input_rows_of(const ForwardHooks& hooks, const std::vector<int64_t>& row0,
                                                            const std::vector<int64_t>& n, int64_t hidden) {
  K3_CHECK(hooks.input_rows.size() <= row0.size(), "forward: input rows for ", hooks.input_rows.size(),
           " sequences, and the forward has ", row0.size());
  std::vector<std::pair<int64_t, const float*>> out;
  for (size_t b = 0; b < hooks.input_rows.size(); ++b)
    for (const InputRows& r : hooks.input_rows[b]) {
      K3_CHECK(r.at >= 0 && r.n >= 0 && r.at + r.n <= n[b] && (r.data || r.n == 0), "forward: input rows [", r.at, ", ",
               r.at + r.n, ") of sequence ", b, ", which adds ", n[b], " tokens");
      for (int64_t i = 0; i < r.n; ++i) out.emplace_back(row0[b] + r.at + i, r.data + i * hidden);
    }
  return out;
}

std::vector<float> Model::forward(const std::vector<SequenceCache*>& caches,
                                  const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                  const ForwardHooks* hooks) {
  K3_CHECK(caches.size() == tokens.size(), "forward: ", caches.size(), " caches for ", tokens.size(), " sequences");
  std::vector<Segment> segs;
  int64_t N = 0;
  for (size_t b = 0; b < tokens.size(); ++b) {
    check_new_tokens(cfg_, b, tokens[b], caches[b]->length);
    segs.push_back({N, int64_t(tokens[b].size()), caches[b]});
    N += int64_t(tokens[b].size());
  }
  CpuBackend be(cfg_, st_, w_, opt_, segs, tokens, N, all_positions, hooks);
  std::vector<float> logits = decoder_forward(be, cfg_, &timings_);
  for (const Segment& s : segs) s.cache->length += s.n;
  // Expert parallelism: every rank runs the trunk itself, and ranks whose thread counts or BLAS kernels differ
  // could round a logit differently and sample another token (then their next forwards would no longer match).
  // Rank 0's logits are everyone's.
  if (opt_.expert_group && opt_.expert_group->size() > 1)
    opt_.expert_group->broadcast(logits.data(), int64_t(logits.size() * sizeof(float)), 0);
  return logits;
}

}  // namespace k3
