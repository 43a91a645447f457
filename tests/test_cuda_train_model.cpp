// The GPU trainer's model (model/cuda/training/cuda_train_model.h) against the float64 truths: the
// exact reference gradients of the k3-tiny-a fixture, and the CPU float64 trainer on packed batches.
// Every test skips without a Hopper GPU.
//
// Bars, and why:
//   F32 loss            1e-5 absolute from the exact reference (the fixture's loss bar).
//   F32 gradients       relative L2 from the exact reference <= 8 × what float32 rounding moves that tensor
//                       by (+1e-5). This random model amplifies a relative perturbation up to ~2e5-fold
//                       (docs/NUMERICS.md), so "what rounding allows" is measured per tensor, as the larger
//                       of (a) the float32 golden's distance from the exact gradients (Moonshot's code run
//                       in float32: one draw of its rounding) and (b) how far the exact float64 gradient
//                       moves when every weight gets a random relative perturbation of 2^-24 (float32's
//                       rounding of the weights alone; two draws). An fp32 computation rounds every
//                       activation as well, at every op, so its distance is several such draws
//                       (docs/NUMERICS.md, "GPU training in fp32", has the per-tensor figures).
//   BF16                one bf16 rounding of every GEMM operand (2^-9 relative) through 9 layers, on a
//                       model initialised as training initialises it (the fixture's random weights amplify
//                       a 2^-9 perturbation into noise): loss within 1e-2 relative, the whole gradient
//                       within 5e-2 relative L2.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/cuda/training/cuda_train_model.h"
#include "model/params.h"
#include "model/training/model_train.h"
#include "util/cuda_test.h"
#include "util/fixture.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using k3test::rel_l2;

namespace {

const K3Config& cfg() {
  static K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  return c;
}

// k3-tiny-a with 8 KDA heads: its 4-head A_log leaves later experts off the grouped expert GEMMs'
// 16-byte grid (those layers keep one cuBLAS call per expert); with 8 every tensor is a multiple of 8
// values, so every MoE layer runs the grouped GEMMs in the bf16 mode.
const K3Config& cfg_grouped() {
  static K3Config c = [] {
    K3Config k = cfg();
    k.kda_num_heads = 8;
    return k;
  }();
  return c;
}

const SafeTensors& exact_reference() {
  static SafeTensors g = SafeTensors::open(fixture("k3-tiny-a/grads-exact-reference.safetensors"));
  return g;
}

// The fixture's batch as the trainer sees it: the mean loss over its predictions, gradient scaled to match.
struct Batch {
  std::vector<std::vector<int32_t>> rows;
  int64_t count = 0;
};
Batch ids_b() {
  Batch b;
  b.rows = k3test::golden_rows("ids_b");
  for (const auto& r : b.rows) b.count += int64_t(r.size()) - 1;
  return b;
}

// Runs the batch on the GPU (one packed step) and brings the gradients to P's host buffer.
double gpu_loss_and_grads(ParamStore& P, const K3Config& c, const std::vector<std::vector<int32_t>>& rows,
                          int64_t count, GpuPrecision precision) {
  auto m = CudaTrainModel::create(c, P, precision);
  m->zero_grads();
  const double loss = m->loss(rows, true, 1.0 / double(count));
  m->download_grads(P);
  return loss / double(count);
}

// Rows of ids drawn at random from the vocabulary, of these lengths.
std::vector<std::vector<int32_t>> random_rows(const std::vector<int64_t>& lengths, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> rows;
  for (int64_t len : lengths) {
    std::vector<int32_t> r(static_cast<size_t>(len));
    for (auto& id : r) id = int32_t(rng() % uint32_t(cfg().vocab_size));
    rows.push_back(r);
  }
  return rows;
}

// The tensors farthest from the float64 gradients (relative L2, and their share of the whole error).
void print_worst(const ParamStore& gpu, const ParamStore& cpu) {
  std::vector<std::pair<double, std::string>> rows;
  double total = 0;
  for (const std::string& n : trainable_names(cpu)) {
    const size_t k = size_t(cpu.numel(n));
    double d2 = 0;
    for (size_t i = 0; i < k; ++i) d2 += std::pow(gpu.g(n)[i] - cpu.g(n)[i], 2);
    total += d2;
    rows.push_back({rel_l2(gpu.g(n), cpu.g(n), k), n + " (|d|^2 " + std::to_string(d2) + ")"});
  }
  std::sort(rows.rbegin(), rows.rend());
  for (size_t i = 0; i < std::min<size_t>(12, rows.size()); ++i)
    std::printf("  %.3g  %s\n", rows[i].first, rows[i].second.c_str());
  std::printf("  total |d|^2 %.6g\n", total);
}

}  // namespace

TEST(CudaTrainModel, F32LossAndEveryGradientAgainstExactReference) {
  K3_REQUIRE_GPU();
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const Batch b = ids_b();
  const double loss = gpu_loss_and_grads(P, cfg(), b.rows, b.count, GpuPrecision::F32);
  EXPECT_NEAR(loss, double(exact_reference().read_f32("loss")[0]), 1e-5);
  const SafeTensors golden = SafeTensors::open(fixture("k3-tiny-a/golden-grads.safetensors"));
  // (b): the exact gradients of weights rounded at random to float32's relative precision, two draws.
  std::vector<ParamStore> rounded;
  for (uint32_t seed : {1u, 2u}) {
    rounded.push_back(ParamStore::from_model_dir(fixture("k3-tiny-a")));
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (double& v : rounded.back().values()) v *= 1.0 + std::ldexp(u(rng), -24);
    for (const auto& r : b.rows) sequence_loss(rounded.back(), cfg(), r, true, 1.0 / double(b.count));
  }
  int checked = 0;
  double worst = 0, worst_ratio = 0;
  std::string worst_name;
  std::vector<std::pair<double, std::string>> ratios;
  for (const std::string& n : trainable_names(P)) {
    const double* ours = P.g(n);
    const size_t numel = size_t(P.numel(n));
    if (!exact_reference().has("grad." + n)) {
      for (size_t i = 0; i < numel; ++i) ASSERT_EQ(ours[i], 0.0) << n << "[" << i << "]";
      continue;
    }
    const std::vector<float> exact = exact_reference().read_f32("grad." + n);
    const std::vector<float> want = golden.read_f32("grad." + n);
    ASSERT_EQ(exact.size(), numel) << n;
    const double e = rel_l2(ours, exact.data(), numel);
    double allow = rel_l2(exact.data(), want.data(), numel);
    for (const ParamStore& R : rounded) allow = std::max(allow, rel_l2(R.g(n), exact.data(), numel));
    EXPECT_LE(e, 8 * allow + 1e-5) << n << ": float32 rounding moves it by " << allow;
    if (e > worst) worst = e, worst_name = n;
    worst_ratio = std::max(worst_ratio, e / (allow + 1e-12));
    ratios.push_back({e / (allow + 1e-12), n + " e " + std::to_string(e) + " rounding " + std::to_string(allow)});
    ++checked;
  }
  EXPECT_EQ(checked, int(exact_reference().names().size()) - 1);
  std::printf("F32: loss %.8f; %d gradients; worst relative L2 %.3g (%s); worst ratio to float32 rounding's %.2f\n",
              loss, checked, worst, worst_name.c_str(), worst_ratio);
  std::sort(ratios.rbegin(), ratios.rend());
  for (size_t i = 0; i < std::min<size_t>(8, ratios.size()); ++i)
    std::printf("  ratio %.2f  %s\n", ratios[i].first, ratios[i].second.c_str());
}

TEST(CudaTrainModel, PackedBatchMatchesCpuFloat64) {
  // Several sequences of different lengths in one packed step (lengths 1, not a multiple of 16, > 16):
  // the GPU's f32 step against the CPU's float64 sequences one by one.
  K3_REQUIRE_GPU();
  ParamStore cpu = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  ParamStore gpu = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const std::vector<std::vector<int32_t>> rows = random_rows({1, 5, 16, 17, 40}, 7);
  int64_t count = 0;
  for (const auto& r : rows) count += int64_t(r.size()) - 1;
  double want = 0;
  for (const auto& r : rows) want += sequence_loss(cpu, cfg(), r, true, 1.0 / double(count));
  want /= double(count);
  const double got = gpu_loss_and_grads(gpu, cfg(), rows, count, GpuPrecision::F32);
  EXPECT_NEAR(got, want, 1e-5);
  const double e = rel_l2(gpu.grads().data(), cpu.grads().data(), cpu.grads().size());
  std::printf("packed F32 step: loss %.8f vs %.8f; whole-gradient relative L2 %.3g\n", got, want, e);
  EXPECT_LE(e, 1e-3);
}

// Trained-token masks (SFT's assistant tokens): a packed step with some targets left out, on the GPU in f32,
// against the CPU's float64 sequences one by one with the same masks, at the packed step's bars.
TEST(CudaTrainModel, MaskedTargetsMatchCpuFloat64) {
  K3_REQUIRE_GPU();
  ParamStore cpu = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  ParamStore gpu = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const std::vector<std::vector<int32_t>> rows = random_rows({3, 16, 17, 40}, 11);
  std::vector<k3::train::TokenMask> masks;
  int64_t count = 0;
  for (const auto& r : rows) {
    const int64_t len = int64_t(r.size());
    k3::train::TokenMask m(static_cast<size_t>(len));
    for (int64_t t = 0; t < len; ++t) m[size_t(t)] = uint8_t(t >= len / 3 && t % 5 != 0);  // a prompt, then gaps
    count += k3::train::target_count(len, {}, &m);
    masks.push_back(m);
  }
  double want = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    want += sequence_loss(cpu, cfg(), rows[i], {}, true, 1.0 / double(count), nullptr, nullptr, &masks[i]);
  want /= double(count);
  auto m = CudaTrainModel::create(cfg(), gpu, GpuPrecision::F32);
  m->zero_grads();
  const double got = m->loss(rows, true, 1.0 / double(count), nullptr, nullptr, nullptr, &masks) / double(count);
  m->download_grads(gpu);
  EXPECT_NEAR(got, want, 1e-5);
  const double e = rel_l2(gpu.grads().data(), cpu.grads().data(), cpu.grads().size());
  std::printf("masked F32 step: loss %.8f vs %.8f; whole-gradient relative L2 %.3g\n", got, want, e);
  EXPECT_LE(e, 1e-3);
  // A mask of another length, or one mask short, is refused by name.
  std::vector<k3::train::TokenMask> bad = masks;
  bad[1].pop_back();
  EXPECT_THROW(m->loss(rows, false, 0.0, nullptr, nullptr, nullptr, &bad), k3::Error);
  bad.pop_back();
  EXPECT_THROW(m->loss(rows, false, 0.0, nullptr, nullptr, nullptr, &bad), k3::Error);
}

// Token weights (a policy-gradient step's per-token coefficients, of either sign) with masks: the GPU's f32 step
// against the CPU's float64 sequences one by one with the same weights, at the packed step's bars (relative to the
// weighted loss's size).
TEST(CudaTrainModel, WeightedTargetsMatchCpuFloat64) {
  K3_REQUIRE_GPU();
  ParamStore cpu = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  ParamStore gpu = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const std::vector<std::vector<int32_t>> rows = random_rows({2, 16, 33}, 13);
  std::vector<k3::train::TokenMask> masks;
  std::vector<k3::train::TokenWeights> weights;
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  for (const auto& r : rows) {
    const size_t len = r.size();
    k3::train::TokenMask m(len, 1);
    k3::train::TokenWeights w(len);
    for (size_t t = 0; t < len; ++t) m[t] = uint8_t(t % 4 != 1), w[t] = u(rng) / 20.0;
    masks.push_back(m), weights.push_back(w);
  }
  cpu.zero_grads();
  double want = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    want += sequence_loss(cpu, cfg(), rows[i], {}, true, 1.0, nullptr, nullptr, &masks[i], &weights[i]);
  auto m = CudaTrainModel::create(cfg(), gpu, GpuPrecision::F32);
  m->zero_grads();
  const double got = m->loss(rows, true, 1.0, nullptr, nullptr, nullptr, &masks, &weights);
  m->download_grads(gpu);
  double scale = 0;  // the unweighted loss of the same tokens: what the weighted sum's rounding is relative to
  for (size_t i = 0; i < rows.size(); ++i)
    scale += sequence_loss(cpu, cfg(), rows[i], {}, false, 0.0, nullptr, nullptr, &masks[i]) / 20.0;
  EXPECT_NEAR(got, want, 1e-5 * scale);
  const double e = rel_l2(gpu.grads().data(), cpu.grads().data(), cpu.grads().size());
  std::printf("weighted F32 step: loss %.8f vs %.8f; whole-gradient relative L2 %.3g\n", got, want, e);
  EXPECT_LE(e, 1e-3);
  std::vector<k3::train::TokenWeights> bad = weights;
  bad[2].pop_back();
  EXPECT_THROW(m->loss(rows, false, 0.0, nullptr, nullptr, nullptr, nullptr, &bad), k3::Error);
}

TEST(CudaTrainModel, Bf16StepNearFloat64) {
  K3_REQUIRE_GPU();
  RandomInitOptions ri;
  ri.seed = 3;
  ParamStore cpu = ParamStore::random_init(cfg(), ri);
  ParamStore gpu = ParamStore::random_init(cfg(), ri);
  const Batch b = ids_b();
  double want = 0;
  for (const auto& r : b.rows) want += sequence_loss(cpu, cfg(), r, true, 1.0 / double(b.count));
  want /= double(b.count);
  const double got = gpu_loss_and_grads(gpu, cfg(), b.rows, b.count, GpuPrecision::BF16);
  EXPECT_NEAR(got, want, 1e-2 * std::abs(want));
  const double e = rel_l2(gpu.grads().data(), cpu.grads().data(), cpu.grads().size());
  std::printf("BF16 step: loss %.6f vs %.6f; whole-gradient relative L2 %.3g\n", got, want, e);
  print_worst(gpu, cpu);
  EXPECT_LE(e, 5e-2);
}

// The same with every MoE layer's routed experts on the grouped GEMMs.
TEST(CudaTrainModel, Bf16GroupedExpertsStepNearFloat64) {
  K3_REQUIRE_GPU();
  const K3Config& c = cfg_grouped();
  RandomInitOptions ri;
  ri.seed = 3;
  ParamStore cpu = ParamStore::random_init(c, ri);
  ParamStore gpu = ParamStore::random_init(c, ri);
  const Batch b = ids_b();
  double want = 0;
  for (const auto& r : b.rows) want += sequence_loss(cpu, c, r, true, 1.0 / double(b.count));
  want /= double(b.count);
  auto m = CudaTrainModel::create(c, gpu, GpuPrecision::BF16);
  m->zero_grads();
  const double got = m->loss(b.rows, true, 1.0 / double(b.count)) / double(b.count);
  m->download_grads(gpu);
  int64_t moe_layers = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.is_moe_layer(l);
  EXPECT_EQ(m->grouped_expert_layers(), moe_layers);
  EXPECT_NEAR(got, want, 1e-2 * std::abs(want));
  const double e = rel_l2(gpu.grads().data(), cpu.grads().data(), cpu.grads().size());
  std::printf("BF16 grouped-experts step: loss %.6f vs %.6f; whole-gradient relative L2 %.3g\n", got, want, e);
  print_worst(gpu, cpu);
  EXPECT_LE(e, 5e-2);
}

// Batch-invariant mode: a sequence's per-token losses are the same bits alone, packed among other
// sequences of other lengths, in a larger step, and in a training pass; they still compute the model
// (near the float64 losses), and a batch-invariant step's gradient is near the float64 one.
TEST(CudaTrainModel, BatchInvariantLossesDoNotDependOnTheBatch) {
  K3_REQUIRE_GPU();
  const K3Config& c = cfg_grouped();  // every weight on the fixed-tile GEMM's grid
  RandomInitOptions ri;
  ri.seed = 7;
  ParamStore cpu = ParamStore::random_init(c, ri);
  const ParamStore P = cpu;
  auto m = CudaTrainModel::create(c, P, GpuPrecision::BF16);
  m->set_batch_invariant(true);
  EXPECT_TRUE(m->batch_invariant());
  std::mt19937 rng(11);
  auto random_seq = [&](size_t n) {
    std::vector<int32_t> s(n);
    for (int32_t& v : s) v = int32_t(rng() % uint32_t(c.vocab_size));
    return s;
  };
  const std::vector<int32_t> a = random_seq(77);
  const std::vector<int32_t> x = random_seq(23), y = random_seq(130), z = random_seq(5), w = random_seq(64);
  std::vector<std::vector<double>> alone, mixed, many, training;
  const double loss_alone = m->loss({a}, false, 0.0, nullptr, &alone);
  m->loss({x, a, y}, false, 0.0, nullptr, &mixed);
  m->loss({y, z, w, x, a, y, w}, false, 0.0, nullptr, &many);
  m->zero_grads();
  m->loss({w, a}, true, 1.0, nullptr, &training);
  ASSERT_EQ(alone.size(), 1u);
  ASSERT_EQ(alone[0].size(), a.size() - 1);
  EXPECT_TRUE(mixed[1] == alone[0]) << "packed between two other sequences";
  EXPECT_TRUE(many[4] == alone[0]) << "in a step of seven sequences";
  EXPECT_TRUE(training[1] == alone[0]) << "in a training pass";
  double sum = 0;
  for (double l : alone[0]) sum += l;
  EXPECT_NEAR(sum, loss_alone, 1e-5 * loss_alone);  // the summed loss is the token losses' sum
  const double want = sequence_loss(cpu, c, a, false, 0.0);
  std::printf("batch-invariant: sequence loss %.6f, float64 %.6f\n", sum, want);
  EXPECT_NEAR(sum, want, 1e-2 * want);

  // The gradient of a batch-invariant step against float64 (the bar of the other bf16 steps).
  const Batch b = ids_b();
  double want_step = 0;
  cpu.zero_grads();
  for (const auto& r : b.rows) want_step += sequence_loss(cpu, c, r, true, 1.0 / double(b.count));
  ParamStore gpu = P;
  m->zero_grads();
  const double got = m->loss(b.rows, true, 1.0 / double(b.count));
  m->download_grads(gpu);
  EXPECT_NEAR(got, want_step, 1e-2 * want_step);
  const double e = rel_l2(gpu.grads().data(), cpu.grads().data(), cpu.grads().size());
  std::printf("batch-invariant BF16 step: loss %.6f vs %.6f; whole-gradient relative L2 %.3g\n", got / double(b.count),
              want_step / double(b.count), e);
  EXPECT_LE(e, 5e-2);

  // The mode is bf16's: fp32 GEMMs have no fixed-tile kernel here.
  auto f32 = CudaTrainModel::create(c, P, GpuPrecision::F32);
  EXPECT_THROW(f32->set_batch_invariant(true), Error);
}

TEST(CudaTrainModel, StepIsRepeatableAndSequencesDoNotMix) {
  // The same sequence's loss is bitwise equal run to run; packed behind another sequence it is the
  // same loss up to fp32 rounding (nothing crosses a sequence boundary: a leak would move it by far more).
  K3_REQUIRE_GPU();
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  auto m = CudaTrainModel::create(cfg(), P, GpuPrecision::F32);
  const std::vector<int32_t> a = k3test::golden_rows("ids_b")[0];
  const double l1 = m->loss({a}, false, 0.0), l2 = m->loss({a}, false, 0.0);
  EXPECT_EQ(l1, l2);
  std::vector<int32_t> other(23, 7);
  const double with = m->loss({other, a}, false, 0.0) - m->loss({other}, false, 0.0);
  EXPECT_NEAR(with, l1, 1e-5 * std::abs(l1));
}

TEST(CudaTrainModel, RecomputationGivesTheSameBits) {
  // Every layer's blocks recomputed in the backward: the same loss and gradients bit for bit (the
  // kernels are deterministic), in both precisions.
  K3_REQUIRE_GPU();
  const Batch b = ids_b();
  for (const K3Config* c : {&cfg(), &cfg_grouped()}) {  // the second: grouped expert GEMMs in bf16
    RandomInitOptions ri;
    ri.seed = 5;
    const ParamStore P = ParamStore::random_init(*c, ri);
    for (GpuPrecision p : {GpuPrecision::F32, GpuPrecision::BF16}) {
      ParamStore keep = P, again = P;
      auto m = CudaTrainModel::create(*c, P, p);
      m->zero_grads();
      const double l1 = m->loss(b.rows, true, 1.0);
      m->download_grads(keep);
      m->set_recompute(std::vector<bool>(size_t(c->num_hidden_layers), true));
      m->zero_grads();
      const double l2 = m->loss(b.rows, true, 1.0);
      m->download_grads(again);
      EXPECT_EQ(l1, l2) << gpu_precision_name(p) << ", " << c->kda_num_heads << " KDA heads";
      EXPECT_TRUE(keep.grads() == again.grads())
          << gpu_precision_name(p) << ", " << c->kda_num_heads << " KDA heads: relative L2 "
          << rel_l2(again.grads().data(), keep.grads().data(), keep.grads().size());
    }
  }
}

// The training kernels' shape contracts are checked at create, with the config field named (no GPU needed).
TEST(CudaTrainModelConfig, ShapesTheTrainingKernelsCannotTakeAreNamed) {
  EXPECT_EQ(gpu_train_config_problem(cfg()), "");
  for (const char* name : {"kimi-k3", "k3-shaped-h200", "k3-1b"})
    EXPECT_EQ(gpu_train_config_problem(load_config(std::string(K3_SOURCE_DIR) + "/configs/" + name + ".json")), "")
        << name;
  K3Config c = cfg();
  c.kda_head_dim = 48;
  EXPECT_NE(gpu_train_config_problem(c).find("kda_head_dim 48"), std::string::npos);
  c = cfg();
  c.v_head_dim = 320;  // inference's exact path takes it; the training attention does not
  EXPECT_NE(gpu_train_config_problem(c).find("v_head_dim = 320"), std::string::npos);
  EXPECT_EQ(gpu_config_problem(c, GpuPrecision::F32), "");
  c = cfg();
  c.num_experts = 9000;
  EXPECT_NE(gpu_train_config_problem(c).find("num_experts 9000"), std::string::npos);
}
