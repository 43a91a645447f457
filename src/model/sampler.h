// Next-token selection from fp32 logits: greedy, or temperature / top-k / top-p sampling with a
// seeded generator (same seed, same logits -> same tokens on every machine: the uniform draw is
// built from mt19937_64's 64-bit output, not from a library distribution).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace k3 {

struct SamplingParams {
  bool greedy = true;
  float temperature = 1.0f;  // > 0
  int64_t top_k = 0;         // 0: no top-k cut
  float top_p = 1.0f;        // (0, 1]; 1: no nucleus cut
  uint64_t seed = 0;
  void check() const;  // k3::Error naming the bad field
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  int32_t sample(const float* logits, int64_t V);
  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;
  std::vector<double> prob_;
};

// argmax with ties broken toward the lower id.
int32_t argmax(const float* logits, int64_t V);

}  // namespace k3
