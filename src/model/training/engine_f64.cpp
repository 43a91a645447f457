#include "model/training/engine_f64.h"

#include "core/error.h"
#include "kernels/loss/cross_entropy.h"
#include "model/training/ffn_block.h"
#include "model/training/model_train.h"

namespace k3 {
namespace {

size_t state_bytes(const train::DecodeState& s) {
  size_t n = 0;
  for (const train::KdaDecodeState& k : s.kda) n += k.q_tail.size() + k.k_tail.size() + k.v_tail.size() + k.S.size();
  for (const train::MlaDecodeState& m : s.mla) n += m.kv.size() + m.k_rot.size();
  return n * sizeof(double);
}

class Float64Sequence : public EngineSequence {
 public:
  Float64Sequence(const void* owner, train::DecodeState s) : owner(owner), state(std::move(s)) {}
  int64_t length() const override { return state.length; }
  size_t bytes() const override { return state_bytes(state); }
  const void* owner;
  train::DecodeState state;
};

struct Float64Snapshot : SequenceSnapshot {
  const void* owner = nullptr;  // the engine whose sequence it copies
  train::DecodeState state;     // the KDA state after position end - 1; the MLA rows of positions [begin, end)
  size_t bytes() const override { return state_bytes(state); }
};

class Float64Engine : public Engine {
 public:
  Float64Engine(std::shared_ptr<const train::ParamStore> P, const K3Config& c) : P_(std::move(P)), c_(c) {
    K3_CHECK(P_ != nullptr, "float64 engine: no parameters");
  }
  const K3Config& config() const override { return c_; }
  EngineOptions options() const override { return {Device::CPU, Precision::F64}; }
  size_t weight_bytes() const override { return P_->values().size() * sizeof(double); }
  size_t sequence_bytes(int64_t tokens) const override {
    size_t n = 0;
    const int64_t HD = c_.kda_num_heads * c_.kda_head_dim;
    for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
      n +=
          c_.layer_kind[size_t(l)] == AttnKind::KDA
              ? size_t(3 * (c_.short_conv_kernel_size - 1) * HD + c_.kda_num_heads * c_.kda_head_dim * c_.kda_head_dim)
              : size_t(tokens * (c_.num_attention_heads * (c_.qk_nope_head_dim + c_.v_head_dim) + c_.qk_rope_head_dim));
    return n * sizeof(double);
  }
  std::vector<std::unique_ptr<EngineSequence>> new_sequences(int64_t B) override {
    K3_CHECK(B >= 1, "new_sequences: need at least one sequence, got ", B);
    std::vector<std::unique_ptr<EngineSequence>> out;
    for (int64_t b = 0; b < B; ++b) out.push_back(std::make_unique<Float64Sequence>(this, fresh()));
    return out;
  }
  std::vector<float> forward(const std::vector<EngineSequence*>& seqs, const std::vector<std::vector<int32_t>>& tokens,
                             bool all_positions, const ForwardHooks* hooks) override {
    const std::vector<double> logits = forward64(seqs, tokens, all_positions, hooks);
    return std::vector<float>(logits.begin(), logits.end());
  }
  // Engine::forward_pick's rule on the fp32 rounding of the logits, and a sampled id's log-probability from the
  // float64 logits themselves.
  std::vector<PickResult> forward_pick(const std::vector<EngineSequence*>& seqs,
                                       const std::vector<std::vector<int32_t>>& tokens,
                                       const std::vector<TokenPick>& picks, const ForwardHooks* hooks) override {
    K3_CHECK(picks.size() == seqs.size(), "forward_pick: ", picks.size(), " picks for ", seqs.size(), " sequences");
    const std::vector<double> logits = forward64(seqs, tokens, false, hooks);
    const int64_t V = c_.vocab_size;
    std::vector<PickResult> out(seqs.size());
    for (size_t b = 0; b < seqs.size(); ++b) {
      if (!picks[b].pick && !picks[b].want_logits) continue;
      const double* row = &logits[b * size_t(V)];
      out[b] = pick_on_host(std::vector<float>(row, row + V), picks[b]);
      if (picks[b].pick && !picks[b].greedy && picks[b].want_logprob)
        out[b].logprob = log_softmax_at(row, V, out[b].id, picks[b].temperature);
    }
    return out;
  }
  std::vector<double> sequence_logprobs(const std::vector<int32_t>& ids) override {
    K3_CHECK(!ids.empty(), "sequence_logprobs: no tokens");
    const auto seq = new_sequences(1);
    const std::vector<double> logits = forward64({seq[0].get()}, {ids}, true, nullptr);
    const size_t V = size_t(c_.vocab_size);
    std::vector<double> out(ids.size(), 0.0);
    for (size_t t = 1; t < ids.size(); ++t) out[t] = log_softmax_at(&logits[(t - 1) * V], int64_t(V), ids[t]);
    return out;
  }
  std::unique_ptr<SequenceSnapshot> snapshot(EngineSequence& seq, int64_t rows_from) override {
    const train::DecodeState& s = sequence(seq, "snapshot").state;
    K3_CHECK(rows_from >= 0 && rows_from <= s.length, "snapshot: rows_from ", rows_from, " outside [0, ", s.length,
             "]");
    auto out = std::make_unique<Float64Snapshot>();
    out->owner = this;
    out->begin = rows_from;
    out->end = s.length;
    out->state = s;
    for (train::MlaDecodeState& m : out->state.mla) {
      if (m.length == 0) continue;
      const size_t kv_row = m.kv.size() / size_t(m.length), rot_row = m.k_rot.size() / size_t(m.length);
      m.kv.erase(m.kv.begin(), m.kv.begin() + std::ptrdiff_t(size_t(rows_from) * kv_row));
      m.k_rot.erase(m.k_rot.begin(), m.k_rot.begin() + std::ptrdiff_t(size_t(rows_from) * rot_row));
      m.length -= rows_from;
    }
    return out;
  }
  void restore(EngineSequence& seq, const std::vector<const SequenceSnapshot*>& chain) override {
    train::DecodeState& s = sequence(seq, "restore").state;
    check_restore_chain(chain, s.length);
    for (size_t i = 0; i < chain.size(); ++i) {
      const auto* f = dynamic_cast<const Float64Snapshot*>(chain[i]);
      K3_CHECK(f != nullptr && f->owner == this, "restore: snapshot ", i, " is another engine's");
    }
    s = static_cast<const Float64Snapshot&>(*chain.back()).state;  // the KDA state after the last position
    for (size_t l = 0; l < s.mla.size(); ++l) {
      train::MlaDecodeState& m = s.mla[l];
      m = {};
      for (const SequenceSnapshot* c : chain) {
        const train::MlaDecodeState& part = static_cast<const Float64Snapshot&>(*c).state.mla[l];
        m.kv.insert(m.kv.end(), part.kv.begin(), part.kv.end());
        m.k_rot.insert(m.k_rot.end(), part.k_rot.begin(), part.k_rot.end());
        m.length += part.length;
      }
    }
  }
  void reset(EngineSequence& seq) override { sequence(seq, "reset").state = fresh(); }
  void set_profile(bool) override {}  // no per-block timings: nothing here is tuned
  const BlockTimings& timings() const override { return timings_; }
  void reset_timings() override {}

 private:
  // A fresh sequence's state: every layer's entry there and empty (snapshots and restore index them by layer).
  train::DecodeState fresh() const {
    train::DecodeState s;
    s.kda.resize(size_t(c_.num_hidden_layers)), s.mla.resize(size_t(c_.num_hidden_layers));
    return s;
  }
  // `what`: the caller and the sequence, for the error ("forward: sequence 2").
  Float64Sequence& sequence(EngineSequence& seq, const std::string& what) {
    auto* s = dynamic_cast<Float64Sequence*>(&seq);
    K3_CHECK(s != nullptr && s->owner == this, what, " was made by another engine");
    return *s;
  }

  // Each sequence's forward in turn; the logits of its new tokens (all_positions) or of its last one, in order.
  // hooks: input rows, and topk, called once per MoE layer with the rows of every sequence in order, as the
  // other engines do. Per-block tensors are not offered.
  std::vector<double> forward64(const std::vector<EngineSequence*>& seqs,
                                const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                                const ForwardHooks* hooks) {
    K3_CHECK(seqs.size() == tokens.size(), "forward: ", seqs.size(), " sequences for ", tokens.size(), " token lists");
    K3_CHECK(!hooks || (!hooks->tensor && !hooks->replace),
             "forward: the float64 engine offers no per-block tensor hooks");
    const int64_t V = c_.vocab_size, D = c_.hidden_size, K = c_.num_experts_per_token;
    // Everything is checked before any sequence moves on (the input rows by the other engines' check).
    std::vector<Float64Sequence*> s;
    std::vector<int64_t> row0(seqs.size(), 0), n;
    for (size_t b = 0; b < seqs.size(); ++b) {
      K3_CHECK(seqs[b] != nullptr, "forward: sequence ", b, " is null");
      s.push_back(&sequence(*seqs[b], "forward: sequence " + std::to_string(b)));
      check_new_tokens(c_, b, tokens[b], s.back()->state.length);
      n.push_back(int64_t(tokens[b].size()));
    }
    if (hooks) input_rows_of(*hooks, row0, n, D);
    std::vector<std::vector<int32_t>> topk(size_t(c_.num_hidden_layers));  // [Σ n_b, K] per MoE layer
    train::TrainHooks th;
    if (hooks && hooks->topk)
      th.on_moe = [&](int64_t l, const train::MoeTape& tape) {
        topk[size_t(l)].insert(topk[size_t(l)].end(), tape.topk.begin(), tape.topk.end());
      };
    std::vector<double> out;
    for (size_t b = 0; b < seqs.size(); ++b) {
      std::vector<std::vector<double>> row_data;
      std::vector<train::TrainInputRows> rows;
      if (hooks && b < hooks->input_rows.size())
        for (const InputRows& r : hooks->input_rows[b]) {
          row_data.emplace_back(r.data, r.data + r.n * D);
          rows.push_back({r.at, r.n, row_data.back().data(), nullptr});
        }
      std::vector<double> logits;
      train::sequence_decode(*P_, c_, tokens[b], rows, s[b]->state, logits, &th);
      out.insert(out.end(), all_positions ? logits.begin() : logits.end() - std::ptrdiff_t(V), logits.end());
    }
    if (hooks && hooks->topk)
      for (int64_t l = 0; l < c_.num_hidden_layers; ++l)
        if (c_.is_moe_layer(l)) hooks->topk(l, topk[size_t(l)].data(), int64_t(topk[size_t(l)].size()) / K, K);
    return out;
  }

  std::shared_ptr<const train::ParamStore> P_;
  const K3Config c_;
  BlockTimings timings_;
};

}  // namespace

std::unique_ptr<Engine> float64_engine(std::shared_ptr<const train::ParamStore> P, const K3Config& c) {
  return std::make_unique<Float64Engine>(std::move(P), c);
}

}  // namespace k3
