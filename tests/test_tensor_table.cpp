// The tensor table (src/model/tensor_table.h) against truths it did not produce: the fixture
// checkpoints written by the reference code (every tensor, both naming forms, dtypes), the parameter
// and tensor counts of the released model (K3-ARCHITECTURE.md §1, §4), the Per-Head Muon splits as
// the report describes them, and k3 init's output read back.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <map>
#include <set>
#include <string>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/init_random.h"
#include "model/param_count.h"
#include "model/params.h"
#include "model/tensor_table.h"
#include "model/vision_config.h"
#include "util/compare.h"
#include "util/temp_dir.h"

namespace {

using k3::TensorKind;
using k3::TensorNaming;
using k3::TensorTable;
using k3test::fixture;

const std::string kKimiK3 = std::string(K3_SOURCE_DIR) + "/configs/kimi-k3.json";

k3::K3Config tiny_config() { return k3::load_config(fixture("k3-tiny-a/config.json")); }

// Name -> entry, for one naming.
std::map<std::string, const k3::TensorEntry*> by_name(const TensorTable& t, TensorNaming n) {
  std::map<std::string, const k3::TensorEntry*> m;
  for (const k3::TensorEntry& e : t.entries()) EXPECT_TRUE(m.emplace(t.name(e, n), &e).second) << t.name(e, n);
  return m;
}

std::string strip_namespace(const std::string& name) {
  const std::string ns = "language_model.";
  return name.rfind(ns, 0) == 0 ? name.substr(ns.size()) : name;
}

// Every tensor of the reference's fixture checkpoint is in the table with its shape and dtype, and
// every table tensor is in the checkpoint, in the release naming and (namespace stripped) the flat one.
TEST(TensorTable, MatchesFixtureCheckpointBothNamings) {
  const TensorTable t(tiny_config());
  const k3::SafeTensors st = k3::SafeTensors::open(fixture("k3-tiny-a/model.safetensors"));
  for (TensorNaming n : {TensorNaming::Release, TensorNaming::Flat}) {
    const auto table = by_name(t, n);
    std::set<std::string> seen;
    for (const std::string& stored : st.names()) {
      const std::string name = n == TensorNaming::Release ? stored : strip_namespace(stored);
      auto it = table.find(name);
      ASSERT_NE(it, table.end()) << "fixture tensor not in the table: " << name;
      EXPECT_EQ(it->second->shape, st.get(stored).shape) << name;
      EXPECT_EQ(it->second->info().dtype, st.get(stored).dtype) << name;
      seen.insert(name);
    }
    for (const auto& [name, e] : table) EXPECT_TRUE(seen.count(name)) << "table tensor not in the fixture: " << name;
  }
  EXPECT_EQ(t.entries().size(), st.names().size());
}

// The MXFP4 fixture: every routed expert matrix is the `_packed` [out, in/2] + `_scale` [out, in/32]
// pair of its table entry; everything else is as in the table.
TEST(TensorTable, MatchesMxfp4Fixture) {
  const TensorTable t(k3::load_config(fixture("k3-tiny-a/config-mxfp4.json")));
  const k3::SafeTensors st = k3::SafeTensors::open(fixture("k3-tiny-a/model-mxfp4.safetensors"));
  std::set<std::string> expect;
  for (const k3::TensorEntry& e : t.entries()) {
    const std::string name = t.name(e);
    if (e.info().store != k3::TensorStore::ExpertMatrix) {
      expect.insert(name);
      ASSERT_TRUE(st.has(name)) << name;
      EXPECT_EQ(st.get(name).shape, e.shape) << name;
      continue;
    }
    const std::string packed = k3::mxfp4_packed_name(name), scale = k3::mxfp4_scale_name(name);
    expect.insert(packed);
    expect.insert(scale);
    ASSERT_TRUE(st.has(packed) && st.has(scale)) << name;
    EXPECT_EQ(st.get(packed).shape, (std::vector<int64_t>{e.shape[0], e.shape[1] / 2})) << name;
    EXPECT_EQ(st.get(scale).shape, (std::vector<int64_t>{e.shape[0], e.shape[1] / 32})) << name;
    EXPECT_EQ(st.get(packed).dtype, k3::DType::U8);
    for (const std::string& part : {packed, scale}) {
      const auto id = k3::parse_tensor_name(part);
      ASSERT_TRUE(id) << part;
      EXPECT_EQ(id->kind, e.kind);
      EXPECT_EQ(id->expert, e.expert);
      EXPECT_EQ(id->part, part == packed ? k3::TensorPart::Mxfp4Packed : k3::TensorPart::Mxfp4Scale);
    }
  }
  const std::vector<std::string> stored = st.names();
  EXPECT_EQ(std::set<std::string>(stored.begin(), stored.end()), expect);
}

// The reference's gradients name only parameters the table calls trainable, with their shapes; the
// router's selection bias (not trainable) has none.
TEST(TensorTable, FixtureGradientsAreTrainableTensors) {
  const TensorTable t(tiny_config());
  const auto table = by_name(t, TensorNaming::Release);
  const k3::SafeTensors g = k3::SafeTensors::open(fixture("k3-tiny-a/golden-grads.safetensors"));
  int n = 0;
  for (const std::string& name : g.names()) {
    ASSERT_EQ(name.rfind("grad.", 0), 0u) << name;
    auto it = table.find(name.substr(5));
    ASSERT_NE(it, table.end()) << name;
    EXPECT_TRUE(it->second->info().trainable) << name;
    EXPECT_EQ(g.get(name).shape, it->second->shape) << name;
    ++n;
  }
  EXPECT_GT(n, 100);
  int untrained = 0;
  for (const k3::TensorEntry& e : t.entries()) untrained += !e.info().trainable;
  EXPECT_EQ(untrained, 7);  // one router bias per MoE layer (1..7)
}

// The released model (K3-ARCHITECTURE.md §1, §4): 2,779,484,478,208 text parameters (A_log counted
// padded to 128), 443,740,416 per KDA attention block, 33,030,144 per expert, and 497,220 tensors in
// the 96 shards once the experts are MXFP4 pairs and the vision tower and projector (§4.7) are added.
TEST(TensorTable, ReleasedModelCounts) {
  const k3::K3Config c = k3::load_config(kKimiK3);
  const TensorTable t(c);
  int64_t total = 0, kda_layer0 = 0, expert = 0, experts = 0, a_log = 0;
  for (const k3::TensorEntry& e : t.entries()) {
    total += e.params;
    if (e.layer == 0 && e.info().component == k3::ParamComponent::KdaAttention) kda_layer0 += e.params;
    if (e.layer == 1 && e.expert == 0) expert += e.params;
    experts += e.info().store == k3::TensorStore::ExpertMatrix;
    if (e.kind == TensorKind::KdaALog) {
      EXPECT_EQ(e.shape, std::vector<int64_t>{96});
      a_log += e.params;
    }
  }
  EXPECT_EQ(total, 2779484478208);
  EXPECT_EQ(kda_layer0, 443740416);
  EXPECT_EQ(expert, 33030144);
  EXPECT_EQ(a_log, 69 * 128);
  // The vision table: patch embed + pos emb, 27 blocks of 6, final norm, the projector's three; its parameters are
  // those param_count.h counts from the config by its own formula (401.2M + 46.1M).
  const std::vector<k3::VisionTensorEntry> vt = k3::vision_tensor_table(k3::load_vision_config(kKimiK3));
  const int64_t vision = int64_t(vt.size());
  EXPECT_EQ(vision, 2 + 27 * 6 + 1 + 3);
  EXPECT_EQ(int64_t(t.entries().size()) + experts + vision, 497220);
  int64_t vision_params = 0;
  for (const k3::VisionTensorEntry& e : vt) vision_params += e.numel();
  EXPECT_EQ(vision_params, k3::total_params(k3::count_vision_parameters(kKimiK3)));
}

// The vision table against the tiny tower Moonshot's code wrote (tests/fixtures/vision-tiny): the same names and
// shapes, no more and no fewer.
TEST(TensorTable, VisionTableIsTheReferenceCheckpoints) {
  const k3::VisionConfig c = k3::load_vision_config(fixture("vision-tiny"));
  const k3::SafeTensors st = k3::SafeTensors::open(fixture("vision-tiny/model.safetensors"));
  std::set<std::string> listed;
  for (const k3::VisionTensorEntry& e : k3::vision_tensor_table(c)) {
    EXPECT_TRUE(listed.insert(e.name).second) << e.name;
    ASSERT_TRUE(st.has(e.name)) << e.name;
    EXPECT_EQ(st.get(e.name).shape, e.shape) << e.name;
  }
  const std::vector<std::string> names = st.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), listed);
}

// Per-Head Muon (K3-ARCHITECTURE.md §10): KDA q/k/v in kda_num_heads blocks of kda_head_dim rows; MLA
// q_b (or q_proj) in num_attention_heads blocks of qk_nope + qk_rope rows and kv_b in blocks of
// qk_nope + v; nothing else is split.
TEST(TensorTable, HeadSplits) {
  const k3::K3Config c = tiny_config();
  const TensorTable t(c);
  std::map<std::string, k3::HeadBlocks> want;
  for (int l : {0, 1, 2, 4, 5})
    for (const char* p : {"q_proj", "k_proj", "v_proj"})
      want["language_model.model.layers." + std::to_string(l) + ".self_attn." + p + ".weight"] = {4, 32};
  for (int l : {3, 6, 7}) {
    want["language_model.model.layers." + std::to_string(l) + ".self_attn.q_b_proj.weight"] = {4, 32 + 16};
    want["language_model.model.layers." + std::to_string(l) + ".self_attn.kv_b_proj.weight"] = {4, 32 + 32};
  }
  std::map<std::string, k3::HeadBlocks> got;
  for (const k3::TensorEntry& e : t.entries()) {
    const k3::HeadBlocks b = k3::head_blocks(c, e.kind);
    if (b.heads == 0) continue;
    got[t.name(e)] = b;
    EXPECT_EQ(b.heads * b.rows, e.shape[0]) << t.name(e);
  }
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, b] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got[name].heads, b.heads) << name;
    EXPECT_EQ(got[name].rows, b.rows) << name;
  }
  // Without q_lora, MLA's q_proj takes q_b's split.
  k3::K3Config noq = c;
  noq.q_lora_rank = 0;
  EXPECT_EQ(k3::head_blocks(noq, TensorKind::MlaQ).heads, 4);
  EXPECT_EQ(k3::head_blocks(noq, TensorKind::MlaQ).rows, 48);
}

// Every name parses back to its entry, in both namings; with the config, the leaves KDA and MLA share
// (q_proj, g_proj, o_proj) resolve to the layer's kind, without it to the KDA kind.
TEST(TensorTable, NamesParseBack) {
  const k3::K3Config c = tiny_config();
  const TensorTable t(c);
  for (TensorNaming n : {TensorNaming::Release, TensorNaming::Flat})
    for (const k3::TensorEntry& e : t.entries()) {
      const std::string name = t.name(e, n);
      const auto id = k3::parse_tensor_name(name, &c);
      ASSERT_TRUE(id) << name;
      EXPECT_EQ(id->kind, e.kind) << name;
      EXPECT_EQ(id->layer, e.layer) << name;
      EXPECT_EQ(id->expert, e.expert) << name;
      EXPECT_EQ(id->naming, n) << name;
      EXPECT_EQ(k3::tensor_place(name).layer, e.layer) << name;
      EXPECT_TRUE(k3::tensor_place(name).text) << name;
    }
  const auto o = k3::parse_tensor_name("language_model.model.layers.3.self_attn.o_proj.weight");
  ASSERT_TRUE(o);
  EXPECT_EQ(o->kind, TensorKind::KdaO);
  EXPECT_EQ(k3::parse_tensor_name("language_model.model.layers.3.self_attn.o_proj.weight", &c)->kind, TensorKind::MlaO);
  for (const char* bad : {"vision_tower.encoder.final_layernorm.weight", "model.layers.x.input_layernorm.weight",
                          "model.layers.1.self_attn.q_proj", "model.norm.weight_scale", "lm_head.weight.weight"})
    EXPECT_FALSE(k3::parse_tensor_name(bad)) << bad;
  EXPECT_FALSE(k3::tensor_place("vision_tower.encoder.final_layernorm.weight").text);
}

// Training's in-memory init is k3 init's file read back: same names, shapes and values, bit for bit
// (BF16 tensors rounded as the file stores them).
TEST(TensorTable, InMemoryInitIsTheWrittenModel) {
  const k3test::TempDir dir("table-init");
  k3::RandomInitOptions o;
  o.seed = 7;
  o.random_attnres_queries = true;
  o.router_bias_std = 0.1f;
  k3::write_random_model(fixture("k3-tiny-a/config.json"), dir.path().string(), o);
  const k3::train::ParamStore disk = k3::train::ParamStore::from_model_dir(dir.path().string());
  const k3::train::ParamStore mem = k3::train::ParamStore::random_init(tiny_config(), o);
  ASSERT_EQ(mem.names(), disk.names());
  for (const std::string& n : mem.names()) ASSERT_EQ(mem.shape(n), disk.shape(n)) << n;
  ASSERT_EQ(mem.values().size(), disk.values().size());
  for (size_t i = 0; i < mem.values().size(); ++i) ASSERT_EQ(mem.values()[i], disk.values()[i]) << i;
  // And the rules: norm gains 1, A in [1, 16], conv taps within 1/sqrt(K) = 0.5.
  const std::string p = "language_model.model.layers.0.";
  EXPECT_EQ(mem.p(p + "input_layernorm.weight")[5], 1.0);
  for (int h = 0; h < 4; ++h) {
    EXPECT_GE(mem.p(p + "self_attn.A_log")[h], 0.0);
    EXPECT_LE(mem.p(p + "self_attn.A_log")[h], std::log(16.0) + 1e-6);
  }
  for (int64_t i = 0; i < mem.numel(p + "self_attn.q_conv1d.weight"); ++i)
    EXPECT_LE(std::abs(mem.p(p + "self_attn.q_conv1d.weight")[i]), 0.5);
  o.mxfp4_experts = true;
  EXPECT_THROW(k3::train::ParamStore::random_init(tiny_config(), o), k3::Error);
}

// parallel_streams: the same tensors and rules, independent of the thread count (each block of each
// tensor has its own stream), and not the single stream's values.
TEST(TensorTable, ParallelStreamInitIsTheSameForAnyThreadCount) {
  k3::RandomInitOptions o;
  o.seed = 7;
  o.parallel_streams = true;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const k3::train::ParamStore one = k3::train::ParamStore::random_init(tiny_config(), o);
  omp_set_num_threads(std::max(2, threads));
  const k3::train::ParamStore many = k3::train::ParamStore::random_init(tiny_config(), o);
  omp_set_num_threads(threads);
  ASSERT_EQ(one.names(), many.names());
  EXPECT_TRUE(one.values() == many.values());
  o.parallel_streams = false;
  const k3::train::ParamStore single = k3::train::ParamStore::random_init(tiny_config(), o);
  EXPECT_FALSE(single.values() == one.values());
  // The rules hold: norm gains 1, A in [1, 16], matrices ~ N(0, initializer_range).
  const std::string p = "language_model.model.layers.0.";
  EXPECT_EQ(one.p(p + "input_layernorm.weight")[5], 1.0);
  for (int h = 0; h < 4; ++h) {
    EXPECT_GE(one.p(p + "self_attn.A_log")[h], 0.0);
    EXPECT_LE(one.p(p + "self_attn.A_log")[h], std::log(16.0) + 1e-6);
  }
  const std::string emb = "language_model.model.embed_tokens.weight";
  double m2 = 0;
  for (int64_t i = 0; i < one.numel(emb); ++i) m2 += one.p(emb)[i] * one.p(emb)[i];
  const double sd = std::sqrt(m2 / double(one.numel(emb))), want = tiny_config().initializer_range;
  EXPECT_NEAR(sd, want, 0.02 * want) << "embedding std";
}

}  // namespace
