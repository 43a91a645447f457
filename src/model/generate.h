// Autoregressive generation for one sequence: prefill the prompt into a fresh cache, then feed
// one token per step (the KDA state and MLA latent cache carry the prefix; nothing is recomputed).
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/sampler.h"

namespace k3 {

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated ids (the eos id included when it stopped the run)
  bool stopped_on_eos = false;
  double prefill_seconds = 0.0, decode_seconds = 0.0;
};

// append(tokens) appends tokens to the one sequence being generated and returns the logits [V] of its
// last token (Engine::session gives one; model/engine.h has generate() on an Engine). on_token
// (optional) is called with each new id as soon as it is chosen.
using AppendFn = std::function<std::vector<float>(const std::vector<int32_t>& tokens)>;
GenerateResult generate(const AppendFn& append, const K3Config& cfg, const std::vector<int32_t>& prompt,
                        int64_t max_new_tokens, Sampler& sampler, const std::function<void(int32_t)>& on_token = {});

}  // namespace k3
