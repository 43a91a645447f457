// An Engine (model/engine.h) whose model is a script, for serving tests that need exact outputs or
// slow steps whatever the weights: the logits after a sequence's i-th forward favour script[i] (by 10
// over every other id), and <|end_of_msg|>'s id (the config's eos) once the script is spent. Each
// forward can sleep a fixed time, to make a step slow. The config (vocabulary size, eos, context)
// comes from a real model's, so a tokenizer for that model reads the ids.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "model/config.h"
#include "model/decoder.h"
#include "model/engine.h"

namespace k3test {

class ScriptedEngine : public k3::Engine {
 public:
  ScriptedEngine(const k3::K3Config& cfg, std::vector<int32_t> script, std::chrono::milliseconds step = {})
      : cfg_(cfg), script_(std::move(script)), step_(step) {}

  const k3::K3Config& config() const override { return cfg_; }
  k3::EngineOptions options() const override { return {}; }
  size_t weight_bytes() const override { return 0; }
  size_t sequence_bytes(int64_t tokens) const override { return size_t(tokens) * kBytesPerToken; }
  static constexpr size_t kBytesPerToken = 1024;  // what the scripted state "takes", for cache budgets
  std::vector<std::unique_ptr<k3::EngineSequence>> new_sequences(int64_t B) override {
    std::vector<std::unique_ptr<k3::EngineSequence>> out;
    for (int64_t b = 0; b < B; ++b) out.push_back(std::make_unique<Seq>());
    return out;
  }
  // The last position's logits of each sequence (every position's when all_positions: the same row).
  std::vector<float> forward(const std::vector<k3::EngineSequence*>& seqs,
                             const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                             const k3::ForwardHooks* = nullptr) override {
    std::vector<float> out;
    for (size_t i = 0; i < seqs.size(); ++i) {
      Seq& s = static_cast<Seq&>(*seqs[i]);
      s.tokens += int64_t(tokens[i].size());
      const size_t step = size_t(s.forwards++);
      if (step_.count() > 0) std::this_thread::sleep_for(step_);
      std::vector<float> row(size_t(cfg_.vocab_size), 0.0f);
      row[size_t(step < script_.size() ? script_[step] : int32_t(cfg_.eos_token_id))] = 10.0f;
      for (size_t r = 0; r < (all_positions ? tokens[i].size() : 1); ++r) out.insert(out.end(), row.begin(), row.end());
    }
    return out;
  }
  // A snapshot holds the scripted sequence's counters (its "state"), so a restored sequence goes on with the
  // script where the snapshotted one was.
  struct Snap : k3::SequenceSnapshot {
    int64_t tokens = 0, forwards = 0;
    size_t bytes() const override { return size_t(end - begin) * kBytesPerToken; }
  };
  std::unique_ptr<k3::SequenceSnapshot> snapshot(k3::EngineSequence& seq, int64_t rows_from) override {
    const Seq& s = static_cast<const Seq&>(seq);
    auto out = std::make_unique<Snap>();
    out->begin = rows_from;
    out->end = s.tokens;
    out->tokens = s.tokens;
    out->forwards = s.forwards;
    return out;
  }
  void restore(k3::EngineSequence& seq, const std::vector<const k3::SequenceSnapshot*>& chain) override {
    Seq& s = static_cast<Seq&>(seq);
    const Snap& last = static_cast<const Snap&>(*chain.back());
    s.tokens = last.tokens;
    s.forwards = last.forwards;
  }
  void reset(k3::EngineSequence& seq) override {
    Seq& s = static_cast<Seq&>(seq);
    s.tokens = 0;
    s.forwards = 0;
  }
  void set_profile(bool) override {}
  const k3::BlockTimings& timings() const override { return timings_; }
  void reset_timings() override {}

 private:
  struct Seq : k3::EngineSequence {
    int64_t tokens = 0, forwards = 0;
    int64_t length() const override { return tokens; }
    size_t bytes() const override { return 0; }
  };
  k3::K3Config cfg_;
  std::vector<int32_t> script_;
  std::chrono::milliseconds step_;
  k3::BlockTimings timings_;
};

}  // namespace k3test
