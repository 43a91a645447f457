// Rollouts for on-policy RL (issue 21: `k3 rl`): K completions of each prompt sampled from an inference engine
// (model/engine.h, CPU or GPU), each sampled token with the log-probability the sampling policy gave it, and the
// pieces that turn scored rollouts into policy-gradient samples (train/policy_gradient.h): group-normalised
// advantages and the sample itself.
//
// The sampling policy is the model at `temperature` with no top-k or top-p cut, so that the recorded
// log-probability log softmax(logits / T)[id] is the policy's own; at T = 1 it is log π(id), what the trainer
// recomputes (token_logprobs) and compares with.
#pragma once
#include <cstdint>
#include <vector>

#include "model/engine.h"
#include "train/policy_gradient.h"

namespace k3::train {

struct RolloutOptions {
  int64_t samples_per_prompt = 4;  // K
  int64_t max_new_tokens = 64;
  float temperature = 1.0f;
  uint64_t seed = 0;  // rollout (prompt p, sample k) draws from its own stream, a function of (seed, p, k)
};

struct Rollout {
  int64_t prompt = 0;        // index into the prompts
  std::vector<int32_t> ids;  // the prompt, then the sampled tokens
  int64_t prompt_len = 0;
  std::vector<double> logp;  // [ids.size()]: log-probability of each sampled token under the sampler, 0 elsewhere
  bool finished = false;     // stopped on the config's eos id (not on max_new_tokens)
  int64_t generated() const { return int64_t(ids.size()) - prompt_len; }
};

// Every prompt's K rollouts, prompt by prompt, sample by sample. Errors name a prompt that is empty or a bad option.
std::vector<Rollout> sample_rollouts(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                     const RolloutOptions& options);

// Group normalisation: rewards in groups of `group` consecutive entries (one prompt's K rollouts); each group's
// mean and scale 1 / (standard deviation + eps), or scale 0 when its rewards are all equal (nothing to prefer).
struct GroupNorm {
  double mean = 0.0, scale = 0.0;
};
std::vector<GroupNorm> group_norms(const std::vector<double>& rewards, int64_t group, double eps = 1e-6);

// Group-normalised advantages: each reward's (r − mean) · scale of its group (group_norms).
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group, double eps = 1e-6);

// A rollout as a policy-gradient sample: its sampled tokens trained, the sampler's log-probabilities as the
// behaviour and the reference policy's, one advantage on every sampled token.
PolicySample policy_sample(const Rollout& r, double advantage);

}  // namespace k3::train
