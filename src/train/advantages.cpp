#include "train/advantages.h"

#include <cmath>

#include "core/error.h"

namespace k3::train {

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

}  // namespace k3::train
