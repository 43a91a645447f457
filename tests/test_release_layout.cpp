// The release-shaped synthetic checkpoint: `k3 init --release-shards` writes the released checkpoint's layout
// (93 layers in 96 shards, K3-ARCHITECTURE.md §4) at reduced widths; the model loads from it, and its logits at 2
// and 4 expert-parallel ranks equal one process's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/release_layout.h"
#include "util/compare.h"
#include "util/mpi_launch.h"
#include "util/temp_dir.h"

namespace fs = std::filesystem;

namespace {

// configs/k3-release-shaped.json with 64 experts per layer instead of 896 (a test-sized checkpoint: 18M expert
// parameters instead of 253M; every other dimension, the layer count and the names as the file has them).
std::string test_config(const k3test::TempDir& dir) {
  std::ifstream in(std::string(K3_SOURCE_DIR) + "/configs/k3-release-shaped.json");
  nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["text_config"]["num_hidden_layers"], 93);
  EXPECT_EQ(j["text_config"]["num_experts"], 896);
  j["text_config"]["num_experts"] = 64;
  const std::string path = dir.file("config.json");
  std::ofstream(path) << j.dump(2);
  return path;
}

std::vector<float> logits_of(const std::string& path) { return k3::SafeTensors::open(path).read_f32("logits"); }

}  // namespace

TEST(ReleaseLayout, ShardOfEveryKindOfTensor) {
  EXPECT_EQ(k3::release_shard_of("language_model.model.layers.0.input_layernorm.weight", 93), 1);
  EXPECT_EQ(k3::release_shard_of("language_model.model.layers.92.block_sparse_moe.experts.5.w1.weight_packed", 93), 93);
  EXPECT_EQ(k3::release_shard_of("language_model.model.embed_tokens.weight", 93), 94);
  EXPECT_EQ(k3::release_shard_of("language_model.lm_head.weight", 93), 94);
  EXPECT_EQ(k3::release_shard_of("mm_projector.proj.0.weight", 93), 95);
  EXPECT_EQ(k3::release_shard_of("vision_tower.encoder.blocks.3.wo.weight", 93), 96);
  EXPECT_EQ(k3::release_shard_file(7, 96), "model-00007-of-000096.safetensors");
  EXPECT_THROW(k3::release_shard_of("language_model.model.layers.93.input_layernorm.weight", 93), k3::Error);
  EXPECT_THROW(k3::release_shard_of("language_model.model.layers.x.input_layernorm.weight", 93), k3::Error);
}

TEST(ReleaseLayout, SyntheticReleaseLoadsAndRunsOverRanks) {
  k3test::TempDir dir("release_layout");
  const std::string cfg = test_config(dir), model = dir.file("model");
  k3test::Outcome o = k3test::run_k3({"init", "--config", cfg, "--out", model, "--mxfp4", "--release-shards"});
  ASSERT_EQ(o.status, 0) << o.output;

  // 96 files named as the release names them, and an index that places every tensor by the layout.
  int shards = 0;
  for (const auto& e : fs::directory_iterator(model))
    if (e.path().extension() == ".safetensors") ++shards;
  EXPECT_EQ(shards, 96);
  EXPECT_FALSE(fs::exists(model + "/model.safetensors"));
  std::ifstream idx(model + "/model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(idx);
  EXPECT_GT(index["metadata"]["total_size"].get<int64_t>(), 0);
  for (const auto& [name, file] : index["weight_map"].items())
    EXPECT_EQ(file.get<std::string>(), k3::release_shard_file(k3::release_shard_of(name, 93), 96)) << name;

  // One expert's six tensors lie back to back in its layer's shard, in the release's order.
  const k3::SafeTensors st = k3::SafeTensors::open(model);
  const std::string e = "language_model.model.layers.40.block_sparse_moe.experts.17.";
  size_t end = 0;
  for (const char* leaf : {"w1.weight_packed", "w1.weight_scale", "w2.weight_packed", "w2.weight_scale",
                           "w3.weight_packed", "w3.weight_scale"}) {
    const k3::TensorView& t = st.get(e + leaf);
    EXPECT_EQ(*t.file, model + "/" + k3::release_shard_file(41, 96)) << leaf;
    if (end != 0) {
      EXPECT_EQ(t.file_offset, end) << leaf;
    }
    end = t.file_offset + t.nbytes;
  }

  // Logits over the sharded checkpoint, one process and 2 and 4 expert-parallel ranks: the same bits.
  auto args = [&](const std::string& out) {
    return std::vector<std::string>{"logits", "--model", model, "--ids", "5,17,300,2,900,44,61,7", "--out", out};
  };
  o = k3test::run_k3(args(dir.file("solo.safetensors")));
  ASSERT_EQ(o.status, 0) << o.output;
  const std::vector<float> want = logits_of(dir.file("solo.safetensors"));
  for (int ranks : {2, 4}) {
    const std::string out = dir.file(std::to_string(ranks) + ".safetensors");
    o = k3test::run_k3_ranks(ranks, args(out));
    ASSERT_EQ(o.status, 0) << o.output;
    EXPECT_EQ(logits_of(out), want) << ranks << " ranks";
  }

  // Written again as one file, the directory holds only the new layout and loads.
  o = k3test::run_k3({"init", "--config", cfg, "--out", model, "--mxfp4"});
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_FALSE(fs::exists(model + "/model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(model + "/" + k3::release_shard_file(1, 96)));
  o = k3test::run_k3(args(dir.file("single.safetensors")));
  ASSERT_EQ(o.status, 0) << o.output;
  EXPECT_EQ(logits_of(dir.file("single.safetensors")), want);  // same seed, same weights
}
