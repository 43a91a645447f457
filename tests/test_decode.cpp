// Decoding and the configs the golden fixture does not cover. Every comparison is against an
// independent truth:
//   - the golden fixture (greedy continuation of ids_a computed by Moonshot's float64 reference);
//   - full recomputation (a fresh cache and the whole sequence) for cached / piecewise decoding;
//   - each sequence alone for batched forwards;
//   - the other numerical path (PathOptions::reference: KDA recurrence, expanded MLA) for the
//     chunked / absorbed paths;
//   - a re-implementation of the Block AttnRes skeleton (K3-ARCHITECTURE.md §5.2) in double, in
//     this file, fed with the per-layer block outputs the engine reports through its hooks;
//   - closed-form probabilities for the sampler.
// Random models for config variants are written by write_random_model into temporary directories.
//
// Tolerances. The engine accumulates every matrix product in fp64 and rounds once to fp32, so the
// paths compared here differ only in fp32 operations inside the kernels (KDA chunk vs. recurrence,
// MLA absorbed vs. expanded, summation order of the attention). Those are ~1e-7 relative per layer;
// 1e-5 on the logits leaves room for the layer-to-layer growth measured on the random models
// (<= 3.2e-6; worst values are printed). The fixture amplifies the same differences ~100x at some
// positions, so its default-path decoding gets a bound tied to the spread of its two full paths
// (see FixtureDecode). Checked by mutating the engine: not carrying the KDA v conv tail, a 0.1%
// scale error in the absorbed MLA, and AttnRes boundaries at (l+1) % B each fail these tests.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/generate.h"
#include "model/init_random.h"
#include "model/model.h"
#include "model/sampler.h"
#include "util/fixture.h"
#include "util/temp_dir.h"

using namespace k3;
using k3test::fixture;
using k3test::rel_l2;
using k3test::golden;
using k3test::golden_row;
using k3test::TempDir;
using k3test::tiny;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

// Logits of the last position after a full forward of `seq` from a fresh cache.
std::vector<float> full_last(Model& m, const std::vector<int32_t>& seq) {
  SequenceCache c = m.new_cache();
  return m.forward({&c}, {seq}, false);
}

// Logits of every position after a full forward of `seq` from a fresh cache.
std::vector<float> full_all(Model& m, const std::vector<int32_t>& seq) {
  SequenceCache c = m.new_cache();
  return m.forward({&c}, {seq}, true);
}

std::vector<float> rows(const std::vector<float>& x, int64_t r0, int64_t n, int64_t V) {
  return std::vector<float>(x.begin() + r0 * V, x.begin() + (r0 + n) * V);
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(int32_t(r() % uint64_t(V)));
  return t;
}

// Sets the numerical path for a scope.
struct PathScope {
  Model& m;
  PathOptions saved;
  PathScope(Model& model, bool reference) : m(model), saved(model.options()) { m.options().reference = reference; }
  ~PathScope() { m.options() = saved; }
};

// Prefill `prompt` into a cache, then `steps` times feed one token (the greedy choice of the cached
// logits) and compare every step's logits, the prefill's included (step 0), with a full forward of
// the whole sequence so far, on the model's current path. Returns the worst relative L2.
double cached_vs_full(Model& m, const std::vector<int32_t>& prompt, int steps, double tol, const std::string& label) {
  const int64_t V = m.config().vocab_size;
  SequenceCache cache = m.new_cache();
  std::vector<int32_t> seq = prompt;
  std::vector<float> got = m.forward({&cache}, {prompt}, false);
  double worst = 0.0;
  for (int step = 0;; ++step) {
    EXPECT_EQ(cache.length, int64_t(seq.size())) << label << ": step " << step;
    const double err = rel_l2(got, full_last(m, seq));
    worst = std::max(worst, err);
    EXPECT_LE(err, tol) << label << ": step " << step << " (" << seq.size() << " tokens in the sequence), rel L2 "
                        << err;
    if (step == steps) break;
    const int32_t next = argmax(got.data(), V);
    seq.push_back(next);
    got = m.forward({&cache}, {{next}}, false);
  }
  return worst;
}

// Feeds `seq` in pieces of the given sizes (the last piece takes the rest) and returns the logits of
// every position, concatenated.
std::vector<float> piecewise_all(Model& m, const std::vector<int32_t>& seq, const std::vector<int64_t>& pieces) {
  SequenceCache cache = m.new_cache();
  std::vector<float> out;
  size_t at = 0;
  for (size_t i = 0; i <= pieces.size() && at < seq.size(); ++i) {
    const size_t n = i < pieces.size() ? std::min(size_t(pieces[i]), seq.size() - at) : seq.size() - at;
    std::vector<int32_t> piece(seq.begin() + int64_t(at), seq.begin() + int64_t(at + n));
    std::vector<float> l = m.forward({&cache}, {piece}, true);
    out.insert(out.end(), l.begin(), l.end());
    at += n;
  }
  EXPECT_EQ(cache.length, int64_t(seq.size()));
  return out;
}

json fixture_config() {
  std::ifstream in(fixture("k3-tiny-a/config.json"));
  return json::parse(in);
}

// ---------------------------------------------------------------------------------------------
// 1-2. The fixture: greedy generation, cached decoding, piecewise prefill
// ---------------------------------------------------------------------------------------------

TEST(FixtureDecode, GreedyGenerateEqualsGoldenFullRecomputation) {
  Model& m = tiny();
  const std::vector<int32_t> prompt = golden_row("ids_a");
  const std::vector<int32_t> want = golden_row("greedy_full_ids_a");
  ASSERT_EQ(want.size(), 24u);
  Sampler greedy(SamplingParams{});
  std::vector<int32_t> streamed;
  GenerateResult r =
      generate(*k3test::engine_of(m), prompt, int64_t(want.size()), greedy, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_FALSE(r.stopped_on_eos);
  ASSERT_EQ(r.tokens.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(r.tokens[i], want[i]) << "generated token " << i;
  }
  EXPECT_EQ(streamed, r.tokens) << "on_token must see every generated id, in order";
  // The golden cached continuation is the same sequence (the README says so; check the fixture).
  EXPECT_EQ(golden_row("greedy_cached_ids_a"), want);
}

// Cached decoding on the fixture, on both numerical paths. On the reference path decoding and full
// recomputation run the same operations. On the default path the prompt goes through the chunked KDA
// and expanded MLA, the new tokens through the recurrence and absorbed MLA; both pairs compute in fp64
// and round once to fp32 (kernels/kda/kda_cpu.cpp, kernels/mla/mla.h), so they agree to fp32
// rounding. This fixture amplifies 1e-7 differences ~100x at some tokens (docs/NUMERICS.md): with
// fp32 internals the default path measured 4.6e-5 here, which is what this test exists to catch.
TEST(FixtureDecode, CachedEqualsFullRecomputation64StepsReferencePath) {
  Model& m = tiny();
  PathScope ref(m, true);
  const double worst = cached_vs_full(m, golden_row("ids_a"), 64, 1e-5, "k3-tiny-a ids_a, reference path");
  std::printf("fixture cached decode vs full recomputation, reference path, 64 steps: worst rel L2 %.3e\n", worst);
}

TEST(FixtureDecode, CachedEqualsFullRecomputation64StepsDefaultPath) {
  Model& m = tiny();
  PathScope def(m, false);
  const double worst = cached_vs_full(m, golden_row("ids_a"), 64, 1e-5, "k3-tiny-a ids_a, default path");
  std::printf("fixture cached decode vs full recomputation, default path, 64 steps: worst rel L2 %.3e\n", worst);
}

TEST(FixtureDecode, TeacherForcedDecodeMatchesGoldenLogits) {
  // ids_long: prefill 37 tokens, then 263 one-token steps; every position's logits against the
  // float64 reference's logits_ids_long.
  Model& m = tiny();
  PathScope def(m, false);
  const std::vector<int32_t> ids = golden_row("ids_long");
  const std::vector<float> want = golden().read_f32("logits_ids_long");
  SequenceCache cache = m.new_cache();
  std::vector<float> got = m.forward({&cache}, {std::vector<int32_t>(ids.begin(), ids.begin() + 37)}, true);
  for (size_t t = 37; t < ids.size(); ++t) {
    const std::vector<float> l = m.forward({&cache}, {{ids[t]}}, false);
    got.insert(got.end(), l.begin(), l.end());
  }
  const double err = rel_l2(got, want);
  const double err_full = rel_l2(full_all(m, ids), want);
  std::printf("fixture ids_long teacher-forced decode vs golden: rel L2 %.3e (full forward: %.3e)\n", err, err_full);
  EXPECT_LE(err, 1e-4);
}

TEST(FixtureDecode, UnevenPrefillEqualsOnePrefill) {
  // Pieces of < 16 tokens take the KDA recurrence and short continuations the absorbed MLA; one
  // prefill takes the chunked KDA and expanded MLA. Same bound as cached decoding, same reason.
  Model& m = tiny();
  const std::vector<int32_t> seq = golden_row("ids_a");  // 37 tokens
  const int64_t V = m.config().vocab_size;
  for (bool reference : {true, false}) {
    PathScope path(m, reference);
    const std::vector<float> one = full_all(m, seq);
    double worst = 0.0;
    for (const std::vector<int64_t>& pieces : {std::vector<int64_t>{5, 1, 13}, std::vector<int64_t>{1, 1, 1, 30},
                                               std::vector<int64_t>{16, 17}, std::vector<int64_t>{36}}) {
      std::string label = reference ? "reference path, pieces" : "default path, pieces";
      for (int64_t p : pieces) label.append(" ").append(std::to_string(p));
      label += " +rest";
      const std::vector<float> got = piecewise_all(m, seq, pieces);
      ASSERT_EQ(got.size(), one.size()) << label;
      for (int64_t t = 0; t < int64_t(seq.size()); ++t) {
        const double err = rel_l2(rows(got, t, 1, V), rows(one, t, 1, V));
        worst = std::max(worst, err);
        EXPECT_LE(err, 1e-5) << label << ": position " << t << " rel L2 " << err;
      }
    }
    std::printf("fixture uneven prefill vs one prefill, %s path: worst rel L2 per position %.3e\n",
                reference ? "reference" : "default", worst);
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Batched forward: sequences of different lengths in one call equal each alone
// ---------------------------------------------------------------------------------------------
// Per-token work (every projection, norm, router, expert GLU) computes each row on its own with
// fp64 accumulation and one rounding to fp32; per-sequence work (conv, KDA, MLA) runs segment by
// segment with the same path choice as alone (it depends on the segment's own length and cache).
// A batch can therefore only change which BLAS kernel / row grouping produces a row, i.e. the
// order of fp64 additions: ~1e-16 before the fp32 rounding, so rows are equal except for rare
// one-ulp rounding flips (6e-8 relative) that the next layers carry. 1e-6 bounds that with margin.
TEST(BatchedForward, DifferentLengthsEqualEachAlone) {
  Model& m = tiny();
  const int64_t V = m.config().vocab_size;
  std::vector<int32_t> a = golden_row("ids_a"), b = golden_row("ids_b", 1), c = golden_row("ids_b", 0);
  c.resize(5);
  const std::vector<std::vector<int32_t>> seqs = {a, b, c};  // 37, 80 and 5 tokens

  std::vector<SequenceCache> batch_caches, alone_caches;
  for (size_t i = 0; i < seqs.size(); ++i) {
    batch_caches.push_back(m.new_cache());
    alone_caches.push_back(m.new_cache());
  }
  std::vector<SequenceCache*> bp;
  for (auto& x : batch_caches) bp.push_back(&x);

  double worst = 0.0;
  // Call 1: fresh sequences, all positions.
  const std::vector<float> batched = m.forward(bp, seqs, true);
  int64_t r0 = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const int64_t n = int64_t(seqs[i].size());
    const std::vector<float> alone = m.forward({&alone_caches[i]}, {seqs[i]}, true);
    const double err = rel_l2(rows(batched, r0, n, V), alone);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-6) << "prefill batch, sequence " << i << " (" << n << " tokens): rel L2 " << err;
    EXPECT_EQ(batch_caches[i].length, n);
    r0 += n;
  }
  // Call 2: continuing caches of different lengths, 1, 7 and 2 new tokens (the first two take the
  // absorbed MLA path and the KDA recurrence), last positions only.
  const std::vector<std::vector<int32_t>> more = {{17}, {3, 99, 512, 7, 0, 1023, 64}, {800, 801}};
  const std::vector<float> batched2 = m.forward(bp, more, false);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::vector<float> alone = m.forward({&alone_caches[i]}, {more[i]}, false);
    const double err = rel_l2(rows(batched2, int64_t(i), 1, V), alone);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-6) << "continuation batch, sequence " << i << ": rel L2 " << err;
  }
  // Call 3: one token each (batched decoding).
  const std::vector<float> batched3 = m.forward(bp, {{5}, {6}, {7}}, false);
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::vector<float> alone = m.forward({&alone_caches[i]}, {{int32_t(5 + i)}}, false);
    const double err = rel_l2(rows(batched3, int64_t(i), 1, V), alone);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-6) << "decode batch, sequence " << i << ": rel L2 " << err;
  }
  std::printf("batched vs alone: worst rel L2 %.3e\n", worst);
}

// Input rows (ForwardHooks::input_rows, how an image's projected tokens go in) take the place of their tokens:
// rows that are the token table's own rows of other ids give, to the bit, the forward of those ids. The second
// sequence of a batch of two takes rows at its positions 2..4 and 6; the first takes none. A span past its
// sequence's tokens is an error naming it.
TEST(BatchedForward, InputRowsTakeThePlaceOfTheirTokens) {
  Model& m = tiny();
  const int64_t D = m.config().hidden_size;
  const std::vector<int32_t> a = {5, 6, 7, 8}, pads = {1, 2, 789, 789, 789, 3, 789, 4},
                             want = {1, 2, 40, 41, 42, 3, 43, 4};
  std::vector<float> table(size_t(4 * D));
  for (int i = 0; i < 4; ++i) m.weights().embed_tokens.rows_to_f32(table.data() + i * D, 40 + i, 1);
  ForwardHooks h;
  h.input_rows = {{}, {InputRows{2, 3, table.data()}, InputRows{6, 1, table.data() + 3 * D}}};
  SequenceCache c0 = m.new_cache(), c1 = m.new_cache(), d0 = m.new_cache(), d1 = m.new_cache();
  const std::vector<float> got = m.forward({&c0, &c1}, {a, pads}, true, &h);
  const std::vector<float> ref = m.forward({&d0, &d1}, {a, want}, true);
  ASSERT_EQ(got.size(), ref.size());
  EXPECT_EQ(0, std::memcmp(got.data(), ref.data(), got.size() * sizeof(float)));
  // Decoding on from there gives the same logits too (the rows went into the caches).
  EXPECT_EQ(m.forward({&c1}, {{9}}, false), m.forward({&d1}, {{9}}, false));
  h.input_rows = {{InputRows{2, 3, table.data()}}};
  SequenceCache e = m.new_cache();
  try {
    m.forward({&e}, {a}, false, &h);
    ADD_FAILURE() << "rows [2, 5) of a 4-token sequence were taken";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("input rows [2, 5) of sequence 0, which adds 4 tokens"), std::string::npos)
        << err.what();
  }
}

TEST(BatchedForward, BadTokenIdThrows) {
  Model& m = tiny();
  SequenceCache c = m.new_cache();
  EXPECT_THROW(m.forward({&c}, {{1, int32_t(m.config().vocab_size)}}, false), Error);
  EXPECT_THROW(m.forward({&c}, {{-1}}, false), Error);
  EXPECT_EQ(c.length, 0);
}

// ---------------------------------------------------------------------------------------------
// 4. Random models for config variants
// ---------------------------------------------------------------------------------------------

// A small K3 text config derived from the fixture's (nested form kept): hidden 64, vocab 320,
// 6 layers (1-based KDA 1,2,4,5; MLA 3,6), 8 experts top-2, 2 shared, latent 32.
// initializer_range 0.05 (not 0.02): with std 0.02 at these widths MLA scores are ~0.02, the
// softmax is nearly uniform and score bugs hide (a 0.1% error in the absorbed path's scale moved
// the logits by only 4e-6). At 0.05 the same bug moves them by 3e-5 .. 3e-4 and fails, while the
// legitimate path differences stay <= 3.2e-6.
json base_config() {
  json j = fixture_config();
  json& t = j["text_config"];
  t["vocab_size"] = 320;
  t["hidden_size"] = 64;
  t["intermediate_size"] = 128;
  t["num_hidden_layers"] = 6;
  t["num_attention_heads"] = 2;
  t["num_key_value_heads"] = 2;
  t["q_lora_rank"] = 32;
  t["kv_lora_rank"] = 32;
  t["qk_nope_head_dim"] = 16;
  t["qk_rope_head_dim"] = 8;
  t["v_head_dim"] = 16;
  t["num_experts"] = 8;
  t["num_experts_per_token"] = 2;
  t["num_shared_experts"] = 2;
  t["moe_intermediate_size"] = 32;
  t["routed_expert_hidden_size"] = 32;
  t["attn_res_block_size"] = 3;
  t["initializer_range"] = 0.05;
  for (json* o : {&j, &t}) {
    (*o)["bos_token_id"] = 300;
    (*o)["eos_token_id"] = 301;
    (*o)["pad_token_id"] = 319;
  }
  json& la = t["linear_attn_config"];
  la["num_heads"] = 2;
  la["head_dim"] = 32;
  la["kda_layers"] = {1, 2, 4, 5};
  la["full_attn_layers"] = {3, 6};
  return j;
}

struct Variant {
  const char* name;
  std::function<void(json& root, json& text)> edit;
  bool mxfp4 = false;
  bool random_queries = true;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"base", [](json&, json&) {}},
      {"kda_head_dim16_heads8",
       [](json&, json& t) {
         t["linear_attn_config"]["head_dim"] = 16;
         t["linear_attn_config"]["num_heads"] = 8;
       }},
      {"mla_q_proj_no_rope_v24",
       [](json&, json& t) {
         t["q_lora_rank"] = nullptr;  // q_proj directly
         t["qk_rope_head_dim"] = 0;
         t["v_head_dim"] = 24;  // != qk_nope_head_dim (16)
       }},
      {"mla_q_proj_rope8_v8",
       [](json&, json& t) {
         t["q_lora_rank"] = 0;
         t["v_head_dim"] = 8;
         t["num_attention_heads"] = 3;
         t["num_key_value_heads"] = 3;
       }},
      {"attnres_block1", [](json&, json& t) { t["attn_res_block_size"] = 1; }},
      {"attnres_block2", [](json&, json& t) { t["attn_res_block_size"] = 2; }},
      {"attnres_block_gt_layers", [](json&, json& t) { t["attn_res_block_size"] = 100; }},
      {"attnres_block2_zero_queries", [](json&, json& t) { t["attn_res_block_size"] = 2; }, false, false},
      {"shared_experts0", [](json&, json& t) { t["num_shared_experts"] = 0; }},
      {"shared_experts3", [](json&, json& t) { t["num_shared_experts"] = 3; }},
      {"routed_scaling2.5", [](json&, json& t) { t["routed_scaling_factor"] = 2.5; }},
      {"no_renormalize", [](json&, json& t) { t["moe_renormalize"] = false; }},
      {"groups4_topk_group2",
       [](json&, json& t) {
         t["num_experts"] = 16;
         t["num_experts_per_token"] = 4;
         t["num_expert_group"] = 4;
         t["topk_group"] = 2;
       }},
      {"experts_per_token1", [](json&, json& t) { t["num_experts_per_token"] = 1; }},
      {"first_k_dense2", [](json&, json& t) { t["first_k_dense_replace"] = 2; }},
      {"moe_layer_freq2", [](json&, json& t) { t["moe_layer_freq"] = 2; }},
      {"no_moe", [](json&, json& t) { t["num_experts"] = 0; }},
      {"silu", [](json&, json& t) { t["hidden_act"] = "silu"; }},
      {"mla_no_output_gate", [](json&, json& t) { t["mla_use_output_gate"] = false; }},
      {"mla_first_kda_last",
       [](json&, json& t) {
         t["linear_attn_config"]["kda_layers"] = {2, 3, 5, 6};
         t["linear_attn_config"]["full_attn_layers"] = {1, 4};
       }},
      {"all_kda",
       [](json&, json& t) {
         t["linear_attn_config"]["kda_layers"] = {1, 2, 3, 4, 5, 6};
         t["linear_attn_config"]["full_attn_layers"] = json::array();
       }},
      {"all_mla",
       [](json&, json& t) {
         t["linear_attn_config"]["kda_layers"] = json::array();
         t["linear_attn_config"]["full_attn_layers"] = {1, 2, 3, 4, 5, 6};
       }},
      {"conv_kernel2", [](json&, json& t) { t["linear_attn_config"]["short_conv_kernel_size"] = 2; }},
      {"mxfp4_experts",
       [](json&, json& t) {
         t["routed_expert_hidden_size"] = 64;
         t["moe_intermediate_size"] = 64;
       },
       true},
      {"tie_word_embeddings",
       [](json& r, json& t) {
         r["tie_word_embeddings"] = true;
         t["tie_word_embeddings"] = true;
       }},
  };
  return v;
}

struct BuiltModel {
  std::unique_ptr<TempDir> dir;
  std::unique_ptr<Model> model;  // declared after dir: destroyed (unmapped) before the dir is removed
};

// Writes the variant's config, a random checkpoint for it, and loads the directory (cached).
Model& variant_model(size_t i) {
  static std::map<size_t, BuiltModel> built;
  auto it = built.find(i);
  if (it != built.end()) return *it->second.model;
  const Variant& v = variants()[i];
  json j = base_config();
  v.edit(j, j["text_config"]);
  BuiltModel b;
  b.dir = std::make_unique<TempDir>(v.name);
  const std::string input = (b.dir->path() / "input-config.json").string();
  {
    std::ofstream out(input);
    out << j.dump(2);
  }
  RandomInitOptions o;
  o.seed = 1000 + i;
  o.mxfp4_experts = v.mxfp4;
  o.random_attnres_queries = v.random_queries;
  o.router_bias_std = 0.02f;
  write_random_model(input, b.dir->path().string(), o);
  b.model = Model::load(b.dir->path().string());
  Model& m = *b.model;
  built.emplace(i, std::move(b));
  return m;
}

class VariantTest : public ::testing::TestWithParam<size_t> {
 protected:
  const char* name() const { return variants()[GetParam()].name; }
  Model& model() { return variant_model(GetParam()); }
};

TEST_P(VariantTest, ConfigIsWhatTheVariantSays) {
  // Guards against a variant silently not applying (e.g. a field read from the wrong level).
  const K3Config& c = model().config();
  const std::string n = name();
  EXPECT_EQ(c.hidden_size, 64) << n;
  if (n == "kda_head_dim16_heads8") {
    EXPECT_TRUE(c.kda_head_dim == 16 && c.kda_num_heads == 8) << n;
  }
  if (n == "mla_q_proj_no_rope_v24") {
    EXPECT_TRUE(c.q_lora_rank == 0 && c.qk_rope_head_dim == 0 && c.v_head_dim == 24) << n;
    EXPECT_FALSE(model().weights().layers[2].mla.q_proj.empty()) << n;
  }
  if (n == "attnres_block_gt_layers") {
    EXPECT_GT(c.attn_res_block_size, c.num_hidden_layers) << n;
  }
  if (n == "shared_experts0") {
    EXPECT_TRUE(model().weights().layers[1].moe.shared.empty()) << n;
  }
  if (n == "shared_experts3") {
    EXPECT_EQ(model().weights().layers[1].moe.shared.gate_proj.rows, 3 * 32) << n;
  }
  if (n == "routed_scaling2.5") {
    EXPECT_EQ(c.routed_scaling_factor, 2.5f) << n;
  }
  if (n == "no_renormalize") {
    EXPECT_FALSE(c.moe_renormalize) << n;
  }
  if (n == "groups4_topk_group2") {
    EXPECT_TRUE(c.num_expert_group == 4 && c.topk_group == 2 && c.use_grouped_topk) << n;
  }
  if (n == "experts_per_token1") {
    EXPECT_EQ(c.num_experts_per_token, 1) << n;
  }
  if (n == "first_k_dense2") {
    EXPECT_TRUE(!c.is_moe_layer(1) && c.is_moe_layer(2)) << n;
  }
  if (n == "moe_layer_freq2") {
    EXPECT_TRUE(c.is_moe_layer(2) && !c.is_moe_layer(3) && c.is_moe_layer(4)) << n;
  }
  if (n == "no_moe")
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      EXPECT_FALSE(c.is_moe_layer(l)) << n;
    }
  if (n == "silu") {
    EXPECT_EQ(c.hidden_act, Activation::SiLU) << n;
  }
  if (n == "mla_no_output_gate") {
    EXPECT_TRUE(model().weights().layers[2].mla.g_proj.empty()) << n;
  }
  if (n == "mla_first_kda_last") {
    EXPECT_TRUE(c.layer_kind[0] == AttnKind::MLA && c.layer_kind[5] == AttnKind::KDA) << n;
  }
  if (n == "conv_kernel2") {
    EXPECT_EQ(c.short_conv_kernel_size, 2) << n;
  }
  if (n == "mxfp4_experts") {
    EXPECT_TRUE(c.experts_mxfp4) << n;
    EXPECT_EQ(model().weights().layers[1].moe.experts[0].w1.format, WeightRef::Format::MXFP4) << n;
  }
  if (n == "tie_word_embeddings") {
    EXPECT_TRUE(c.tie_word_embeddings) << n;
    EXPECT_EQ(model().weights().lm_head.data, model().weights().embed_tokens.data) << n;
  }
}

TEST_P(VariantTest, CachedDecodeEqualsFullRecomputation) {
  Model& m = model();
  const std::vector<int32_t> prompt = random_tokens(11, m.config().vocab_size, 7 + GetParam());
  const double worst = cached_vs_full(m, prompt, 20, 1e-5, name());
  std::printf("[%s] cached decode (11 + 20 steps) vs full: worst rel L2 %.3e\n", name(), worst);
}

TEST_P(VariantTest, ReferencePathEqualsDefaultPath) {
  Model& m = model();
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> seq = random_tokens(70, V, 99 + GetParam());
  const PathOptions saved = m.options();
  m.options().reference = false;
  const std::vector<float> fast = full_all(m, seq);                  // KDA chunked (64 + 6), MLA expanded
  const std::vector<float> pieces = piecewise_all(m, seq, {40, 8});  // + absorbed MLA / recurrence (8), chunked (22)
  m.options().reference = true;
  const std::vector<float> ref = full_all(m, seq);  // KDA recurrence, MLA expanded
  const std::vector<float> ref_pieces = piecewise_all(m, seq, {40, 8});
  m.options() = saved;
  double worst = 0.0;
  for (const auto& [what, got] : {std::pair<const char*, const std::vector<float>*>{"default one call", &fast},
                                  {"default in pieces 40/8/22", &pieces},
                                  {"reference in pieces 40/8/22", &ref_pieces}}) {
    ASSERT_EQ(got->size(), ref.size()) << name() << " " << what;
    for (int64_t t = 0; t < int64_t(seq.size()); ++t) {
      const double err = rel_l2(rows(*got, t, 1, V), rows(ref, t, 1, V));
      worst = std::max(worst, err);
      EXPECT_LE(err, 1e-5) << name() << ": " << what << " vs reference one call, position " << t << ": rel L2 " << err;
    }
  }
  std::printf("[%s] reference vs default path, 70 tokens: worst rel L2 per position %.3e\n", name(), worst);
}

TEST_P(VariantTest, LogitsFiniteAndNonTrivial) {
  Model& m = model();
  const int64_t V = m.config().vocab_size;
  const std::vector<int32_t> seq = random_tokens(70, V, 99 + GetParam());
  const std::vector<float> l = full_all(m, seq);
  ASSERT_EQ(l.size(), size_t(70 * V)) << name();
  double ss = 0.0;
  for (size_t i = 0; i < l.size(); ++i) {
    ASSERT_TRUE(std::isfinite(l[i])) << name() << ": logit " << i % size_t(V) << " at position " << i / size_t(V);
    ss += double(l[i]) * l[i];
  }
  // Random init (std 0.05, hidden 64) gives logits of rms ~0.4: all-zero logits would make every
  // relative comparison above pass vacuously.
  const double rms = std::sqrt(ss / double(l.size()));
  EXPECT_GT(rms, 1e-2) << name();
  // Different positions must not all produce the same distribution.
  EXPECT_GT(rel_l2(rows(l, 0, 1, V), rows(l, 69, 1, V)), 1e-3) << name();
}

std::string variant_name(const ::testing::TestParamInfo<size_t>& info) {
  std::string s = variants()[info.param].name;
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

INSTANTIATE_TEST_SUITE_P(Configs, VariantTest, ::testing::Range(size_t(0), variants().size()), variant_name);

// ---------------------------------------------------------------------------------------------
// 5. Block AttnRes skeleton, re-implemented here in double (K3-ARCHITECTURE.md §5.1-5.2)
// ---------------------------------------------------------------------------------------------
// The engine reports each layer's attention and FFN block outputs (attn_out, ffn_out) and the
// normalised block inputs (attn_in, ffn_in). Starting from the embedding rows read from the
// checkpoint file, this test runs the skeleton itself: snapshots at l % block_size == 0, the
// AttnRes softmax over [blocks..., partial] with the pseudo-queries res_norm ⊙ res_proj read from
// the file, the pre-norms, the final AttnRes + norm + lm_head. It checks every block input and the
// logits. The block outputs are the engine's own, so only the skeleton is under test, and a wrong
// boundary, a missing source, a query applied to the wrong sublayer or to normalised values, or
// a skipped first-layer guard changes these inputs by O(1).

using Mat = std::vector<double>;  // [N, D]

Mat attnres_ref(const std::vector<const Mat*>& src, const std::vector<double>& q, int64_t N, int64_t D, double eps) {
  Mat out(size_t(N * D), 0.0);
  const size_t S = src.size();
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> s(S);
    for (size_t i = 0; i < S; ++i) {
      double ss = 0.0, dot = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        const double v = (*src[i])[size_t(n * D + d)];
        ss += v * v;
        dot += v * q[size_t(d)];
      }
      s[i] = dot / std::sqrt(ss / double(D) + eps);
    }
    const double mx = *std::max_element(s.begin(), s.end());
    double z = 0.0;
    for (double& x : s) z += (x = std::exp(x - mx));
    for (size_t i = 0; i < S; ++i)
      for (int64_t d = 0; d < D; ++d) out[size_t(n * D + d)] += s[i] / z * (*src[i])[size_t(n * D + d)];
  }
  return out;
}

std::vector<float> rmsnorm_ref(const Mat& x, const std::vector<float>& w, int64_t N, int64_t D, double eps) {
  std::vector<float> y(size_t(N * D));
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0.0;
    for (int64_t d = 0; d < D; ++d) ss += x[size_t(n * D + d)] * x[size_t(n * D + d)];
    const double r = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t d = 0; d < D; ++d) y[size_t(n * D + d)] = float(x[size_t(n * D + d)] * r * w[size_t(d)]);
  }
  return y;
}

class AttnResSkeleton : public ::testing::TestWithParam<const char*> {};

TEST_P(AttnResSkeleton, BlockInputsAndLogitsMatchIndependentSkeleton) {
  const std::string vname = GetParam();
  size_t vi = 0;
  while (vi < variants().size() && vname != variants()[vi].name) ++vi;
  ASSERT_LT(vi, variants().size()) << vname;
  Model& m = variant_model(vi);
  const K3Config& c = m.config();
  const int64_t D = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers, B = c.attn_res_block_size;
  const double eps = c.rms_norm_eps;
  const std::vector<int32_t> seq = random_tokens(23, V, 5 + vi);
  const int64_t N = int64_t(seq.size());

  std::map<std::string, std::vector<float>> got;
  ForwardHooks hooks;
  hooks.tensor = [&](const char* name, int64_t l, const float* p, int64_t r, int64_t cols) {
    got[std::string(name) + "." + std::to_string(l)].assign(p, p + r * cols);
  };
  SequenceCache cache = m.new_cache();
  const std::vector<float> logits = m.forward({&cache}, {seq}, true, &hooks);

  // Everything below comes from the checkpoint file, not from the engine's bound weights.
  const SafeTensors st =
      SafeTensors::open(m.config().source.substr(0, m.config().source.rfind('/')) + "/model.safetensors");
  const std::string P = "language_model.model.";
  auto query = [&](const std::string& n) {
    std::vector<float> w = st.read_f32(n + "_norm.weight"), p = st.read_f32(n + "_proj.weight");
    std::vector<double> q(static_cast<size_t>(D));
    for (int64_t d = 0; d < D; ++d) q[size_t(d)] = double(w[size_t(d)]) * double(p[size_t(d)]);
    return q;
  };
  const std::vector<float> emb = st.read_f32(P + "embed_tokens.weight");
  const std::vector<float> head = c.tie_word_embeddings ? emb : st.read_f32("language_model.lm_head.weight");

  Mat prefix(size_t(N * D));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) prefix[size_t(n * D + d)] = emb[size_t(seq[size_t(n)] * D + d)];
  std::vector<Mat> blocks;
  blocks.reserve(size_t(L + 1));
  auto sources = [&](const Mat& partial) {
    std::vector<const Mat*> s;
    for (const Mat& b : blocks) s.push_back(&b);
    s.push_back(&partial);
    return s;
  };
  double worst = 0.0;
  auto check = [&](const std::string& key, const std::vector<float>& want) {
    ASSERT_TRUE(got.count(key)) << vname << ": no hook output " << key;
    const double err = rel_l2(got[key], want);
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-5) << vname << ": " << key << " rel L2 " << err;
  };
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = P + "layers." + std::to_string(l) + ".";
    const Mat h = blocks.empty() ? prefix : attnres_ref(sources(prefix), query(p + "self_attention_res"), N, D, eps);
    bool fresh = false;
    if (l % B == 0) {
      blocks.push_back(prefix);
      fresh = true;
    }
    check("attn_in." + std::to_string(l), rmsnorm_ref(h, st.read_f32(p + "input_layernorm.weight"), N, D, eps));
    const std::vector<float>& a = got["attn_out." + std::to_string(l)];
    ASSERT_EQ(a.size(), size_t(N * D)) << vname << " layer " << l;
    for (size_t i = 0; i < prefix.size(); ++i) prefix[i] = (fresh ? 0.0 : prefix[i]) + double(a[i]);
    const Mat h2 = attnres_ref(sources(prefix), query(p + "mlp_res"), N, D, eps);
    check("ffn_in." + std::to_string(l),
          rmsnorm_ref(h2, st.read_f32(p + "post_attention_layernorm.weight"), N, D, eps));
    const std::vector<float>& f = got["ffn_out." + std::to_string(l)];
    ASSERT_EQ(f.size(), size_t(N * D)) << vname << " layer " << l;
    for (size_t i = 0; i < prefix.size(); ++i) prefix[i] += double(f[i]);
  }
  // Number of sources at the output: the embedding + one snapshot per boundary after layer 0 + partial.
  EXPECT_EQ(int64_t(blocks.size()), (L - 1) / B + 1) << vname;
  const std::vector<float> hn = rmsnorm_ref(attnres_ref(sources(prefix), query(P + "output_attn_res"), N, D, eps),
                                            st.read_f32(P + "norm.weight"), N, D, eps);
  std::vector<float> want(size_t(N * V));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t v = 0; v < V; ++v) {
      double acc = 0.0;
      for (int64_t d = 0; d < D; ++d) acc += double(hn[size_t(n * D + d)]) * head[size_t(v * D + d)];
      want[size_t(n * V + v)] = float(acc);
    }
  const double err = rel_l2(logits, want);
  worst = std::max(worst, err);
  EXPECT_LE(err, 1e-5) << vname << ": logits rel L2 " << err;
  std::printf("[%s] AttnRes skeleton (block size %ld, %zu output sources): worst rel L2 %.3e\n", vname.c_str(), long(B),
              blocks.size() + 1, worst);
}

INSTANTIATE_TEST_SUITE_P(Configs, AttnResSkeleton,
                         ::testing::Values("base", "attnres_block1", "attnres_block2", "attnres_block_gt_layers",
                                           "attnres_block2_zero_queries", "tie_word_embeddings"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string s = i.param;
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return s;
                         });

// With zero pseudo-queries the softmax is uniform, so with one block (block size > layers) the
// input to every layer after the first is exactly (embedding + partial sum) / 2: a closed form,
// checked on a model whose queries are zero.
TEST(AttnResClosedForm, ZeroQueriesSingleBlockIsTheMean) {
  json j = base_config();
  j["text_config"]["attn_res_block_size"] = 100;
  TempDir dir("zero-queries-single-block");
  const std::string input = (dir.path() / "input-config.json").string();
  {
    std::ofstream out(input);
    out << j.dump(2);
  }
  RandomInitOptions o;
  o.seed = 4242;
  o.random_attnres_queries = false;
  o.router_bias_std = 0.02f;
  write_random_model(input, dir.path().string(), o);
  auto m = Model::load(dir.path().string());
  const K3Config& c = m->config();
  const int64_t D = c.hidden_size, L = c.num_hidden_layers;
  const std::vector<int32_t> seq = random_tokens(9, c.vocab_size, 3);
  const int64_t N = int64_t(seq.size());
  std::map<std::string, std::vector<float>> got;
  ForwardHooks hooks;
  hooks.tensor = [&](const char* name, int64_t l, const float* p, int64_t r, int64_t cols) {
    got[std::string(name) + "." + std::to_string(l)].assign(p, p + r * cols);
  };
  SequenceCache cache = m->new_cache();
  m->forward({&cache}, {seq}, true, &hooks);
  std::vector<float> emb(size_t(N * D));
  for (int64_t n = 0; n < N; ++n) m->weights().embed_tokens.rows_to_f32(&emb[size_t(n * D)], seq[size_t(n)], 1);
  const std::vector<float> ones(size_t(D), 1.0f);
  std::vector<double> partial(size_t(N * D), 0.0);
  double worst = 0.0;
  for (int64_t l = 0; l < L; ++l) {
    // Attention input: layer 0 sees the embedding; later layers (emb + partial) / 2.
    Mat h(size_t(N * D));
    for (size_t i = 0; i < h.size(); ++i) h[i] = l == 0 ? double(emb[i]) : 0.5 * (double(emb[i]) + partial[i]);
    double err = rel_l2(got["attn_in." + std::to_string(l)], rmsnorm_ref(h, ones, N, D, c.rms_norm_eps));
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-5) << "attn_in." << l << " rel L2 " << err;
    for (size_t i = 0; i < partial.size(); ++i) partial[i] += got["attn_out." + std::to_string(l)][i];
    for (size_t i = 0; i < h.size(); ++i) h[i] = 0.5 * (double(emb[i]) + partial[i]);
    err = rel_l2(got["ffn_in." + std::to_string(l)], rmsnorm_ref(h, ones, N, D, c.rms_norm_eps));
    worst = std::max(worst, err);
    EXPECT_LE(err, 1e-5) << "ffn_in." << l << " rel L2 " << err;
    for (size_t i = 0; i < partial.size(); ++i) partial[i] += got["ffn_out." + std::to_string(l)][i];
  }
  std::printf("AttnRes zero queries, one block: worst rel L2 vs (emb + partial)/2 %.3e\n", worst);
  m.reset();
}

// ---------------------------------------------------------------------------------------------
// 6. Sampler
// ---------------------------------------------------------------------------------------------

SamplingParams sampling(float temperature, int64_t top_k, float top_p, uint64_t seed) {
  SamplingParams p;
  p.greedy = false;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = seed;
  return p;
}

std::vector<float> random_logits(int64_t V, uint64_t seed) {
  std::mt19937_64 r(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> l(static_cast<size_t>(V));
  for (float& x : l) x = d(r);
  return l;
}

TEST(Sampler, GreedyIsArgmaxWithTiesToLowerId) {
  Sampler greedy(SamplingParams{});
  const std::vector<float> tie = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f, 1.9f};
  EXPECT_EQ(argmax(tie.data(), int64_t(tie.size())), 1);
  EXPECT_EQ(greedy.sample(tie.data(), int64_t(tie.size())), 1);
  const std::vector<float> first = {3.0f, 3.0f, 3.0f};
  EXPECT_EQ(greedy.sample(first.data(), 3), 0);
  const std::vector<float> last = {-INFINITY, -2.0f, 7.0f};
  EXPECT_EQ(greedy.sample(last.data(), 3), 2);
  for (uint64_t s = 0; s < 50; ++s) {
    const std::vector<float> l = random_logits(1000, s);
    int32_t best = 0;
    for (int32_t v = 1; v < 1000; ++v)
      if (l[size_t(v)] > l[size_t(best)]) best = v;
    EXPECT_EQ(greedy.sample(l.data(), 1000), best) << "logits seed " << s;
  }
  const std::vector<float> nan = {0.0f, NAN, 1.0f};
  EXPECT_THROW(greedy.sample(nan.data(), 3), Error);
}

TEST(Sampler, SeededSamplingIsReproducibleAndSeedsDiffer) {
  const std::vector<float> l = random_logits(64, 11);
  auto draws = [&](uint64_t seed, float temp, int64_t k, float p) {
    Sampler s(sampling(temp, k, p, seed));
    std::vector<int32_t> out;
    for (int i = 0; i < 200; ++i) out.push_back(s.sample(l.data(), 64));
    return out;
  };
  for (auto [temp, k, p] : {std::tuple<float, int64_t, float>{1.0f, 0, 1.0f}, {0.7f, 10, 1.0f}, {1.3f, 0, 0.9f}}) {
    const auto a = draws(1, temp, k, p), b = draws(1, temp, k, p), c = draws(2, temp, k, p);
    EXPECT_EQ(a, b) << "same seed, temperature " << temp << " top_k " << k << " top_p " << p;
    EXPECT_NE(a, c) << "seeds 1 and 2, temperature " << temp << " top_k " << k << " top_p " << p;
    const std::set<int32_t> distinct(a.begin(), a.end());
    EXPECT_GT(distinct.size(), 3u) << "temperature sampling should not be greedy";
  }
}

TEST(Sampler, TopK1AndTinyTopPAreGreedy) {
  for (uint64_t s = 0; s < 30; ++s) {
    const std::vector<float> l = random_logits(500, 100 + s);
    const int32_t best = argmax(l.data(), 500);
    Sampler k1(sampling(1.5f, 1, 1.0f, s)), p0(sampling(1.5f, 0, 1e-6f, s)), both(sampling(3.0f, 1, 1e-6f, s));
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(k1.sample(l.data(), 500), best) << "top_k 1, logits seed " << s;
      EXPECT_EQ(p0.sample(l.data(), 500), best) << "top_p 1e-6, logits seed " << s;
      EXPECT_EQ(both.sample(l.data(), 500), best) << "top_k 1 + top_p 1e-6, logits seed " << s;
    }
  }
}

// Empirical frequencies over 20000 draws against closed-form probabilities. The standard error of
// a frequency is sqrt(p(1-p)/20000) <= 0.0036, so 0.02 is > 5 sigma for each of the 4 ids.
void expect_frequencies(const std::vector<float>& logits, const SamplingParams& p, const std::vector<double>& want,
                        const std::string& label) {
  Sampler s(p);
  std::vector<int> count(logits.size(), 0);
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++count[size_t(s.sample(logits.data(), int64_t(logits.size())))];
  for (size_t v = 0; v < logits.size(); ++v) {
    const double f = double(count[v]) / n;
    EXPECT_NEAR(f, want[v], 0.02) << label << ": id " << v;
    if (want[v] == 0.0) {
      EXPECT_EQ(count[v], 0) << label << ": id " << v << " is outside the cut";
    }
  }
}

TEST(Sampler, FrequenciesMatchSoftmax) {
  const std::vector<float> l = {1.0f, 0.0f, -0.5f, 2.0f};
  auto softmax = [&](double temp, const std::vector<int>& keep) {
    std::vector<double> p(l.size(), 0.0);
    double z = 0.0;
    for (int v : keep) z += (p[size_t(v)] = std::exp(double(l[size_t(v)]) / temp));
    for (double& x : p) x /= z;
    return p;
  };
  // T = 1: p = (0.2320, 0.0854, 0.0518, 0.6308).
  expect_frequencies(l, sampling(1.0f, 0, 1.0f, 1), softmax(1.0, {0, 1, 2, 3}), "temperature 1");
  expect_frequencies(l, sampling(2.0f, 0, 1.0f, 2), softmax(2.0, {0, 1, 2, 3}), "temperature 2");
  expect_frequencies(l, sampling(0.5f, 0, 1.0f, 3), softmax(0.5, {0, 1, 2, 3}), "temperature 0.5");
  // top_k 2: ids 3 and 0, renormalised.
  expect_frequencies(l, sampling(1.0f, 2, 1.0f, 4), softmax(1.0, {3, 0}), "top_k 2");
  // top_p 0.8 at T = 1: sorted masses 0.631, 0.232 (cum 0.863 >= 0.8) -> ids 3 and 0.
  expect_frequencies(l, sampling(1.0f, 0, 0.8f, 5), softmax(1.0, {3, 0}), "top_p 0.8");
  // top_p 0.9: cumulative 0.631, 0.863, 0.948 -> ids 3, 0, 1.
  expect_frequencies(l, sampling(1.0f, 0, 0.9f, 6), softmax(1.0, {3, 0, 1}), "top_p 0.9");
}

// A nucleus wider than the first sorted prefix (1,024 ids): 3,000 nearly equal logits, top_p 0.5 keeps about
// half of them. Every draw lies inside the closed-form nucleus, and the draws' mean id is the truncated
// distribution's (standard error ~4 ids over 20,000 draws; the bar is 25).
TEST(Sampler, WideNucleusIsCutWhereItsMassReachesTopP) {
  const int64_t V = 3000;
  std::vector<float> l(static_cast<size_t>(V), 0.0f);
  for (int64_t v = 0; v < V; ++v) l[size_t(v)] = -1e-4f * float(v);
  double z = 0.0;
  for (float x : l) z += std::exp(double(x));
  double cum = 0.0, mean_num = 0.0, mean_den = 0.0;
  int64_t n = 0;
  while (n < V && cum < 0.5) {
    const double p = std::exp(double(l[size_t(n)])) / z;
    cum += p, mean_num += p * double(n), mean_den += p, ++n;
  }
  ASSERT_GT(n, 1024);
  Sampler s(sampling(1.0f, 0, 0.5f, 7));
  double sum = 0.0;
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) {
    const int32_t id = s.sample(l.data(), V);
    ASSERT_LT(id, n) << "outside the nucleus";
    sum += double(id);
  }
  EXPECT_NEAR(sum / draws, mean_num / mean_den, 25.0);
}

TEST(Sampler, BadParamsThrowNamingTheFlag) {
  struct Bad {
    SamplingParams p;
    const char* flag;
  };
  const std::vector<Bad> bad = {
      {sampling(0.0f, 0, 1.0f, 0), "temperature"}, {sampling(-1.0f, 0, 1.0f, 0), "temperature"},
      {sampling(NAN, 0, 1.0f, 0), "temperature"},  {sampling(INFINITY, 0, 1.0f, 0), "temperature"},
      {sampling(1.0f, 0, 0.0f, 0), "top-p"},       {sampling(1.0f, 0, 1.5f, 0), "top-p"},
      {sampling(1.0f, 0, NAN, 0), "top-p"},        {sampling(1.0f, -1, 1.0f, 0), "top-k"},
  };
  for (const Bad& b : bad) {
    const std::string label = std::string(b.flag) + " (temperature " + std::to_string(b.p.temperature) + ", top_k " +
                              std::to_string(b.p.top_k) + ", top_p " + std::to_string(b.p.top_p) + ")";
    try {
      Sampler s(b.p);
      ADD_FAILURE() << "no error for bad " << label;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(b.flag), std::string::npos) << label << ": message '" << e.what() << "'";
    }
  }
  EXPECT_NO_THROW(Sampler(sampling(1e-3f, 0, 1.0f, 0)));
  EXPECT_NO_THROW(Sampler(sampling(1.0f, 5, 1.0f, 0)));
  EXPECT_NO_THROW(Sampler(sampling(1.0f, 0, 1e-9f, 0)));
}

// ---------------------------------------------------------------------------------------------
// 7. Generation stops on the config's eos id
// ---------------------------------------------------------------------------------------------

// The engine picks (TokenPick: greedy or temperature alone, with the sampler's draw) whenever nothing needs the
// logits; forcing the host to sample (an observer) must give the very same ids for the same seed.
TEST(Generate, EnginePicksAreTheSamplersIds) {
  const std::vector<int32_t> prompt = golden_row("ids_a");
  auto m = Model::load(fixture("k3-tiny-a/config.json"), fixture("k3-tiny-a/model.safetensors"));
  auto engine = k3test::engine_of(*m);
  for (const SamplingParams& p : {SamplingParams{}, sampling(0.8f, 0, 1.0f, 5), sampling(1.7f, 0, 1.0f, 9)}) {
    Sampler by_engine(p), on_host(p);
    const GenerateResult a = generate(engine->pick_session(), m->config(), prompt, 24, by_engine);
    int observed = 0;
    const GenerateResult b = generate_until(
        engine->pick_session(), m->config(), prompt, 24, on_host, [](int32_t) { return true; },
        [&](const float*, int64_t, int32_t) { ++observed; });
    EXPECT_EQ(observed, int(b.tokens.size())) << "the observer forces sampling on the host";
    EXPECT_EQ(a.tokens, b.tokens) << "temperature " << p.temperature << (p.greedy ? " (greedy)" : "");
  }
}

TEST(Generate, StopsOnEosAndIncludesIt) {
  const std::vector<int32_t> prompt = golden_row("ids_a");
  Sampler greedy(SamplingParams{});
  const GenerateResult first = generate(k3test::tiny_engine(), prompt, 10, greedy);
  ASSERT_EQ(first.tokens.size(), 10u);
  ASSERT_FALSE(first.stopped_on_eos);
  // The eos id of the variant: the token greedy decoding produces at step 3. It stops at the first
  // step that produces it (step 3 unless the same id came earlier).
  const int32_t eos = first.tokens[3];
  const size_t stop = size_t(std::find(first.tokens.begin(), first.tokens.end(), eos) - first.tokens.begin());
  std::printf("eos variant: eos id %d, expected stop after generated token %zu\n", eos, stop);

  json j = fixture_config();
  j["eos_token_id"] = eos;
  j["text_config"]["eos_token_id"] = eos;
  TempDir dir("eos");
  const std::string cfg = (dir.path() / "config.json").string();
  {
    std::ofstream out(cfg);
    out << j.dump(2);
  }
  auto m = Model::load(cfg, fixture("k3-tiny-a/model.safetensors"));
  ASSERT_EQ(m->config().eos_token_id, eos);
  std::vector<int32_t> streamed;
  Sampler greedy2(SamplingParams{});
  const GenerateResult r =
      generate(*k3test::engine_of(*m), prompt, 10, greedy2, [&](int32_t t) { streamed.push_back(t); });
  EXPECT_TRUE(r.stopped_on_eos);
  const std::vector<int32_t> want(first.tokens.begin(), first.tokens.begin() + int64_t(stop) + 1);
  EXPECT_EQ(r.tokens, want) << "generation must stop right after the eos id, which is included";
  EXPECT_EQ(streamed, want);
  EXPECT_EQ(r.tokens.back(), eos);

  // max_new_tokens bounds the run before eos, and 0 generates nothing.
  Sampler greedy3(SamplingParams{});
  const GenerateResult shorter = generate(*k3test::engine_of(*m), prompt, int64_t(stop), greedy3);
  EXPECT_FALSE(shorter.stopped_on_eos);
  EXPECT_EQ(shorter.tokens, std::vector<int32_t>(first.tokens.begin(), first.tokens.begin() + int64_t(stop)));
  Sampler greedy4(SamplingParams{});
  EXPECT_TRUE(generate(*k3test::engine_of(*m), prompt, 0, greedy4).tokens.empty());
  m.reset();
}

}  // namespace
