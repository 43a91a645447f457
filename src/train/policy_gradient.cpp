#include "train/policy_gradient.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/loss/cross_entropy.h"

namespace k3::train {

std::vector<double> token_logprobs(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
                                   const TrainHooks* hooks) {
  std::vector<double> logits;
  sequence_loss(P, c, ids, {}, false, 0.0, &logits, hooks);
  const int64_t T = int64_t(ids.size()), V = c.vocab_size;
  std::vector<double> logp(ids.size(), 0.0);
  for (int64_t t = 1; t < T; ++t) logp[size_t(t)] = log_softmax_at(&logits[size_t((t - 1) * V)], V, ids[size_t(t)]);
  return logp;
}

PolicyTokenTerm policy_token_term(double logp, double behaviour_logp, double reference_logp, double a,
                                  const PolicyLossOptions& o) {
  PolicyTokenTerm r;
  r.ratio = std::exp(logp - behaviour_logp);
  const double clipped_ratio = std::clamp(r.ratio, 1.0 - o.clip_eps, 1.0 + o.clip_eps);
  r.clipped = clipped_ratio * a < r.ratio * a;  // the min takes the clipped term, which is flat
  const double delta = o.kl_coef > 0 ? logp - reference_logp : 0.0;
  r.loss = -std::min(r.ratio * a, clipped_ratio * a) + 0.5 * o.kl_coef * delta * delta;
  r.weight = (r.clipped ? 0.0 : a * r.ratio) - o.kl_coef * delta;
  return r;
}

PolicyLoss policy_loss(ParamStore& P, const K3Config& c, const std::vector<PolicySample>& batch,
                       const PolicyLossOptions& o, bool backward) {
  if (!(o.clip_eps >= 0.0 && o.clip_eps < 1.0)) fail("policy loss: clip ε must be in [0, 1), got ", o.clip_eps);
  if (!(o.kl_coef >= 0.0)) fail("policy loss: the regulariser's β must be >= 0, got ", o.kl_coef);
  PolicyLoss r;
  for (size_t i = 0; i < batch.size(); ++i) {
    const PolicySample& s = batch[i];
    const size_t T = s.ids.size();
    auto check = [&](size_t n, const char* field) {
      if (n != T) fail("policy loss: sample ", i, ": ", field, " has ", n, " entries for ", T, " tokens");
    };
    check(s.sampled.size(), "sampled");
    check(s.behaviour_logp.size(), "behaviour_logp");
    check(s.advantage.size(), "advantage");
    if (o.kl_coef > 0) check(s.reference_logp.size(), "reference_logp (needed when β > 0)");
    const int64_t n = target_count(int64_t(T), {}, &s.sampled);
    if (n == 0) fail("policy loss: sample ", i, " has no sampled token after its first");
    r.tokens += n;
  }
  const double inv_n = 1.0 / double(std::max<int64_t>(r.tokens, 1));
  for (const PolicySample& s : batch) {
    const std::vector<double> logp = token_logprobs(P, c, s.ids);
    TokenWeights w(s.ids.size(), 0.0);
    for (size_t t = 1; t < s.ids.size(); ++t) {
      if (!s.sampled[t]) continue;
      const PolicyTokenTerm term =
          policy_token_term(logp[t], s.behaviour_logp[t], o.kl_coef > 0 ? s.reference_logp[t] : 0.0, s.advantage[t], o);
      r.loss += term.loss * inv_n;
      w[t] = term.weight * inv_n;
      r.clipped += term.clipped;
      r.mean_ratio += term.ratio * inv_n;
      r.max_abs_log_ratio = std::max(r.max_abs_log_ratio, std::abs(logp[t] - s.behaviour_logp[t]));
    }
    if (backward) sequence_loss(P, c, s.ids, {}, true, 1.0, nullptr, nullptr, &s.sampled, &w);
  }
  return r;
}

}  // namespace k3::train
