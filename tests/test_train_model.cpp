// The whole training model (src/model/training/model_train.h): float64 forward + explicit backward through
// every K3 block, against Moonshot's reference on the golden fixture (loss_ids_b; every gradient
// against the exact-arithmetic reference and against golden-grads.safetensors), its logits against
// the golden logits, and the model-level
// gradient (AttnRes graph, residual snapshots, embedding, lm_head) against finite differences.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/model_train.h"
#include "util/cli.h"
#include "util/finite_diff.h"
#include "util/fixture.h"
#include "util/temp_dir.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using k3test::golden;
using k3test::rel_l2;

namespace {

const K3Config& cfg() {
  static K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  return c;
}

ParamStore fresh_params() { return ParamStore::from_model_dir(fixture("k3-tiny-a")); }

}  // namespace

// Bars are the fixture's own (../shared/fixtures/README.md): logits and per-layer outputs 1e-4,
// gradients 1e-3. Our float64 path cannot get much closer: the "float64" reference still runs the
// router, AttnRes, SiTU and the MLA softmax in float32 (K3-ARCHITECTURE.md §6), which leaves ~1e-7
// relative noise per block in the goldens (attn_out.0 is at 1.0e-7) that grows with depth to ~1e-5.
TEST(TrainModel, LogitsMatchGolden) {
  ParamStore P = fresh_params();
  const std::vector<std::vector<int32_t>> rows = k3test::golden_rows("ids_b");
  const std::vector<float> want = golden().read_f32("logits_ids_b");
  const int64_t V = cfg().vocab_size;
  for (size_t b = 0; b < rows.size(); ++b) {
    std::vector<double> logits;
    sequence_loss(P, cfg(), rows[b], false, 0.0, &logits);
    const size_t n = rows[b].size() * size_t(V);
    const double e = rel_l2(logits.data(), want.data() + b * n, n);
    EXPECT_LE(e, 1e-4) << "row " << b;
    std::printf("logits_ids_b row %zu: rel L2 %.3g\n", b, e);
  }
}

TEST(TrainModel, EveryBlockOutputMatchesGolden) {
  // ids_a: the fixture stores every block's output; report each layer's error (the first one off
  // says where an implementation departs).
  ParamStore P = fresh_params();
  TrainHooks hooks;
  double worst = 0;
  hooks.tensor = [&](const char* name, int64_t layer, const double* data, int64_t rows, int64_t cols) {
    const std::vector<float> want = golden().read_f32(std::string(name) + "." + std::to_string(layer));
    ASSERT_EQ(want.size(), size_t(rows * cols));
    const double e = rel_l2(data, want.data(), want.size());
    std::printf("%s.%lld  rel L2 %.3g\n", name, (long long)layer, e);
    worst = std::max(worst, e);
  };
  sequence_loss(P, cfg(), k3test::golden_row("ids_a"), false, 0.0, nullptr, &hooks);
  EXPECT_LE(worst, 1e-4);  // the fixture's per-layer bar (see LogitsMatchGolden for why not lower)
}

namespace {

// Loss of ids_b (mean next-token cross-entropy over both rows) with every gradient in P.
double ids_b_loss_and_grads(ParamStore& P) {
  const std::vector<std::vector<int32_t>> rows = k3test::golden_rows("ids_b");
  int64_t count = 0;
  for (const auto& r : rows) count += int64_t(r.size()) - 1;
  double loss = 0;
  for (const auto& r : rows) loss += sequence_loss(P, cfg(), r, true, 1.0 / double(count));
  return loss / double(count);
}

// Per-tensor relative L2 of our gradients against `ref` (grad.<name>), calling `check(name, error)`
// for each. A parameter `ref` has no gradient for (routed experts no token chose; the AttnRes query
// of layer 0's attention, whose mix of one source the reference skips) must be exactly zero here.
// Returns how many tensors were compared.
int compare_grads(const ParamStore& P, const SafeTensors& ref,
                  const std::function<void(const std::string&, double)>& check) {
  int checked = 0;
  for (const std::string& n : trainable_names(P)) {
    const double* ours = P.g(n);
    const size_t numel = size_t(P.numel(n));
    if (!ref.has("grad." + n)) {
      for (size_t i = 0; i < numel; ++i) EXPECT_EQ(ours[i], 0.0) << n << "[" << i << "]";
      continue;
    }
    const std::vector<float> want = ref.read_f32("grad." + n);
    EXPECT_EQ(want.size(), numel) << n;
    if (want.size() != numel) continue;
    check(n, rel_l2(ours, want.data(), numel));
    ++checked;
  }
  return checked;
}

const SafeTensors& exact_reference_grads() {
  static SafeTensors g = SafeTensors::open(fixture("k3-tiny-a/grads-exact-reference.safetensors"));
  return g;
}

}  // namespace

// The gradient's truth: Moonshot's own modeling code on this model in float64 with its float32 casts
// turned off (tests/tools/reference_grads/make_exact_grads.py), which is the exact gradient. Stored
// as F32, so the bar is a few float32 roundings; measured 3.4e-8 on the worst tensor.
TEST(TrainModel, LossAndEveryGradientMatchExactReference) {
  ParamStore P = fresh_params();
  const double loss = ids_b_loss_and_grads(P);
  EXPECT_NEAR(loss, double(exact_reference_grads().read_f32("loss")[0]), 1e-6);
  double worst = 0;
  std::string worst_name;
  const int checked = compare_grads(P, exact_reference_grads(), [&](const std::string& n, double e) {
    EXPECT_LE(e, 1e-6) << n;
    if (e > worst) worst = e, worst_name = n;
  });
  EXPECT_EQ(checked, int(exact_reference_grads().names().size()) - 1);  // every reference gradient has a parameter
  std::printf("checked %d gradients; worst relative L2 %.3g (%s)\n", checked, worst, worst_name.c_str());
}

// Against the fixture's golden-grads.safetensors, made by the same reference code with its float32
// casts left in. This random model amplifies a relative perturbation of its weights ~2e5-fold into
// its early-layer gradients, so those casts leave up to 1e-2 of rounding noise there: the exact
// reference above misses the golden by 1.1e-2 (layer 1), and the same cast-laden code rerun under
// another torch build misses it by 1.6e-3 (docs/NUMERICS.md). The fixture's 1e-3 bar is therefore out of reach
// for any implementation that does not share that build's rounding, Moonshot's own code included.
// What this test holds us to: the loss at the golden's 1e-5, and every gradient no farther from the
// golden than the exact reference is (within 1% or 1e-6), with the per-tensor figures printed.
TEST(TrainModel, LossAndEveryGradientAgainstGolden) {
  ParamStore P = fresh_params();
  const double loss = ids_b_loss_and_grads(P);
  EXPECT_NEAR(loss, double(golden().read_f32("loss_ids_b")[0]), 1e-5);
  const SafeTensors g = SafeTensors::open(fixture("k3-tiny-a/golden-grads.safetensors"));
  int within_bar = 0;
  double worst = 0;
  std::string worst_name;
  const int checked = compare_grads(P, g, [&](const std::string& n, double e) {
    const std::vector<float> exact = exact_reference_grads().read_f32("grad." + n);
    const std::vector<float> want = g.read_f32("grad." + n);
    const double reference_gap = rel_l2(exact.data(), want.data(), want.size());
    EXPECT_LE(e, 1.01 * reference_gap + 1e-6) << n << ": the exact reference is at " << reference_gap;
    within_bar += e <= 1e-3;
    if (e > worst) worst = e, worst_name = n;
  });
  EXPECT_EQ(checked, int(g.names().size()));
  std::printf("checked %d gradients against the golden: %d within 1e-3; worst relative L2 %.3g (%s)\n", checked,
              within_bar, worst, worst_name.c_str());
}

TEST(TrainModel, ModelGradientMatchesFiniteDifferences) {
  // A short sequence through the whole fixture model; a few entries of every tensor kind.
  ParamStore P = fresh_params();
  const std::vector<int32_t> ids = {5, 900, 17, 250, 3, 77, 640};
  sequence_loss(P, cfg(), ids, true, 1.0);
  std::mt19937 rng(5);
  const double eps = 1e-6;
  int checked = 0;
  for (const std::string& n : trainable_names(P)) {
    // One representative per tensor kind: layer 3 (MLA), layer 2 (KDA, MoE), layer 0 (dense) and globals.
    const bool pick = n.find("layers.") == std::string::npos || n.find("layers.2.") != std::string::npos ||
                      n.find("layers.3.") != std::string::npos || n.find("layers.0.mlp") != std::string::npos;
    if (!pick || n.find("experts.") != std::string::npos) continue;
    const int64_t numel = P.numel(n);
    const double* grad = P.g(n);
    for (int k = 0; k < 2; ++k) {
      const int64_t i = int64_t(rng() % uint64_t(numel));
      const double num = k3test::central_difference(
          P.p_mut(n) + i, [&] { return sequence_loss(P, cfg(), ids, false, 0.0); }, eps);
      EXPECT_NEAR(grad[i], num, 1e-6 + 1e-4 * std::abs(num)) << n << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 40);
}

TEST(TrainModel, GradCliWritesLossAndGradients) {
  k3test::TempDir dir("grad_cli");
  const std::vector<std::vector<int32_t>> rows = k3test::golden_rows("ids_b");
  std::vector<std::string> args = {"grad", "--model", fixture("k3-tiny-a"), "--out", dir.file("g.safetensors")};
  for (const auto& r : rows) {
    std::string s;
    for (int32_t id : r) {
      if (!s.empty()) s += ',';
      s += std::to_string(id);
    }
    args.push_back("--ids");
    args.push_back(s);
  }
  const k3test::Outcome r = k3test::run_k3(args);
  ASSERT_EQ(r.status, 0) << r.output;
  const SafeTensors out = SafeTensors::open(dir.file("g.safetensors"));
  EXPECT_NEAR(out.read_f32("loss")[0], golden().read_f32("loss_ids_b")[0], 1e-5);
  // The file holds the in-process gradients (rounded to F32) under every trained name.
  ParamStore P = fresh_params();
  int64_t count = 0;
  for (const auto& row : rows) count += int64_t(row.size()) - 1;
  for (const auto& row : rows) sequence_loss(P, cfg(), row, true, 1.0 / double(count));
  const std::vector<std::string> names = trainable_names(P);
  EXPECT_EQ(out.names().size(), names.size() + 1);
  for (const std::string& n : names) {
    const std::vector<float> got = out.read_f32("grad." + n);
    ASSERT_EQ(got.size(), size_t(P.numel(n))) << n;
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], float(P.g(n)[i])) << n << "[" << i << "]";
  }
  const k3test::Outcome bad =
      k3test::run_k3({"grad", "--model", fixture("k3-tiny-a"), "--ids", "5", "--out", dir.file("x")});
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("at least 2 tokens"), std::string::npos) << bad.output;
}
