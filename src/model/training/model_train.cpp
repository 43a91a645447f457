#include "model/training/model_train.h"

#include <algorithm>
#include <memory>

#include "core/error.h"
#include "kernels/attnres/attnres.h"
#include "kernels/gemm/linear_f64.h"
#include "kernels/loss/cross_entropy.h"
#include "kernels/norm/norm.h"
#include "model/decoder.h"
#include "model/tensor_table.h"
#include "model/training/ffn_block.h"
#include "model/training/kda_block.h"
#include "model/training/mla_block.h"

namespace k3::train {

std::function<const int32_t*(int64_t layer)> replay_hook(const RouterReplay& r, const K3Config& c, int64_t T) {
  if (int64_t(r.size()) != c.num_hidden_layers)
    fail("router replay: ", r.size(), " layers recorded for a model of ", c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const size_t want = c.is_moe_layer(l) ? size_t(T * c.num_experts_per_token) : 0;
    if (r[size_t(l)].size() != want)
      fail("router replay: layer ", l, " holds ", r[size_t(l)].size(), " experts, expected ", want, " (", T,
           " positions)");
  }
  return [&r](int64_t l) { return r[size_t(l)].data(); };
}

std::vector<std::string> trainable_names(const ParamStore& P) {
  std::vector<std::string> out;
  for (const std::string& n : P.names()) {
    const auto id = parse_tensor_name(n);
    if (!id || tensor_info(id->kind).trainable) out.push_back(n);
  }
  return out;
}

namespace {

// One AttnRes + RMSNorm use: which nodes it mixed, with which query tensors, and what it computed.
struct ResUse {
  std::vector<int> srcs;  // node ids; empty = skipped (h is the node `direct`)
  int direct = -1;
  std::string norm_name, proj_name;
  std::vector<double> h, xn;  // AttnRes output and its RMSNorm
  std::string ln_name;        // the pre-norm weight
};

struct LayerTape {
  ResUse attn_in, ffn_in;
  std::unique_ptr<KdaBlockTape> kda_tape;
  std::unique_ptr<MlaBlockTape> mla_tape;
  std::unique_ptr<GluTape> dense_tape;
  std::unique_ptr<MoeTape> moe_tape;
};

std::vector<double> query_of(const ParamStore& P, const std::string& norm, const std::string& proj, int64_t D) {
  const double *a = P.p(norm, D), *b = P.p(proj, D);
  std::vector<double> q(static_cast<size_t>(D));
  for (int64_t i = 0; i < D; ++i) q[size_t(i)] = a[i] * b[i];
  return q;
}

// lm_head, or the embedding when the config ties them and the store has no lm_head.
std::string lm_head_name(const ParamStore& P, const K3Config& c, const TensorNames& tn) {
  const std::string head = tn(TensorKind::LmHead);
  if (P.has(head)) return head;
  if (!c.tie_word_embeddings) fail("training parameters: ", head, " is missing and the config does not tie embeddings");
  return tn(TensorKind::TokenEmbd);
}

// The float64 training backend of the decoder schedule (model/decoder.h) over one sequence. Its
// handles are node ids: every version of the running block sum is a node with its own gradient
// buffer (AttnRes mixes snapshots of that sum, so the backward needs each value a use saw). kOut
// names the last block output, which is not a node until it is added to the partial sum.
class TrainBackend {
 public:
  using Act = int;
  static constexpr Act kOut = -1;

  // head() computes dlogits for head_backward when `backward`; `logits_out` (optional) gets [T, V].
  TrainBackend(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
               const std::vector<TrainInputRows>& rows, const TokenMask* trained, const TokenWeights* weights,
               const TrainHooks* hooks, bool backward, double grad_scale, std::vector<double>* logits_out,
               DecodeState* decode = nullptr)
      : P_(P),
        c_(c),
        ids_(ids),
        rows_(rows),
        from_rows_(ids.size(), false),
        trained_(trained),
        weights_(weights),
        hooks_(hooks),
        tn_{param_naming(P)},
        lm_head_(lm_head_name(P, c, tn_)),
        T_(int64_t(ids.size())),
        D_(c.hidden_size),
        tape_(size_t(c.num_hidden_layers)),
        out_(size_t(T_ * D_)),
        backward_(backward),
        grad_scale_(grad_scale),
        logits_out_(logits_out),
        decode_(decode) {
    for (const TrainInputRows& r : rows_) std::fill_n(from_rows_.begin() + r.at, r.n, true);
    if (decode_) {
      K3_CHECK(!backward_, "training: a decoding forward has no backward");
      decode_->kda.resize(size_t(c.num_hidden_layers)), decode_->mla.resize(size_t(c.num_hidden_layers));
    }
  }

  bool profiling() const { return false; }
  void synchronize() {}

  Act embed() {
    const int64_t V = c_.vocab_size;
    const double* E = P_.p(tn_(TensorKind::TokenEmbd), V * D_);
    node_.emplace_back(static_cast<size_t>(T_ * D_));
    for (int64_t t = 0; t < T_; ++t) {
      if (ids_[size_t(t)] < 0 || ids_[size_t(t)] >= V)
        fail("training: token id ", ids_[size_t(t)], " outside [0, ", V, ")");
      std::copy_n(E + int64_t(ids_[size_t(t)]) * D_, D_, &node_[0][size_t(t * D_)]);
    }
    for (const TrainInputRows& r : rows_) std::copy_n(r.data, r.n * D_, &node_[0][size_t(r.at * D_)]);
    return 0;
  }

  void mix(MixSite site, int64_t l, const std::vector<Act>& blocks, Act partial) {
    ResUse& u = use(site, l);
    const MixTensors k = mix_tensors(site);
    const int64_t at = site == MixSite::Output ? -1 : l;
    u.norm_name = tn_(k.res_norm, at), u.proj_name = tn_(k.res_proj, at), u.ln_name = tn_(k.norm, at);
    u.h.resize(size_t(T_ * D_));
    if (blocks.empty()) {
      u.direct = partial;
      u.h = node_[size_t(partial)];
    } else {
      u.srcs = blocks;
      u.srcs.push_back(partial);
      std::vector<const double*> src;
      for (int s : u.srcs) src.push_back(node_[size_t(s)].data());
      const std::vector<double> q = query_of(P_, u.norm_name, u.proj_name, D_);
      attnres_forward(u.h.data(), src, q.data(), c_.rms_norm_eps, T_, D_);
    }
    u.xn.resize(size_t(T_ * D_));
    rmsnorm_forward(u.xn.data(), u.h.data(), P_.p(u.ln_name, D_), c_.rms_norm_eps, T_, D_);
  }

  Act attention(int64_t l) {
    LayerTape& L = tape_[size_t(l)];
    const std::string p = layer_prefix(l);
    if (decode_ && c_.layer_kind[size_t(l)] == AttnKind::KDA) {
      kda_block_forward(P_, p, c_, l, L.attn_in.xn.data(), T_, out_.data(), nullptr, &decode_->kda[size_t(l)]);
    } else if (decode_) {
      mla_block_forward(P_, p, c_, l, L.attn_in.xn.data(), T_, out_.data(), nullptr, &decode_->mla[size_t(l)]);
    } else if (c_.layer_kind[size_t(l)] == AttnKind::KDA) {
      L.kda_tape = std::make_unique<KdaBlockTape>();
      kda_block_forward(P_, p, c_, l, L.attn_in.xn.data(), T_, out_.data(), L.kda_tape.get());
    } else {
      L.mla_tape = std::make_unique<MlaBlockTape>();
      mla_block_forward(P_, p, c_, l, L.attn_in.xn.data(), T_, out_.data(), L.mla_tape.get());
    }
    return kOut;
  }

  Act ffn(int64_t l) {
    LayerTape& L = tape_[size_t(l)];
    const std::string p = layer_prefix(l);
    if (c_.is_moe_layer(l)) {
      L.moe_tape = std::make_unique<MoeTape>();
      const std::string bias_name = tn_(TensorKind::MoeRouterBias, l);
      const double* bias = hooks_ && hooks_->router_bias ? hooks_->router_bias(l)
                           : P_.has(bias_name)           ? P_.p(bias_name)
                                                         : nullptr;
      const int32_t* forced = hooks_ && hooks_->router_replay ? hooks_->router_replay(l) : nullptr;
      moe_ffn_forward(P_, p, c_, l, L.ffn_in.xn.data(), T_, out_.data(), L.moe_tape.get(), bias, forced);
      if (hooks_ && hooks_->on_moe) hooks_->on_moe(l, *L.moe_tape);
    } else {
      L.dense_tape = std::make_unique<GluTape>();
      dense_ffn_forward(P_, p, c_, l, L.ffn_in.xn.data(), T_, out_.data(), L.dense_tape.get());
    }
    return kOut;
  }

  void block_output(const char* name, int64_t l, Act) {
    if (hooks_ && hooks_->tensor) hooks_->tensor(name, l, out_.data(), T_, D_);
  }
  Act start_partial(Act) {
    node_.push_back(out_);
    return int(node_.size()) - 1;
  }
  void add_partial(Act& partial, Act) {
    node_.push_back(out_);
    std::vector<double>& sum = node_.back();
    const std::vector<double>& prev = node_[size_t(partial)];
    for (int64_t i = 0; i < T_ * D_; ++i) sum[size_t(i)] += prev[size_t(i)];
    partial = int(node_.size()) - 1;
  }

  // The head: lm_head on every position and the next-token cross-entropy over T-1 of them.
  double head() {
    const int64_t V = c_.vocab_size;
    std::vector<double> logits(size_t(T_ * V));
    linear_forward(logits.data(), final_.xn.data(), P_.p(lm_head_, V * D_), T_, D_, V);
    if (decode_) {  // logits only: the targets are not known yet
      *logits_out_ = std::move(logits);
      return 0.0;
    }
    std::vector<int32_t> target(static_cast<size_t>(T_), -1);
    for (int64_t t = 0; t + 1 < T_; ++t)
      if (!from_rows_[size_t(t + 1)] && (!trained_ || (*trained_)[size_t(t + 1)]))
        target[size_t(t)] = ids_[size_t(t + 1)];
    dlogits_.assign(backward_ ? size_t(T_ * V) : 0, 0.0);
    std::vector<double> row_weight;  // row t predicts token t + 1
    if (weights_) row_weight.assign(weights_->begin() + 1, weights_->end()), row_weight.push_back(0.0);
    const double loss = cross_entropy(logits.data(), target.data(), T_, V, backward_ ? dlogits_.data() : nullptr,
                                      grad_scale_, weights_ ? row_weight.data() : nullptr);
    if (logits_out_) *logits_out_ = std::move(logits);
    return loss;
  }

  // ---- backward ----
  void head_backward() {
    dnode_.assign(node_.size(), std::vector<double>(size_t(T_ * D_), 0.0));
    dh_.resize(size_t(T_ * D_)), dxn_.resize(size_t(T_ * D_)), dq_.resize(size_t(D_));
    const int64_t V = c_.vocab_size;
    linear_backward(dxn_.data(), P_.g(lm_head_, V * D_), dlogits_.data(), final_.xn.data(), P_.p(lm_head_, V * D_), T_,
                    D_, V);
  }

  // Back through RMSNorm and AttnRes (or the skipped AttnRes) into the node gradients.
  void mix_backward(MixSite site, int64_t l) {
    const ResUse& u = use(site, l);
    rmsnorm_backward(dh_.data(), P_.g(u.ln_name, D_), dxn_.data(), u.h.data(), P_.p(u.ln_name, D_), c_.rms_norm_eps, T_,
                     D_);
    if (u.srcs.empty()) {
      for (int64_t i = 0; i < T_ * D_; ++i) dnode_[size_t(u.direct)][size_t(i)] += dh_[size_t(i)];
      return;
    }
    std::vector<const double*> src;
    std::vector<double*> dsrc;
    for (int s : u.srcs) {
      src.push_back(node_[size_t(s)].data());
      dsrc.push_back(dnode_[size_t(s)].data());
    }
    const std::vector<double> q = query_of(P_, u.norm_name, u.proj_name, D_);
    std::fill(dq_.begin(), dq_.end(), 0.0);
    attnres_backward(dsrc, dq_.data(), dh_.data(), src, q.data(), c_.rms_norm_eps, T_, D_);
    // q = norm ⊙ proj
    const double *a = P_.p(u.norm_name, D_), *b = P_.p(u.proj_name, D_);
    double *da = P_.g(u.norm_name, D_), *db = P_.g(u.proj_name, D_);
    for (int64_t i = 0; i < D_; ++i) {
      da[i] += dq_[size_t(i)] * b[i];
      db[i] += dq_[size_t(i)] * a[i];
    }
  }

  void attention_backward(int64_t l, Act d_out) {
    const LayerTape& L = tape_[size_t(l)];
    const double* dy = dnode_[size_t(d_out)].data();
    if (L.kda_tape) kda_block_backward(P_, layer_prefix(l), c_, l, *L.kda_tape, dy, dxn_.data());
    else mla_block_backward(P_, layer_prefix(l), c_, l, *L.mla_tape, dy, dxn_.data());
  }
  void ffn_backward(int64_t l, Act d_out) {
    const LayerTape& L = tape_[size_t(l)];
    const double* dy = dnode_[size_t(d_out)].data();
    if (L.moe_tape) moe_ffn_backward(P_, layer_prefix(l), c_, l, *L.moe_tape, dy, dxn_.data());
    else dense_ffn_backward(P_, layer_prefix(l), c_, l, *L.dense_tape, dy, dxn_.data());
  }
  void add_gradient(Act dst, Act src) {
    std::vector<double>& d = dnode_[size_t(dst)];
    const std::vector<double>& s = dnode_[size_t(src)];
    for (int64_t i = 0; i < T_ * D_; ++i) d[size_t(i)] += s[size_t(i)];
  }
  void embed_backward(Act embedding) {
    double* dE = P_.g(tn_(TensorKind::TokenEmbd), c_.vocab_size * D_);
    const std::vector<double>& d = dnode_[size_t(embedding)];
    for (int64_t t = 0; t < T_; ++t) {
      if (from_rows_[size_t(t)]) continue;
      for (int64_t j = 0; j < D_; ++j) dE[int64_t(ids_[size_t(t)]) * D_ + j] += d[size_t(t * D_ + j)];
    }
    for (const TrainInputRows& r : rows_)
      if (r.grad) std::copy_n(&d[size_t(r.at * D_)], r.n * D_, r.grad);
  }

 private:
  std::string layer_prefix(int64_t l) const { return k3::layer_prefix(tn_.naming, l); }
  ResUse& use(MixSite site, int64_t l) {
    if (site == MixSite::Output) return final_;
    return site == MixSite::AttnIn ? tape_[size_t(l)].attn_in : tape_[size_t(l)].ffn_in;
  }

  ParamStore& P_;
  const K3Config& c_;
  const std::vector<int32_t>& ids_;
  const std::vector<TrainInputRows>& rows_;
  std::vector<bool> from_rows_;  // [T]: the position's input is an input row
  const TokenMask* trained_;     // [T] or null: which tokens are targets
  const TokenWeights* weights_;  // [T] or null: each target's weight
  const TrainHooks* hooks_;
  const TensorNames tn_;
  const std::string lm_head_;
  const int64_t T_, D_;
  std::vector<LayerTape> tape_;
  ResUse final_;
  std::vector<std::vector<double>> node_, dnode_;  // versions of the block sum and their gradients
  std::vector<double> out_;                        // the last block output
  std::vector<double> dlogits_, dh_, dxn_, dq_;
  const bool backward_;
  const double grad_scale_;
  std::vector<double>* const logits_out_;
  DecodeState* const decode_;  // decoding: the sequence the tokens continue
};

}  // namespace

double sequence_loss(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids, bool backward,
                     double grad_scale, std::vector<double>* logits_out, const TrainHooks* hooks) {
  return sequence_loss(P, c, ids, {}, backward, grad_scale, logits_out, hooks);
}

double sequence_loss(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
                     const std::vector<TrainInputRows>& rows, bool backward, double grad_scale,
                     std::vector<double>* logits_out, const TrainHooks* hooks, const TokenMask* trained,
                     const TokenWeights* weights) {
  if (ids.empty()) fail("training: empty sequence");
  const int64_t T = int64_t(ids.size());
  if (trained && int64_t(trained->size()) != T)
    fail("training: the trained-token mask has ", trained->size(), " entries for a sequence of ", T, " tokens");
  if (weights && int64_t(weights->size()) != T)
    fail("training: the token weights have ", weights->size(), " entries for a sequence of ", T, " tokens");
  std::vector<bool> taken(ids.size(), false);
  for (const TrainInputRows& r : rows) {
    K3_CHECK(r.at >= 0 && r.n >= 0 && r.at + r.n <= T && (r.data || r.n == 0), "training: input rows [", r.at, ", ",
             r.at + r.n, ") of a sequence of ", T, " tokens");
    for (int64_t i = r.at; i < r.at + r.n; ++i) {
      K3_CHECK(!taken[size_t(i)], "training: input rows overlap at position ", i);
      taken[size_t(i)] = true;
    }
  }
  TrainBackend be(P, c, ids, rows, trained, weights, hooks, backward, grad_scale, logits_out);
  DecoderTape<TrainBackend::Act> tape;
  const double loss = decoder_forward(be, c, nullptr, &tape);
  if (backward) decoder_backward(be, c, tape);
  return loss;
}

void sequence_decode(const ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
                     const std::vector<TrainInputRows>& rows, DecodeState& state, std::vector<double>& logits,
                     const TrainHooks* hooks) {
  if (ids.empty()) fail("decoding: no new tokens");
  for (const TrainInputRows& r : rows)
    K3_CHECK(r.at >= 0 && r.n >= 0 && r.at + r.n <= int64_t(ids.size()) && (r.data || r.n == 0),
             "decoding: input rows [", r.at, ", ", r.at + r.n, ") of ", ids.size(), " new tokens");
  // A forward without a backward reads the parameters only; TrainBackend takes them mutable for its gradients.
  TrainBackend be(const_cast<ParamStore&>(P), c, ids, rows, nullptr, nullptr, hooks, false, 0.0, &logits, &state);
  decoder_forward(be, c, nullptr);
  state.length += int64_t(ids.size());
}

int64_t target_count(int64_t T, const std::vector<TrainInputRows>& rows, const TokenMask* trained) {
  std::vector<bool> target(size_t(std::max<int64_t>(T, 0)), true);  // token t is a target
  if (T > 0) target[0] = false;
  for (const TrainInputRows& r : rows)
    for (int64_t t = std::max<int64_t>(r.at, 0); t < std::min(r.at + r.n, T); ++t) target[size_t(t)] = false;
  if (trained)
    for (int64_t t = 0; t < std::min<int64_t>(T, int64_t(trained->size())); ++t)
      if (!(*trained)[size_t(t)]) target[size_t(t)] = false;
  return int64_t(std::count(target.begin(), target.end(), true));
}

namespace {

template <class PerToken>
void check_per_token_t(const std::vector<std::vector<int32_t>>& pieces, const std::vector<PerToken>* per_token,
                       const char* what) {
  if (!per_token) return;
  if (per_token->size() != pieces.size())
    fail("training: ", per_token->size(), " ", what, " for ", pieces.size(), " sequences");
  for (size_t i = 0; i < pieces.size(); ++i)
    if ((*per_token)[i].size() != pieces[i].size())
      fail("training: sequence ", i, " has ", pieces[i].size(), " tokens but ", (*per_token)[i].size(),
           " entries in its ", what);
}

}  // namespace

void check_per_token(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenMask>* trained) {
  check_per_token_t(pieces, trained, "trained-token masks");
}
void check_per_token(const std::vector<std::vector<int32_t>>& pieces, const std::vector<TokenWeights>* weights) {
  check_per_token_t(pieces, weights, "token weights");
}

}  // namespace k3::train
