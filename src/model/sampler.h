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
  // Whether sample() is greedy or temperature alone: what sample_temperature (and an engine's own sampling,
  // Engine::forward_pick) does with the draw next_uniform() gives.
  bool temperature_only() const;
  // The draw sample() would take next, in [0, 1): a non-greedy sample() consumes exactly one.
  double next_uniform();

 private:
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;
  std::vector<double> prob_;
};

// argmax with ties broken toward the lower id.
int32_t argmax(const float* logits, int64_t V);

// The check of logits before any pick: NaN and +inf have no probability to give (-inf masks a token).
// Throws k3::Error naming the first such logit.
void check_sampleable(const float* logits, int64_t V);

// Sampling at temperature T alone with the draw u in [0, 1): p_v ∝ exp((l_v - max) / T) in double, and the
// first id (in id order) whose running sum of p passes u Σ p; past the end (rounding), the last id of nonzero p.
// Sampler::sample's temperature branch; `prob` is scratch. The logits must be finite or -inf, one of them finite.
int32_t sample_temperature(const float* logits, int64_t V, float temperature, double u, std::vector<double>& prob);

}  // namespace k3
