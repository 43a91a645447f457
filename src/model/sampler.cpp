#include "model/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace k3 {

void SamplingParams::check() const {
  if (greedy) return;
  if (!(temperature > 0.0f) || !std::isfinite(temperature)) fail("--temperature must be > 0, got ", temperature);
  if (top_k < 0) fail("--top-k must be >= 0, got ", top_k);
  if (!(top_p > 0.0f && top_p <= 1.0f)) fail("--top-p must be in (0, 1], got ", top_p);
}

int32_t argmax(const float* logits, int64_t V) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (logits[v] > logits[best]) best = v;
  return int32_t(best);
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) { p_.check(); }

int32_t Sampler::sample(const float* logits, int64_t V) {
  for (int64_t v = 0; v < V; ++v)
    if (std::isnan(logits[v])) fail("sampler: logit ", v, " is NaN");
  if (p_.greedy) return argmax(logits, V);
  cand_.resize(size_t(V));
  for (int64_t v = 0; v < V; ++v) cand_[size_t(v)] = {logits[v] / p_.temperature, int32_t(v)};
  // Highest logit first; equal logits by id, so the order (and the draw) is deterministic.
  auto higher = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = size_t(V);
  if (p_.top_k > 0 && p_.top_k < V) {
    keep = size_t(p_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + keep, cand_.end(), higher);
  } else {
    std::sort(cand_.begin(), cand_.end(), higher);
  }
  const double mx = cand_[0].first;
  std::vector<double> prob(keep);
  double z = 0.0;
  for (size_t i = 0; i < keep; ++i) z += (prob[i] = std::exp(double(cand_[i].first) - mx));
  if (p_.top_p < 1.0f) {  // smallest prefix whose probability mass reaches top_p
    double cum = 0.0;
    size_t n = 0;
    while (n < keep) {
      cum += prob[n++] / z;
      if (cum >= double(p_.top_p)) break;
    }
    keep = n;
    z = 0.0;
    for (size_t i = 0; i < keep; ++i) z += prob[i];
  }
  const double u = double(rng_() >> 11) * 0x1.0p-53 * z;  // uniform in [0, z)
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += prob[i];
    if (u < cum) return cand_[i].second;
  }
  return cand_[keep - 1].second;
}

}  // namespace k3
