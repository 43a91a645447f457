#include "model/model.h"

#include <chrono>
#include <filesystem>

#include "core/error.h"
#include "kernels/attnres/attnres.h"
#include "kernels/norm/norm.h"
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
  return m;
}

void check_new_tokens(const K3Config& c, size_t b, const std::vector<int32_t>& tokens, int64_t cached_length) {
  const int64_t V = c.vocab_size;
  K3_CHECK(!tokens.empty(), "forward: sequence ", b, " has no new tokens");
  for (int32_t id : tokens)
    K3_CHECK(id >= 0 && id < V, "token id ", id, " in sequence ", b, " is outside the vocabulary [0, ", V, ")");
  K3_CHECK(cached_length + int64_t(tokens.size()) <= c.max_position_embeddings, "sequence ", b, " would reach ",
           cached_length + int64_t(tokens.size()), " tokens, past max_position_embeddings = ",
           c.max_position_embeddings, " of ", c.source);
}

std::vector<float> Model::forward(const std::vector<SequenceCache*>& caches, const std::vector<std::vector<int32_t>>& tokens,
                                  bool all_positions, const ForwardHooks* hooks) {
  const K3Config& c = cfg_;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  K3_CHECK(caches.size() == tokens.size(), "forward: ", caches.size(), " caches for ", tokens.size(), " sequences");
  std::vector<Segment> segs;
  int64_t N = 0;
  for (size_t b = 0; b < tokens.size(); ++b) {
    check_new_tokens(c, b, tokens[b], caches[b]->length);
    segs.push_back({N, int64_t(tokens[b].size()), caches[b]});
    N += int64_t(tokens[b].size());
  }
  // Profiling: tick(slot) charges the time since the previous tick to slot.
  auto last = std::chrono::steady_clock::now();
  auto tick = [&](double& slot) {
    if (!opt_.profile) return;
    const auto now = std::chrono::steady_clock::now();
    slot += std::chrono::duration<double>(now - last).count();
    last = now;
  };
  auto emit = [&](const char* name, int64_t l, const float* p) {
    if (hooks && hooks->tensor) hooks->tensor(name, l, p, N, D);
  };
  auto emit_output = [&](const char* name, int64_t l, float* p) {  // a block output: also `replace`
    emit(name, l, p);
    if (hooks && hooks->replace) hooks->replace(name, l, p, N, D);
  };

  // Embedding (no scaling). prefix = the running partial sum of the current AttnRes block.
  std::vector<float> prefix(size_t(N * D));
  {
    int64_t r = 0;
    for (const auto& seq : tokens)
      for (int32_t id : seq) w_.embed_tokens.rows_to_f32(&prefix[size_t(r++ * D)], id, 1);
  }
  check_block_finite(c, st_, "embedding", -1, prefix.data(), N, D);
  tick(timings_.embed);
  std::vector<std::vector<float>> blocks;  // completed block sums, the embedding first
  std::vector<float> h(size_t(N * D)), xn(size_t(N * D)), a(size_t(N * D));
  std::vector<const float*> srcs;
  auto attnres = [&](float* out, const float* partial, const std::vector<float>& query) {
    srcs.clear();
    for (auto& b : blocks) srcs.push_back(b.data());
    srcs.push_back(partial);
    attnres_forward(out, srcs.data(), int(srcs.size()), N, D, query.data(), c.rms_norm_eps);
    opt_.bf16(out, N * D);  // the GPU's fused AttnRes + norm reads h rounded to its output type
  };

  bool prefix_empty = false;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& L = w_.layers[size_t(l)];
    // Attention input: AttnRes over the completed blocks and the partial sum (skipped before the first block).
    if (blocks.empty()) h = prefix;
    else attnres(h.data(), prefix.data(), L.attn_res_query);
    if (l % c.attn_res_block_size == 0) {  // block boundary: snapshot the partial sum, start a new one
      blocks.push_back(prefix);
      prefix_empty = true;
    }
    rmsnorm_forward(xn.data(), h.data(), L.input_layernorm.data(), c.rms_norm_eps, N, D);
    opt_.bf16(xn);
    emit("attn_in", l, xn.data());
    tick(timings_.attnres_norm);
    if (L.kind == AttnKind::KDA) kda_attention_forward(a.data(), xn.data(), N, segs, l, L.kda, c, opt_);
    else mla_attention_forward(a.data(), xn.data(), N, segs, l, L.mla, c, opt_);
    tick(L.kind == AttnKind::KDA ? timings_.kda : timings_.mla);
    emit_output("attn_out", l, a.data());
    check_block_finite(c, st_, "attn_out", l, a.data(), N, D);
    if (prefix_empty) prefix = a;
    else
      for (int64_t i = 0; i < N * D; ++i) prefix[size_t(i)] += a[size_t(i)];
    prefix_empty = false;

    // FFN input: AttnRes again (blocks is never empty here).
    attnres(h.data(), prefix.data(), L.mlp_res_query);
    rmsnorm_forward(xn.data(), h.data(), L.post_attention_layernorm.data(), c.rms_norm_eps, N, D);
    opt_.bf16(xn);
    emit("ffn_in", l, xn.data());
    tick(timings_.attnres_norm);
    if (L.is_moe) moe_ffn_forward(a.data(), xn.data(), N, l, L.moe, c, hooks, opt_);
    else dense_ffn_forward(a.data(), xn.data(), N, L.dense, c, opt_);
    tick(L.is_moe ? timings_.moe : timings_.dense_ffn);
    emit_output("ffn_out", l, a.data());
    check_block_finite(c, st_, "ffn_out", l, a.data(), N, D);
    for (int64_t i = 0; i < N * D; ++i) prefix[size_t(i)] += a[size_t(i)];
  }

  // Output: AttnRes over all blocks, final norm, lm_head (no soft-cap, no scaling).
  std::vector<int64_t> rows;
  if (all_positions)
    for (int64_t r = 0; r < N; ++r) rows.push_back(r);
  else
    for (const Segment& s : segs) rows.push_back(s.row0 + s.n - 1);
  attnres(h.data(), prefix.data(), w_.output_res_query);
  const int64_t M = int64_t(rows.size());
  std::vector<float> hn(size_t(M * D));
  for (int64_t i = 0; i < M; ++i) std::copy_n(&h[size_t(rows[size_t(i)] * D)], D, &hn[size_t(i * D)]);
  rmsnorm_forward(hn.data(), hn.data(), w_.norm.data(), c.rms_norm_eps, M, D);
  opt_.bf16(hn);
  std::vector<float> logits(size_t(M * V));
  linear_forward(logits.data(), hn.data(), M, w_.lm_head);
  check_block_finite(c, st_, "logits", -1, logits.data(), M, V);
  for (const Segment& s : segs) s.cache->length += s.n;
  tick(timings_.head);
  return logits;
}

}  // namespace k3
