// The policy-gradient objective (train/policy_gradient.h) in float64 on k3-tiny-a:
//   - token_logprobs against the log-softmax of the logits;
//   - the loss against the formula evaluated here from those log-probabilities, with tokens in every case of the
//     clipped surrogate (ratio inside the range; above it with a positive and a negative advantage; below it with
//     both) and the regulariser on;
//   - its gradient against central finite differences of the loss, and the clipped count;
//   - bad samples named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/model_train.h"
#include "train/policy_gradient.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/finite_diff.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using ::testing::HasSubstr;

namespace {

struct Problem {
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  std::vector<PolicySample> batch;
  PolicyLossOptions o;
  int64_t want_clipped = 0;
};

// Two samples whose sampled tokens' log-ratios to the behaviour policy are set through behaviour_logp: each
// (log-ratio, advantage) case, at log-ratios far enough from log(1 ± ε) that finite differences stay on one side.
Problem make_problem() {
  Problem p;
  p.o.clip_eps = 0.2, p.o.kl_coef = 0.3;
  const std::vector<std::vector<int32_t>> ids = {{5, 900, 17, 260, 3, 3, 700, 41, 1000, 12},
                                                 {9, 8, 7, 400, 401, 402, 403, 55, 66, 77, 88, 99, 1, 2}};
  // (log r, A): inside, above with A > 0 (clipped), above with A < 0, below with A > 0, below with A < 0 (clipped).
  const std::vector<std::pair<double, double>> cases = {{0.05, 1.3}, {0.6, 0.8},   {0.6, -1.1},
                                                        {-0.7, 0.9}, {-0.7, -0.6}, {-0.02, -2.0}};
  size_t k = 0;
  for (const auto& row : ids) {
    PolicySample s;
    s.ids = row;
    const size_t T = row.size();
    s.sampled.assign(T, 0), s.behaviour_logp.assign(T, 0.0), s.advantage.assign(T, 0.0);
    s.reference_logp.assign(T, 0.0);
    const std::vector<double> logp = token_logprobs(p.P, p.c, row);
    for (size_t t = 4; t < T; ++t) {  // a 4-token prompt, then the policy's tokens
      const auto [log_r, a] = cases[k++ % cases.size()];
      s.sampled[t] = 1;
      s.behaviour_logp[t] = logp[t] - log_r;
      s.advantage[t] = a;
      s.reference_logp[t] = logp[t] + 0.1 * double(t % 3) - 0.1;
      p.want_clipped += (log_r > 0.5 && a > 0) || (log_r < -0.5 && a < 0);
    }
    p.batch.push_back(s);
  }
  return p;
}

}  // namespace

TEST(PolicyGradient, TokenLogprobsAreTheLogitsLogSoftmax) {
  Problem p = make_problem();
  const std::vector<int32_t>& ids = p.batch[0].ids;
  std::vector<double> logits;
  sequence_loss(p.P, p.c, ids, {}, false, 0.0, &logits);
  const std::vector<double> logp = token_logprobs(p.P, p.c, ids);
  const int64_t V = p.c.vocab_size;
  EXPECT_EQ(logp[0], 0.0);
  for (size_t t = 1; t < ids.size(); ++t) {
    double s = 0.0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(logits[(t - 1) * size_t(V) + size_t(v)]);
    EXPECT_NEAR(logp[t], logits[(t - 1) * size_t(V) + size_t(ids[t])] - std::log(s), 1e-12) << t;
  }
}

TEST(PolicyGradient, LossIsTheClippedSurrogateWithTheRegulariser) {
  Problem p = make_problem();
  const PolicyLoss l = policy_loss(p.P, p.c, p.batch, p.o, false);
  double want = 0, n = 0;
  for (const PolicySample& s : p.batch) {
    const std::vector<double> logp = token_logprobs(p.P, p.c, s.ids);
    for (size_t t = 1; t < s.ids.size(); ++t) {
      if (!s.sampled[t]) continue;
      const double r = std::exp(logp[t] - s.behaviour_logp[t]), a = s.advantage[t];
      const double rc = std::min(std::max(r, 1 - p.o.clip_eps), 1 + p.o.clip_eps);
      const double d = logp[t] - s.reference_logp[t];
      want += -std::min(r * a, rc * a) + 0.5 * p.o.kl_coef * d * d;
      n += 1;
    }
  }
  EXPECT_EQ(l.tokens, int64_t(n));
  EXPECT_NEAR(l.loss, want / n, 1e-12);
  EXPECT_EQ(l.clipped, p.want_clipped);
  EXPECT_NEAR(l.max_abs_log_ratio, 0.7, 1e-12);
}

TEST(PolicyGradient, GradientMatchesFiniteDifferences) {
  Problem p = make_problem();
  p.P.zero_grads();
  policy_loss(p.P, p.c, p.batch, p.o, true);
  std::vector<double> an, fd;
  auto loss = [&] { return policy_loss(p.P, p.c, p.batch, p.o, false).loss; };
  for (const std::string& n : trainable_names(p.P)) {
    const bool pick = n.find("lm_head") != std::string::npos || n.find("embed_tokens") != std::string::npos ||
                      n.find("layers.0.self_attn") != std::string::npos || n.find("layers.3.") != std::string::npos;
    if (!pick) continue;
    const int64_t k = p.P.numel(n);
    for (int64_t j : {k / 3, k - 1}) {
      an.push_back(p.P.g(n)[j]);
      fd.push_back(k3test::central_difference(&p.P.p_mut(n)[j], loss));
    }
  }
  ASSERT_GT(an.size(), 16u);
  const double e = k3test::rel_l2(an.data(), fd.data(), fd.size());
  std::printf("policy gradient against finite differences: relative L2 %.3g over %zu entries\n", e, an.size());
  EXPECT_LE(e, 1e-6);
  // Without the regulariser and with every token clipped, the objective is flat: no gradient.
  for (PolicySample& s : p.batch)
    for (size_t t = 0; t < s.ids.size(); ++t) s.advantage[t] = 1.0, s.behaviour_logp[t] -= 5.0;
  p.o.kl_coef = 0.0;
  p.P.zero_grads();
  const PolicyLoss flat = policy_loss(p.P, p.c, p.batch, p.o, true);
  EXPECT_EQ(flat.clipped, flat.tokens);
  for (double g : p.P.grads()) ASSERT_EQ(g, 0.0);
}

TEST(PolicyGradient, BadSamplesAreNamed) {
  Problem p = make_problem();
  p.batch[1].advantage.pop_back();
  EXPECT_THAT(k3test::error_of([&] { policy_loss(p.P, p.c, p.batch, p.o, false); }),
              HasSubstr("sample 1: advantage has 13 entries for 14 tokens"));
  p = make_problem();
  p.batch[0].reference_logp.clear();
  EXPECT_THAT(k3test::error_of([&] { policy_loss(p.P, p.c, p.batch, p.o, false); }),
              HasSubstr("sample 0: reference_logp (needed when β > 0)"));
  p = make_problem();
  std::fill(p.batch[0].sampled.begin(), p.batch[0].sampled.end(), 0);
  EXPECT_THAT(k3test::error_of([&] { policy_loss(p.P, p.c, p.batch, p.o, false); }),
              HasSubstr("sample 0 has no sampled token"));
  p = make_problem();
  p.o.clip_eps = 1.5;
  EXPECT_THAT(k3test::error_of([&] { policy_loss(p.P, p.c, p.batch, p.o, false); }), HasSubstr("clip"));
}
