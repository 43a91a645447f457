// Router replay on the GPU trainer (`k3 rl --device cuda`): the log-probabilities and the policy-gradient step of
// sequences routed as given, against the CPU float64 trainer with the same routing (train/train_device.h).
// Skips without a Hopper GPU.
//
// The routing replayed is not the model's own: every expert is shifted by one (a valid set of distinct experts that
// the router did not choose), so a trainer that ignored the replay would be far off. Bar: the f32 trainer against
// the float64 one on this random tiny model, 1e-5 on log-probabilities (they agree to ~1e-6 without replay) and
// 1e-5 relative on the gradient norm.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "model/init_random.h"
#include "train/optimizer.h"
#include "train/train_device.h"
#include "util/compare.h"
#include "util/cuda_test.h"
#include "util/error_of.h"
#include "util/temp_dir.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using ::testing::HasSubstr;

namespace {

struct Devices {
  k3test::TempDir dir{"cuda-rl"};
  K3Config c;
  ParamStore P_cpu, P_gpu;
  std::unique_ptr<Optimizer> opt_cpu, opt_gpu;
  std::unique_ptr<TrainDevice> cpu, gpu;
  explicit Devices(int64_t micro_batch_tokens) {
    const std::string model = dir.file("model");
    RandomInitOptions init;
    init.seed = 5;
    write_random_model(fixture("k3-tiny-a/config.json"), model, init);
    c = load_config(model + "/config.json");
    P_cpu = ParamStore::from_model_dir(model);
    P_gpu = ParamStore::from_model_dir(model);
    opt_cpu = std::make_unique<Optimizer>(P_cpu, OptimizerConfig{}, k3_head_splits(P_cpu, c));
    opt_gpu = std::make_unique<Optimizer>(P_gpu, OptimizerConfig{}, k3_head_splits(P_gpu, c));
    cpu = make_cpu_train_device(P_cpu, c, *opt_cpu, BalanceOptions{}, 1);
    CudaTrainOptions o;
    o.precision = GpuPrecision::F32, o.micro_batch_tokens = micro_batch_tokens;
    gpu = make_cuda_train_device(P_gpu, c, *opt_gpu, BalanceOptions{}, o);
  }
};

std::vector<std::vector<int32_t>> random_pieces(int64_t vocab, const std::vector<int>& lengths) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> id(0, int32_t(vocab - 1));
  std::vector<std::vector<int32_t>> out;
  for (const int T : lengths) {
    std::vector<int32_t> p(static_cast<size_t>(T), 0);
    for (int32_t& v : p) v = id(rng);
    out.push_back(std::move(p));
  }
  return out;
}

double largest_difference(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    EXPECT_EQ(a[i].size(), b[i].size());
    for (size_t t = 0; t < a[i].size() && t < b[i].size(); ++t) d = std::max(d, std::abs(a[i][t] - b[i][t]));
  }
  return d;
}

void replayed_step_matches_the_cpu(int64_t micro_batch_tokens) {
  Devices d(micro_batch_tokens);
  const auto pieces = random_pieces(d.c.vocab_size, {41, 57, 23, 35});
  std::vector<RouterReplay> own;
  const auto lp_own = d.cpu->token_logprobs(pieces, nullptr, &own);
  std::vector<RouterReplay> shifted = own;
  for (RouterReplay& r : shifted)
    for (std::vector<int32_t>& layer : r)
      for (int32_t& e : layer) e = int32_t((e + 1) % d.c.num_experts);

  const auto lp_cpu = d.cpu->token_logprobs(pieces, &shifted, nullptr);
  const auto lp_gpu = d.gpu->token_logprobs(pieces, &shifted, nullptr);
  const auto lp_gpu_own = d.gpu->token_logprobs(pieces, nullptr, nullptr);
  const double replayed = largest_difference(lp_cpu, lp_gpu), unreplayed = largest_difference(lp_own, lp_gpu_own),
               effect = largest_difference(lp_own, lp_cpu);
  std::printf(
      "micro-batches of %lld tokens: GPU f32 against CPU float64, max |Δ log p| %.3g replayed, %.3g own "
      "routing; the replayed routing moves log p by up to %.3g\n",
      (long long)micro_batch_tokens, replayed, unreplayed, effect);
  EXPECT_GT(effect, 1e-3);  // the replay changes the model's output
  EXPECT_LE(replayed, 1e-5);

  // One policy-gradient step's gradient (weights of both signs) with the replayed routing.
  std::vector<TokenMask> masks;
  std::vector<TokenWeights> weights;
  for (const auto& p : pieces) {
    masks.emplace_back(p.size(), true);
    masks.back()[0] = false;
    TokenWeights w(p.size(), 0.0);
    for (size_t t = 1; t < p.size(); ++t) w[t] = (t % 3 == 0 ? -0.5 : 0.25) / double(p.size());
    weights.push_back(std::move(w));
  }
  d.cpu->weighted_gradients(pieces, masks, weights, &shifted);
  d.gpu->weighted_gradients(pieces, masks, weights, &shifted);
  std::string bad;
  const double g_cpu = d.cpu->clip(0.0, &bad), g_gpu = d.gpu->clip(0.0, &bad);
  d.cpu->weighted_gradients(pieces, masks, weights, nullptr);
  const double g_own = d.cpu->clip(0.0, &bad);
  std::printf("gradient norm: CPU %.9g, GPU %.9g (own routing: %.9g)\n", g_cpu, g_gpu, g_own);
  EXPECT_NEAR(g_gpu, g_cpu, 1e-5 * g_cpu);
  EXPECT_GT(std::abs(g_own - g_cpu), 1e-3 * g_cpu);

  // A routing of the wrong shape or with an expert out of range is named, not run.
  std::vector<RouterReplay> bad_replay = shifted;
  bad_replay[1][size_t(d.c.first_k_dense_replace)].pop_back();
  EXPECT_THAT(k3test::error_of([&] { d.gpu->token_logprobs(pieces, &bad_replay, nullptr); }),
              HasSubstr("router replay: layer"));
  bad_replay = shifted;
  bad_replay[2][size_t(d.c.first_k_dense_replace)][0] = int32_t(d.c.num_experts);
  EXPECT_THAT(k3test::error_of([&] { d.gpu->token_logprobs(pieces, &bad_replay, nullptr); }),
              HasSubstr("is not in 0.."));
}

}  // namespace

TEST(CudaRouterReplay, OneBatchFollowsTheCpuTrainer) {
  K3_REQUIRE_GPU();
  replayed_step_matches_the_cpu(0);
}

// Micro-batches: each pass takes its own pieces' routing.
TEST(CudaRouterReplay, MicroBatchesFollowTheCpuTrainer) {
  K3_REQUIRE_GPU();
  replayed_step_matches_the_cpu(64);
}
