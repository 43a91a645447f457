// The Kimi K3 text model: a checkpoint directory bound to its config, and the forward pass
// (K3-ARCHITECTURE.md §5.1-5.2) over a batch of sequences that each continue from their cache.
//
// forward() is the one entry point for full recomputation, prefill and decoding: every sequence's
// new tokens are appended after what its SequenceCache already holds. A fresh cache plus all
// tokens is a full forward; one token per call after a prefill is incremental decoding.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/cache.h"
#include "model/config.h"
#include "model/layers.h"
#include "model/weights.h"

namespace k3 {

class Model {
 public:
  // dir: a Hugging Face model directory (config.json + model.safetensors or shards).
  static std::unique_ptr<Model> load(const std::string& dir);
  // For tests and tools that keep config and weights apart.
  static std::unique_ptr<Model> load(const std::string& config_path, const std::string& weights_path);

  const K3Config& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  SequenceCache new_cache() const { return SequenceCache::fresh(cfg_); }
  PathOptions& options() { return opt_; }
  const PathOptions& options() const { return opt_; }
  size_t weight_bytes() const { return weight_bytes_; }  // the checkpoint's tensor bytes (mapped, read on use)

  // Seconds spent per block kind since the last reset (only while options().profile is set).
  using Timings = BlockTimings;
  const Timings& timings() const { return timings_; }
  void reset_timings() { timings_ = Timings{}; }

  // Appends tokens[b] to *caches[b] for every b and returns fp32 logits:
  //   all_positions: one row per new token, sequences in order  -> [Σ n_b, V]
  //   otherwise:     the row of each sequence's last new token  -> [B, V]
  // Token ids are checked against the vocabulary (k3::Error on a bad id).
  std::vector<float> forward(const std::vector<SequenceCache*>& caches, const std::vector<std::vector<int32_t>>& tokens,
                             bool all_positions, const ForwardHooks* hooks = nullptr);

 private:
  K3Config cfg_;
  SafeTensors st_;
  ModelWeights w_;
  PathOptions opt_ = PathOptions::from_env();
  Timings timings_;
  size_t weight_bytes_ = 0;
};

}  // namespace k3
