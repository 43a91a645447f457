// Group-normalised advantages for on-policy RL (`k3 rl`, train/rl_loop.h): the returns of one task's K episodes
// are compared with each other, so that what the policy learns is which of its own attempts did better.
#pragma once
#include <cstdint>
#include <vector>

namespace k3::train {

// Group normalisation: rewards in groups of `group` consecutive entries (one task's K episodes); each group's
// mean and scale 1 / (standard deviation + eps), or scale 0 when its rewards are all equal (nothing to prefer).
struct GroupNorm {
  double mean = 0.0, scale = 0.0;
};
std::vector<GroupNorm> group_norms(const std::vector<double>& rewards, int64_t group, double eps = 1e-6);

// Group-normalised advantages: each reward's (r − mean) · scale of its group (group_norms).
std::vector<double> group_advantages(const std::vector<double>& rewards, int64_t group, double eps = 1e-6);

}  // namespace k3::train
