// The CPU model against Moonshot's reference outputs for the tiny K3 fixture (float64 reference;
// tolerances from ../shared/fixtures/README.md: relative L2 <= 1e-4 for logits and per-layer outputs).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>

#include "model/model.h"
#include "util/fixture.h"
#include "util/temp_dir.h"

using namespace k3;
using k3test::fixture;
using k3test::rel_l2;
using k3test::golden;
using k3test::golden_rows;
using k3test::tiny;

namespace {

std::vector<float> full_logits(Model& m, const std::vector<std::vector<int32_t>>& rows) {
  std::vector<SequenceCache> caches;
  for (size_t b = 0; b < rows.size(); ++b) caches.push_back(m.new_cache());
  std::vector<SequenceCache*> ptrs;
  for (auto& c : caches) ptrs.push_back(&c);
  return m.forward(ptrs, rows, true);
}

}  // namespace

class GoldenLogits : public ::testing::TestWithParam<const char*> {};

TEST_P(GoldenLogits, WithinRelL2_1e4) {
  const std::string ids = GetParam();
  std::vector<float> ours = full_logits(tiny(), golden_rows(ids));
  std::vector<float> ref = golden().read_f32("logits_" + ids);
  const double err = rel_l2(ours, ref);
  std::printf("logits_%s rel L2 = %.3e\n", ids.c_str(), err);
  EXPECT_LE(err, 1e-4) << ids;
}

INSTANTIATE_TEST_SUITE_P(Fixture, GoldenLogits, ::testing::Values("ids_a", "ids_b", "ids_long"));

TEST(Golden, ReferencePathAlsoMatches) {
  // K3_REFERENCE-style path (KDA recurrence, expanded MLA) against the golden logits of ids_long.
  Model& m = tiny();
  PathOptions saved = m.options();
  m.options().reference = true;
  std::vector<float> ours = full_logits(m, golden_rows("ids_long"));
  m.options() = saved;
  const double err = rel_l2(ours, golden().read_f32("logits_ids_long"));
  std::printf("reference path: logits_ids_long rel L2 = %.3e\n", err);
  EXPECT_LE(err, 1e-4);
}

TEST(Golden, Mxfp4ModelLogits) {
  // A model directory laid out as a user would: config.json + model.safetensors.
  namespace fs = std::filesystem;
  const k3test::TempDir tmp("mxfp4-model");
  const fs::path& dir = tmp.path();
  fs::copy_file(fixture("k3-tiny-a/config-mxfp4.json"), dir / "config.json");
  fs::copy_file(fixture("k3-tiny-a/model-mxfp4.safetensors"), dir / "model.safetensors");
  auto m = Model::load(dir.string());
  EXPECT_TRUE(m->config().experts_mxfp4);
  EXPECT_EQ(m->weights().layers[1].moe.experts[0].w1.format, WeightRef::Format::MXFP4);
  std::vector<float> ours = full_logits(*m, golden_rows("ids_a"));
  const double err = rel_l2(ours, golden().read_f32("logits_mxfp4_ids_a"));
  std::printf("logits_mxfp4_ids_a rel L2 = %.3e\n", err);
  EXPECT_LE(err, 1e-4);
}

TEST(Golden, PerLayerOutputsAndRouting) {
  Model& m = tiny();
  std::map<std::string, std::vector<float>> got;
  std::map<int64_t, std::vector<int32_t>> topk;
  int64_t K = 0;
  ForwardHooks hooks;
  hooks.tensor = [&](const char* name, int64_t l, const float* p, int64_t rows, int64_t cols) {
    got[std::string(name) + "." + std::to_string(l)].assign(p, p + rows * cols);
  };
  hooks.topk = [&](int64_t l, const int32_t* idx, int64_t rows, int64_t k) {
    K = k;
    std::vector<int32_t> v(idx, idx + rows * k);
    for (int64_t r = 0; r < rows; ++r) std::sort(v.begin() + r * k, v.begin() + (r + 1) * k);
    topk[l] = v;
  };
  SequenceCache cache = m.new_cache();
  m.forward({&cache}, golden_rows("ids_a"), true, &hooks);
  const int64_t L = m.config().num_hidden_layers;
  for (int64_t l = 0; l < L; ++l) {
    for (const char* what : {"attn_out", "ffn_out"}) {
      const std::string key = std::string(what) + "." + std::to_string(l);
      ASSERT_TRUE(got.count(key)) << key;
      const double err = rel_l2(got[key], golden().read_f32(key));
      std::printf("%-10s rel L2 %.2e\n", key.c_str(), err);
      EXPECT_LE(err, 1e-4) << key << " rel L2 " << err;
    }
    if (!m.config().is_moe_layer(l)) continue;
    const std::string key = "topk_idx." + std::to_string(l);
    std::vector<int64_t> ref = golden().read_i64(key);
    ASSERT_EQ(ref.size(), topk[l].size()) << key;
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_EQ(ref[i], topk[l][i]) << key << " token " << i / size_t(K) << " slot " << i % size_t(K);
  }
}
