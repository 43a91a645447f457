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

int32_t Sampler::sample(const float* logits, int64_t V) {
  // -inf masks a token (it is never drawn); NaN and +inf have no probability to give.
  for (int64_t b = first_nonfinite(logits, V); b >= 0 && b < V; ++b)
    if (std::isnan(logits[b]) || logits[b] == std::numeric_limits<float>::infinity())
      fail("sampler: logit ", b, " is ", nonfinite_name(logits[b]));
  if (p_.greedy) return argmax(logits, V);
  // Candidates by logit, highest first; equal logits by id, so the order (and the draw) is
  // deterministic. Temperature does not change the order, so it is applied after the sort.
  cand_.resize(size_t(V));
  for (int64_t v = 0; v < V; ++v) cand_[size_t(v)] = {logits[v], int32_t(v)};
  auto higher = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = size_t(V);
  if (p_.top_k > 0 && p_.top_k < V) {
    keep = size_t(p_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + keep, cand_.end(), higher);
  } else {
    std::sort(cand_.begin(), cand_.end(), higher);
  }
  // p_i ∝ exp((l_i - l_max) / T): the difference first, then the division, in double. Dividing first
  // overflows for a tiny T (1e-40: l/T = inf, and exp(inf - inf) = NaN picked the worst token);
  // this way every exponent is <= 0, the best token's is exactly 0, and a tiny T tends to greedy.
  const double mx = cand_[0].first, inv_t = 1.0 / double(p_.temperature);
  if (std::isinf(mx)) fail("sampler: every logit is -Inf");
  std::vector<double> prob(keep);
  double z = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    const double e = (double(cand_[i].first) - mx) * inv_t;
    z += (prob[i] = std::exp(e));
  }
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
