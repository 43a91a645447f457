#include "train/rollout.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/splitmix.h"
#include "kernels/loss/cross_entropy.h"
#include "model/generate.h"
#include "model/sampler.h"

namespace k3::train {

std::vector<Rollout> sample_rollouts(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
                                     const RolloutOptions& o) {
  if (o.samples_per_prompt < 1) fail("rollouts: samples per prompt must be at least 1, got ", o.samples_per_prompt);
  if (o.max_new_tokens < 1) fail("rollouts: max new tokens must be at least 1, got ", o.max_new_tokens);
  if (!(o.temperature > 0.0f)) fail("rollouts: the temperature must be > 0, got ", o.temperature);
  const K3Config& c = engine.config();
  std::vector<Rollout> out;
  for (size_t p = 0; p < prompts.size(); ++p) {
    if (prompts[p].empty()) fail("rollouts: prompt ", p, " is empty");
    for (int64_t k = 0; k < o.samples_per_prompt; ++k) {
      SamplingParams sp;
      sp.greedy = false, sp.temperature = o.temperature;
      sp.seed = splitmix64(o.seed ^ splitmix64(uint64_t(p) * 0x100000001b3ULL + uint64_t(k)));
      Sampler sampler(sp);
      Rollout r;
      r.prompt = int64_t(p), r.ids = prompts[p], r.prompt_len = int64_t(prompts[p].size());
      std::vector<double> logp;
      // The sampler's distribution at this step: log softmax(logits / T) at the id it drew.
      const StepObserver observe = [&](const float* logits, int64_t V, int32_t id) {
        logp.push_back(log_softmax_at(logits, V, id, o.temperature));
      };
      const GenerateResult g = generate_until(
          engine.session(), c, prompts[p], o.max_new_tokens, sampler, [](int32_t) { return true; }, observe);
      K3_CHECK(logp.size() == g.tokens.size(), "rollouts: ", logp.size(), " observed steps for ", g.tokens.size(),
               " tokens");
      r.ids.insert(r.ids.end(), g.tokens.begin(), g.tokens.end());
      r.logp.assign(r.ids.size(), 0.0);
      std::copy(logp.begin(), logp.end(), r.logp.begin() + r.prompt_len);
      r.finished = g.stopped_on_eos;
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::vector<GroupNorm> group_norms(const std::vector<double>& rewards, int64_t group, double eps) {
  if (group < 1 || rewards.size() % size_t(group) != 0)
    fail("advantages: ", rewards.size(), " rewards are not groups of ", group);
  std::vector<GroupNorm> out;
  for (size_t g = 0; g < rewards.size(); g += size_t(group)) {
    double mean = 0.0, var = 0.0;
    for (int64_t i = 0; i < group; ++i) mean += rewards[g + size_t(i)];
    mean /= double(group);
    for (int64_t i = 0; i < group; ++i) var += (rewards[g + size_t(i)] - mean) * (rewards[g + size_t(i)] - mean);
    const double sd = std::sqrt(var / double(group));
    out.push_back({mean, sd == 0.0 ? 0.0 : 1.0 / (sd + eps)});  // every rollout scored alike: nothing to prefer
  }
  return out;
}

std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group, double eps) {
  const std::vector<GroupNorm> norm = group_norms(rewards, group, eps);
  std::vector<double> a(rewards.size(), 0.0);
  for (size_t i = 0; i < rewards.size(); ++i) {
    const GroupNorm& n = norm[i / size_t(group)];
    a[i] = (rewards[i] - n.mean) * n.scale;
  }
  return a;
}

PolicySample policy_sample(const Rollout& r, double advantage) {
  PolicySample s;
  s.ids = r.ids;
  const size_t T = r.ids.size();
  s.sampled.assign(T, 0);
  s.advantage.assign(T, 0.0);
  for (size_t t = size_t(r.prompt_len); t < T; ++t) s.sampled[t] = 1, s.advantage[t] = advantage;
  s.behaviour_logp = r.logp;
  s.reference_logp = r.logp;
  return s;
}

}  // namespace k3::train
