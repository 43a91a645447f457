// Rollouts for RL (train/rollout.h) on the CPU engine (fp32) over a k3-tiny-a model as `k3 init` makes it:
//   - the sampler's log-probability of every sampled token against the float64 trainer's recomputation
//     (token_logprobs): the trainer-sampler agreement the RL step's ratios rest on;
//   - rollouts are a function of (seed, prompt, sample): repeatable, and distinct across samples;
//   - group-normalised advantages against their definition; a rollout as a policy-gradient sample;
//   - bad options named.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "core/error.h"
#include "model/config.h"
#include "model/engine.h"
#include "model/init_random.h"
#include "model/params.h"
#include "train/policy_gradient.h"
#include "train/rollout.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/temp_dir.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using ::testing::HasSubstr;

namespace {

struct Policy {
  k3test::TempDir dir{"rollout"};
  std::unique_ptr<Engine> engine;
  ParamStore P;
  K3Config c;
  Policy() {
    RandomInitOptions opt;
    opt.seed = 1;
    write_random_model(fixture("k3-tiny-a/config.json"), dir.file("m"), opt);
    engine = Engine::load(dir.file("m"), EngineOptions{});
    P = ParamStore::from_model_dir(dir.file("m"));
    c = load_config(dir.file("m/config.json"));
  }
};

const std::vector<std::vector<int32_t>> kPrompts = {{5, 900, 17, 260}, {9, 8, 7}, {400, 401, 402, 403, 55, 66}};

}  // namespace

TEST(Rollout, SamplerLogprobsAreTheTrainers) {
  Policy p;
  RolloutOptions o;
  o.samples_per_prompt = 2, o.max_new_tokens = 16, o.seed = 3;
  const std::vector<Rollout> rs = sample_rollouts(*p.engine, kPrompts, o);
  ASSERT_EQ(rs.size(), 6u);
  double worst = 0;
  int64_t tokens = 0;
  for (const Rollout& r : rs) {
    ASSERT_EQ(r.logp.size(), r.ids.size());
    EXPECT_EQ(std::vector<int32_t>(r.ids.begin(), r.ids.begin() + r.prompt_len), kPrompts[size_t(r.prompt)]);
    EXPECT_GE(r.generated(), 1);
    const std::vector<double> want = token_logprobs(p.P, p.c, r.ids);
    for (size_t t = size_t(r.prompt_len); t < r.ids.size(); ++t) {
      worst = std::max(worst, std::abs(r.logp[t] - want[t]));
      ++tokens;
    }
  }
  std::printf("sampler against trainer: largest |log-prob difference| %.3g over %lld sampled tokens\n", worst,
              (long long)tokens);
  EXPECT_LE(worst, 1e-6);  // the bar for the f32 CPU engine against the trainer
}

TEST(Rollout, RolloutsAreAFunctionOfSeedPromptAndSample) {
  Policy p;
  RolloutOptions o;
  o.samples_per_prompt = 3, o.max_new_tokens = 10, o.seed = 7;
  const std::vector<Rollout> a = sample_rollouts(*p.engine, kPrompts, o), b = sample_rollouts(*p.engine, kPrompts, o);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].ids, b[i].ids);
    EXPECT_EQ(a[i].logp, b[i].logp);
  }
  // The same prompt alone draws the same rollouts as among the others.
  const std::vector<Rollout> alone = sample_rollouts(*p.engine, {kPrompts[0]}, o);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(alone[k].ids, a[k].ids);
  EXPECT_TRUE(a[0].ids != a[1].ids || a[1].ids != a[2].ids) << "three samples of one prompt all alike";
  o.seed = 8;
  EXPECT_NE(sample_rollouts(*p.engine, {kPrompts[0]}, o)[0].ids, a[0].ids);
}

TEST(Rollout, GroupAdvantagesAndPolicySamples) {
  const std::vector<double> a = group_advantages({1, 0, 0, 1, 2, 2, 2, 2, 0, 3, 0, 0}, 4);
  const double r3 = std::sqrt(3.0);  // {0, 3, 0, 0}: mean 3/4, standard deviation 3√3/4
  const std::vector<double> want = {1, -1, -1, 1, 0, 0, 0, 0, -1 / r3, r3, -1 / r3, -1 / r3};
  ASSERT_EQ(a.size(), want.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], want[i], 1e-5) << i;
  EXPECT_THAT(k3test::error_of([] { group_advantages({1, 2, 3}, 2); }), HasSubstr("not groups of 2"));

  Rollout r;
  r.ids = {1, 2, 3, 4, 5}, r.prompt_len = 2, r.logp = {0, 0, -1.5, -0.2, -3.0};
  const PolicySample s = policy_sample(r, 0.75);
  EXPECT_EQ(s.ids, r.ids);
  EXPECT_EQ(s.sampled, (TokenMask{0, 0, 1, 1, 1}));
  EXPECT_EQ(s.advantage, (std::vector<double>{0, 0, 0.75, 0.75, 0.75}));
  EXPECT_EQ(s.behaviour_logp, r.logp);
}

TEST(Rollout, BadOptionsAreNamed) {
  Policy p;
  RolloutOptions o;
  o.samples_per_prompt = 0;
  EXPECT_THAT(k3test::error_of([&] { sample_rollouts(*p.engine, kPrompts, o); }), HasSubstr("samples per prompt"));
  o = RolloutOptions{};
  o.temperature = 0.0f;
  EXPECT_THAT(k3test::error_of([&] { sample_rollouts(*p.engine, kPrompts, o); }), HasSubstr("temperature"));
  o = RolloutOptions{};
  EXPECT_THAT(k3test::error_of([&] { sample_rollouts(*p.engine, {{1, 2}, {}}, o); }), HasSubstr("prompt 1 is empty"));
}
