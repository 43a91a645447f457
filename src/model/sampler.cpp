#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/finite.h"
#include "core/validate.h"

namespace k3 {

void SamplingParams::check() const {
  if (greedy) return;
  require_number("--temperature", temperature, 0, std::numeric_limits<double>::infinity(), /*lo_open=*/true);
  require_integer("--top-k", top_k, 0, std::numeric_limits<int64_t>::max());
  require_number("--top-p", top_p, 0, 1, /*lo_open=*/true);
}

int32_t argmax(const float* logits, int64_t V) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (logits[v] > logits[best]) best = v;
  return int32_t(best);
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) { p_.check(); }

bool Sampler::temperature_only() const { return p_.greedy || (!(p_.top_k > 0) && !(p_.top_p < 1.0f)); }

double Sampler::next_uniform() { return double(rng_() >> 11) * 0x1.0p-53; }

int32_t sample_temperature(const float* logits, int64_t V, float temperature, double u, std::vector<double>& prob) {
  // p_v ∝ exp((l_v - l_max) / T): the difference first, then the division, in double (see Sampler::sample).
  const double mx = logits[argmax(logits, V)], inv_t = 1.0 / double(temperature);
  if (std::isinf(mx)) fail("sampler: every logit is -Inf");
  prob.resize(size_t(V));
  double z = 0.0;
  for (int64_t v = 0; v < V; ++v) z += (prob[size_t(v)] = std::exp((double(logits[v]) - mx) * inv_t));
  const double target = u * z;
  double cum = 0.0;
  int64_t last = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (prob[size_t(v)] == 0.0) continue;
    cum += prob[size_t(v)];
    last = v;
    if (target < cum) return int32_t(v);
  }
  return int32_t(last);
}

void check_sampleable(const float* logits, int64_t V) {
  for (int64_t b = first_nonfinite(logits, V); b >= 0 && b < V; ++b)
    if (std::isnan(logits[b]) || logits[b] == std::numeric_limits<float>::infinity())
      fail("sampler: logit ", b, " is ", nonfinite_name(logits[b]));
}

int32_t Sampler::sample(const float* logits, int64_t V) {
  check_sampleable(logits, V);  // (-inf masks a token: it is never drawn)
  if (p_.greedy) return argmax(logits, V);
  // Temperature alone: the draw walks the ids in order, no sort (a full sort of a 163,840-id vocabulary
  // costs ~12 ms a token, more than a small model's step).
  if (temperature_only()) return sample_temperature(logits, V, p_.temperature, next_uniform(), prob_);

  // p_i ∝ exp((l_i - l_max) / T): the difference first, then the division, in double. Dividing first
  // overflows for a tiny T (1e-40: l/T = inf, and exp(inf - inf) = NaN picked the worst token);
  // this way every exponent is <= 0, the best token's is exactly 0, and a tiny T tends to greedy.
  const double mx = logits[argmax(logits, V)], inv_t = 1.0 / double(p_.temperature);
  if (std::isinf(mx)) fail("sampler: every logit is -Inf");
  const auto weight = [&](float l) { return std::exp((double(l) - mx) * inv_t); };
  const auto draw = [&](double z) { return next_uniform() * z; };  // uniform in [0, z)

  // top_k / top_p: candidates by logit, highest first; equal logits by id, so the order (and the draw) is
  // deterministic. Only the prefix the draw can reach is sorted: the top k, or (top_p alone) a prefix grown
  // until its mass reaches top_p of the whole (nucleus sampling rarely needs more than a few hundred ids).
  cand_.resize(size_t(V));
  for (int64_t v = 0; v < V; ++v) cand_[size_t(v)] = {logits[v], int32_t(v)};
  auto higher = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = size_t(V);
  double total = 0.0;  // the whole vocabulary's mass, when top_p alone bounds the prefix
  if (p_.top_k > 0 && p_.top_k < V) {
    keep = size_t(p_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + std::ptrdiff_t(keep), cand_.end(), higher);
  } else {
    for (int64_t v = 0; v < V; ++v) total += weight(logits[v]);
    for (size_t m = std::min<size_t>(size_t(V), 1024);; m = std::min<size_t>(size_t(V), m * 8)) {
      std::partial_sort(cand_.begin(), cand_.begin() + std::ptrdiff_t(m), cand_.end(), higher);
      double mass = 0.0;
      for (size_t i = 0; i < m; ++i) mass += weight(cand_[i].first);
      if (m == size_t(V) || mass / total >= double(p_.top_p)) {
        keep = m;
        break;
      }
    }
  }
  prob_.resize(keep);
  double z = 0.0;
  for (size_t i = 0; i < keep; ++i) z += (prob_[i] = weight(cand_[i].first));
  if (p_.top_p < 1.0f) {  // smallest prefix whose probability mass reaches top_p
    const double whole = total > 0.0 ? total : z;
    double cum = 0.0;
    size_t n = 0;
    while (n < keep) {
      cum += prob_[n++] / whole;
      if (cum >= double(p_.top_p)) break;
    }
    keep = n;
    z = 0.0;
    for (size_t i = 0; i < keep; ++i) z += prob_[i];
  }
  const double u = draw(z);
  double cum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cum += prob_[i];
    if (u < cum) return cand_[i].second;
  }
  return cand_[keep - 1].second;
}

}  // namespace k3
