// config.json parsing (model/config), parameter counting (model/param_count) and `k3 inspect`.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/param_count.h"

using json = nlohmann::json;
using ::testing::HasSubstr;

namespace {

const std::string kSrc = K3_SOURCE_DIR;
const std::string kFixture = kSrc + "/tests/fixtures/k3-tiny-a/config.json";
const std::string kFixtureMxfp4 = kSrc + "/tests/fixtures/k3-tiny-a/config-mxfp4.json";
const std::string kFixtureModel = kSrc + "/tests/fixtures/k3-tiny-a/model.safetensors";
const std::string kKimiK3 = kSrc + "/configs/kimi-k3.json";

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json fixture_json() { return json::parse(read_file(kFixture)); }

// Parses `j` and returns the k3::Error message; fails the test if it parses.
std::string parse_error(const json& j) {
  try {
    k3::parse_config(j.dump(), "bad-config.json");
  } catch (const k3::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "config parsed but should not have: " << j.dump();
  return "";
}

void expect_same(const k3::K3Config& a, const k3::K3Config& b) {
#define SAME(f) EXPECT_EQ(a.f, b.f) << #f
  SAME(vocab_size);
  SAME(hidden_size);
  SAME(intermediate_size);
  SAME(num_hidden_layers);
  SAME(num_attention_heads);
  SAME(num_key_value_heads);
  SAME(hidden_act);
  SAME(hidden_act_name);
  SAME(situ_beta);
  SAME(situ_linear_beta);
  SAME(rms_norm_eps);
  SAME(q_lora_rank);
  SAME(kv_lora_rank);
  SAME(qk_nope_head_dim);
  SAME(qk_rope_head_dim);
  SAME(v_head_dim);
  SAME(mla_use_output_gate);
  SAME(mla_norm_eps);
  SAME(num_experts);
  SAME(num_experts_per_token);
  SAME(num_shared_experts);
  SAME(moe_intermediate_size);
  SAME(routed_expert_hidden_size);
  SAME(latent_moe_use_norm);
  SAME(moe_renormalize);
  SAME(routed_scaling_factor);
  SAME(use_grouped_topk);
  SAME(num_expert_group);
  SAME(topk_group);
  SAME(topk_method);
  SAME(first_k_dense_replace);
  SAME(moe_layer_freq);
  SAME(attn_res_block_size);
  SAME(max_position_embeddings);
  SAME(num_nextn_predict_layers);
  SAME(tie_word_embeddings);
  SAME(bos_token_id);
  SAME(eos_token_id);
  SAME(pad_token_id);
  SAME(initializer_range);
  SAME(kda_num_heads);
  SAME(kda_head_dim);
  SAME(short_conv_kernel_size);
  SAME(gate_lower_bound);
  SAME(layer_kind);
  SAME(has_vision_config);
  SAME(experts_mxfp4);
#undef SAME
}

std::vector<int64_t> mla_layers(const k3::K3Config& c) {
  std::vector<int64_t> v;
  for (size_t l = 0; l < c.layer_kind.size(); ++l)
    if (c.layer_kind[l] == k3::AttnKind::MLA) v.push_back(int64_t(l));
  return v;
}

const k3::ParamGroup& group(const std::vector<k3::ParamGroup>& g, const std::string& name) {
  for (auto& x : g)
    if (x.name == name) return x;
  static k3::ParamGroup none;
  ADD_FAILURE() << "no parameter group '" << name << "'";
  return none;
}

struct RunResult {
  int status;
  std::string output;
};

RunResult run_k3(const std::string& args) {
  const std::string cmd = std::string("'") + K3_BINARY + "' " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

}  // namespace

// (a) nested and flat forms.
TEST(Config, FixtureParsesNested) {
  const k3::K3Config c = k3::load_config(kFixture);
  EXPECT_EQ(c.source, kFixture);
  EXPECT_EQ(c.vocab_size, 1024);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.num_hidden_layers, 8);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.q_lora_rank, 64);
  EXPECT_EQ(c.kv_lora_rank, 32);
  EXPECT_EQ(c.qk_nope_head_dim, 32);
  EXPECT_EQ(c.qk_rope_head_dim, 16);
  EXPECT_EQ(c.v_head_dim, 32);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_experts_per_token, 4);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_EQ(c.moe_intermediate_size, 64);
  EXPECT_EQ(c.routed_expert_hidden_size, 64);
  EXPECT_EQ(c.attn_res_block_size, 3);
  EXPECT_EQ(c.kda_num_heads, 4);
  EXPECT_EQ(c.kda_head_dim, 32);
  EXPECT_EQ(c.hidden_act, k3::Activation::SiTU);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 1.0f);
  EXPECT_FLOAT_EQ(c.gate_lower_bound, -5.0f);
  EXPECT_EQ(c.bos_token_id, 768);
  EXPECT_EQ(c.eos_token_id, 770);
  EXPECT_EQ(c.pad_token_id, 1023);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_FALSE(c.has_vision_config);
  EXPECT_FALSE(c.experts_mxfp4);
  EXPECT_FALSE(c.is_moe_layer(0));
  for (int l = 1; l < 8; ++l) EXPECT_TRUE(c.is_moe_layer(l)) << l;
}

TEST(Config, FlatFormGivesIdenticalConfig) {
  const json nested = fixture_json();
  json flat = nested["text_config"];
  flat["architectures"] = json::array({"KimiLinearForCausalLM"});
  const k3::K3Config a = k3::parse_config(nested.dump(), "nested.json");
  const k3::K3Config b = k3::parse_config(flat.dump(), "flat.json");
  expect_same(a, b);
}

// (b) layer kinds.
TEST(Config, FixtureLayerKinds) {
  const k3::K3Config c = k3::load_config(kFixture);
  ASSERT_EQ(c.layer_kind.size(), 8u);
  for (int l : {0, 1, 2, 4, 5}) EXPECT_EQ(c.layer_kind[size_t(l)], k3::AttnKind::KDA) << l;
  for (int l : {3, 6, 7}) EXPECT_EQ(c.layer_kind[size_t(l)], k3::AttnKind::MLA) << l;
}

TEST(Config, KimiK3LayerKinds) {
  const k3::K3Config c = k3::load_config(kKimiK3);
  ASSERT_EQ(c.num_hidden_layers, 93);
  std::vector<int64_t> expect;
  for (int64_t l = 3; l <= 91; l += 4) expect.push_back(l);
  expect.push_back(92);
  EXPECT_EQ(expect.size(), 24u);
  EXPECT_EQ(mla_layers(c), expect);
}

TEST(Config, KimiK3ReleasedValues) {
  const k3::K3Config c = k3::load_config(kKimiK3);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.intermediate_size, 33792);
  EXPECT_EQ(c.num_attention_heads, 96);
  EXPECT_EQ(c.num_key_value_heads, 96);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.num_experts, 896);
  EXPECT_EQ(c.num_experts_per_token, 16);
  EXPECT_EQ(c.num_shared_experts, 2);
  EXPECT_EQ(c.moe_intermediate_size, 3072);
  EXPECT_EQ(c.routed_expert_hidden_size, 3584);
  EXPECT_EQ(c.attn_res_block_size, 12);
  EXPECT_EQ(c.max_position_embeddings, 1048576);
  EXPECT_EQ(c.kda_num_heads, 96);
  EXPECT_EQ(c.kda_head_dim, 128);
  EXPECT_EQ(c.short_conv_kernel_size, 4);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 1.0f);
  EXPECT_FLOAT_EQ(c.situ_beta, 4.0f);
  EXPECT_FLOAT_EQ(c.situ_linear_beta, 25.0f);
  EXPECT_EQ(c.bos_token_id, 163584);
  EXPECT_EQ(c.eos_token_id, 163586);
  EXPECT_EQ(c.pad_token_id, 163839);
  EXPECT_FALSE(c.tie_word_embeddings);
}

// The derived configs keep K3's proportions: KDA:MLA 3:1 with the last two layers MLA, layer 0
// dense, the rest LatentMoE with latent = hidden/2, sigmoid router, SiTU, scaling 1.0, a few
// AttnRes blocks.
TEST(Config, DerivedConfigsKeepK3Proportions) {
  for (const char* name : {"k3-tiny", "k3-small", "k3-1b"}) {
    SCOPED_TRACE(name);
    const k3::K3Config c = k3::load_config(kSrc + "/configs/" + name + ".json");
    const int64_t L = c.num_hidden_layers;
    ASSERT_EQ((L - 1) % 4, 0);
    std::vector<int64_t> expect;
    for (int64_t l = 3; l < L - 1; l += 4) expect.push_back(l);
    expect.push_back(L - 1);
    EXPECT_EQ(mla_layers(c), expect);
    EXPECT_EQ(c.layer_kind[size_t(L - 2)], k3::AttnKind::MLA);
    EXPECT_FALSE(c.is_moe_layer(0));
    for (int64_t l = 1; l < L; ++l) EXPECT_TRUE(c.is_moe_layer(l));
    EXPECT_EQ(c.routed_expert_hidden_size * 2, c.hidden_size);
    EXPECT_EQ(c.hidden_act, k3::Activation::SiTU);
    EXPECT_FLOAT_EQ(c.routed_scaling_factor, 1.0f);
    const int64_t blocks = (L + c.attn_res_block_size - 1) / c.attn_res_block_size;
    EXPECT_GE(blocks, 3);
    EXPECT_LE(blocks, 8);
    EXPECT_FALSE(c.has_vision_config);
    EXPECT_FALSE(c.experts_mxfp4);
    EXPECT_LT(c.bos_token_id, c.vocab_size);
    EXPECT_LT(c.pad_token_id, c.vocab_size);
    if (std::string(name) != "k3-tiny") {
      EXPECT_EQ(c.vocab_size, 163840);
    }
  }
}

// (c) vision_config and MXFP4.
TEST(Config, VisionConfigLoads) {
  EXPECT_TRUE(k3::load_config(kKimiK3).has_vision_config);
  EXPECT_TRUE(k3::load_config(kKimiK3).experts_mxfp4);
  json j = fixture_json();
  j["vision_config"] = json::parse(read_file(kKimiK3))["vision_config"];
  const k3::K3Config c = k3::parse_config(j.dump(), "with-vision.json");
  EXPECT_TRUE(c.has_vision_config);
  expect_same(c, [&] {
    k3::K3Config d = k3::load_config(kFixture);
    d.has_vision_config = true;
    return d;
  }());
}

TEST(Config, Mxfp4FixtureSetsExpertsMxfp4) {
  EXPECT_TRUE(k3::load_config(kFixtureMxfp4).experts_mxfp4);
  EXPECT_FALSE(k3::load_config(kFixture).experts_mxfp4);
}

// (d) errors name the file and the field.
TEST(ConfigErrors, NotJson) {
  try {
    k3::parse_config("this is { not json", "notjson.json");
    FAIL() << "parsed";
  } catch (const k3::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("notjson.json"));
    EXPECT_THAT(std::string(e.what()), HasSubstr("not valid JSON"));
  }
}

TEST(ConfigErrors, ZeroBasedLayerLists) {
  json j = fixture_json();
  j["text_config"]["linear_attn_config"]["kda_layers"] = {0, 1, 2, 4, 5};
  j["text_config"]["linear_attn_config"]["full_attn_layers"] = {3, 6, 7};
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("bad-config.json"));
  EXPECT_THAT(m, HasSubstr("text_config.linear_attn_config.kda_layers"));
  EXPECT_THAT(m, HasSubstr("entry 0"));
  EXPECT_THAT(m, HasSubstr("1-based"));
}

TEST(ConfigErrors, LayerListedTwice) {
  json j = fixture_json();
  j["text_config"]["linear_attn_config"]["full_attn_layers"] = {4, 5, 7, 8};
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("linear_attn_config.full_attn_layers"));
  EXPECT_THAT(m, HasSubstr("layer 5"));
  EXPECT_THAT(m, HasSubstr("more than once"));
}

TEST(ConfigErrors, LayerMissingFromBothLists) {
  json j = fixture_json();
  j["text_config"]["linear_attn_config"]["kda_layers"] = {1, 2, 3, 5};
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("kda_layers"));
  EXPECT_THAT(m, HasSubstr("layer 6"));
  EXPECT_THAT(m, HasSubstr("neither"));
}

TEST(ConfigErrors, UnsupportedHiddenAct) {
  json j = fixture_json();
  j["text_config"]["hidden_act"] = "gelu";
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("text_config.hidden_act"));
  EXPECT_THAT(m, HasSubstr("gelu"));
}

TEST(ConfigErrors, UnsupportedRouterFunction) {
  json j = fixture_json();
  j["text_config"]["moe_router_activation_func"] = "softmax";
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("text_config.moe_router_activation_func"));
  EXPECT_THAT(m, HasSubstr("softmax"));
}

TEST(ConfigErrors, KvHeadsDifferFromHeads) {
  json j = fixture_json();
  j["text_config"]["num_key_value_heads"] = 2;
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("text_config.num_key_value_heads"));
  EXPECT_THAT(m, HasSubstr("num_attention_heads"));
}

TEST(ConfigErrors, MissingHiddenSize) {
  json j = fixture_json();
  j["text_config"].erase("hidden_size");
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("text_config.hidden_size"));
  EXPECT_THAT(m, HasSubstr("missing"));
  // Flat form: the field has no prefix.
  json flat = fixture_json()["text_config"];
  flat.erase("hidden_size");
  EXPECT_THAT(parse_error(flat), HasSubstr("field 'hidden_size' is missing"));
}

TEST(ConfigErrors, NegativeHeadDims) {
  {
    json j = fixture_json();
    j["text_config"]["linear_attn_config"]["head_dim"] = -32;
    const std::string m = parse_error(j);
    EXPECT_THAT(m, HasSubstr("text_config.linear_attn_config.head_dim"));
    EXPECT_THAT(m, HasSubstr("-32"));
  }
  {
    json j = fixture_json();
    j["text_config"]["qk_nope_head_dim"] = -1;
    EXPECT_THAT(parse_error(j), HasSubstr("text_config.qk_nope_head_dim"));
  }
  {
    json j = fixture_json();
    j["text_config"]["qk_rope_head_dim"] = -16;
    EXPECT_THAT(parse_error(j), HasSubstr("text_config.qk_rope_head_dim"));
  }
  {
    json j = fixture_json();
    j["text_config"]["v_head_dim"] = -32;
    EXPECT_THAT(parse_error(j), HasSubstr("text_config.v_head_dim"));
  }
}

TEST(ConfigErrors, UnsupportedQuantisation) {
  json j = json::parse(read_file(kFixtureMxfp4));
  j["text_config"]["quantization_config"]["format"] = "nvfp4-pack-quantized";
  const std::string m = parse_error(j);
  EXPECT_THAT(m, HasSubstr("text_config.quantization_config.format"));
  EXPECT_THAT(m, HasSubstr("nvfp4-pack-quantized"));
  json k = json::parse(read_file(kFixtureMxfp4));
  k["text_config"]["quantization_config"]["quant_method"] = "gptq";
  EXPECT_THAT(parse_error(k), HasSubstr("gptq"));
}

TEST(ConfigErrors, MissingFileNamesIt) {
  try {
    k3::load_config("/nonexistent/dir/config.json");
    FAIL() << "loaded";
  } catch (const k3::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("/nonexistent/dir/config.json"));
  }
}

// (e) parameter counts.
TEST(ParamCount, FormatCount) {
  EXPECT_EQ(k3::format_count(2779931837184), "2.780T");
  EXPECT_EQ(k3::format_count(2779484478208), "2.779T");
  EXPECT_EQ(k3::format_count(104189614848), "104.2B");
  EXPECT_EQ(k3::format_count(1234000), "1.234M");
  EXPECT_EQ(k3::format_count(1234567), "1.235M");
  EXPECT_EQ(k3::format_count(46144512), "46.14M");
  EXPECT_EQ(k3::format_count(401214464), "401.2M");
  EXPECT_EQ(k3::format_count(12000), "12.00K");
  EXPECT_EQ(k3::format_count(999), "999");
  EXPECT_EQ(k3::format_count(0), "0");
  EXPECT_EQ(k3::format_count(1000), "1.000K");
  EXPECT_EQ(k3::format_count(9999600), "10.00M");
  EXPECT_EQ(k3::format_count(999960000), "1.000B");
}

TEST(ParamCount, KimiK3MatchesRecount) {
  const k3::K3Config c = k3::load_config(kKimiK3);
  const auto g = k3::count_parameters(c);
  const int64_t total = k3::total_params(g), active = k3::active_params(g);
  // §1: text model 2.7795T, active 104.19B excluding the input embedding (4 significant digits).
  EXPECT_NEAR(double(total), 2.7795e12, 0.0005e12);
  EXPECT_NEAR(double(active), 104.19e9, 0.05e9);
  EXPECT_EQ(k3::format_count(active), "104.2B");
  // Exact, from the §4 shapes.
  EXPECT_EQ(total, 2779484478208);
  EXPECT_EQ(active, 104189614848);
  EXPECT_EQ(active + 163840LL * 7168, 105364019968);                        // 105.36B including the embedding (§1)
  EXPECT_EQ(group(g, "KDA attention").total, 69LL * 443740416);             // §4.3: 443,740,416 per layer
  EXPECT_EQ(group(g, "routed experts").total, 92LL * 896 * 33030144);       // §4.6: 33,030,144 per expert
  EXPECT_EQ(k3::format_count(group(g, "routed experts").total), "2.723T");  // §1: 2.7227T
  EXPECT_EQ(group(g, "routed experts").active, 92LL * 16 * 33030144);
  EXPECT_EQ(group(g, "embedding").active, 0);
  EXPECT_EQ(group(g, "lm_head").active, 163840LL * 7168);
  EXPECT_NEAR(double(total - group(g, "routed experts").total), 56.74e9, 0.005e9);  // §1: 56.74B
  // With the vision tower (401.2M) and projector (46.1M): the report's 2.78T.
  const auto v = k3::count_vision_parameters(kKimiK3);
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(group(v, "vision tower").total, 401214464);
  EXPECT_EQ(k3::format_count(group(v, "vision tower").total), "401.2M");
  EXPECT_EQ(group(v, "vision projector").total, 46144512);
  EXPECT_EQ(k3::active_params(v), 0);
  EXPECT_EQ(k3::format_count(total + k3::total_params(v)), "2.780T");
  EXPECT_TRUE(k3::count_vision_parameters(kFixture).empty());
}

TEST(ParamCount, VisionConfigErrorsNameTheField) {
  json j = json::parse(read_file(kKimiK3));
  j["vision_config"]["vt_hidden_size"] = -1;
  try {
    k3::count_vision_parameters_json(j.dump(), "v.json");
    FAIL() << "counted";
  } catch (const k3::Error& e) {
    EXPECT_THAT(std::string(e.what()), HasSubstr("vision_config.vt_hidden_size"));
  }
}

// Independent recount: numel of every tensor in the fixture checkpoint, grouped by name.
TEST(ParamCount, TinyFixtureMatchesCheckpoint) {
  const k3::K3Config c = k3::load_config(kFixture);
  const k3::SafeTensors st = k3::SafeTensors::open(kFixtureModel);
  std::map<std::string, int64_t> by_group;
  int64_t sum = 0, a_log = 0, n_kda = 0, expert0 = 0;
  const std::string P = "language_model.model.";
  for (const std::string& name : st.names()) {
    const int64_t n = st.get(name).numel();
    sum += n;
    std::string grp;
    auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
    if (name == P + "embed_tokens.weight") grp = "embedding";
    else if (name == "language_model.lm_head.weight") grp = "lm_head";
    else if (has(".self_attn.")) {
      const size_t at = name.find("layers.") + 7;
      const int64_t layer = std::stoll(name.substr(at, name.find('.', at) - at));
      grp = c.layer_kind.at(size_t(layer)) == k3::AttnKind::MLA ? "MLA attention" : "KDA attention";
      if (has(".A_log")) {
        a_log += n;
        ++n_kda;
        EXPECT_EQ(n, c.kda_num_heads) << name;  // the fixture stores num_heads entries
      }
    } else if (has(".mlp.")) grp = "dense FFN";
    else if (has(".block_sparse_moe.gate.")) grp = "router";
    else if (has(".routed_expert_")) grp = "latent down/up/norm";
    else if (has(".experts.")) {
      grp = "routed experts";
      if (has("layers.1.block_sparse_moe.experts.0.")) expert0 += n;
    } else if (has(".shared_experts.")) grp = "shared experts";
    else grp = "norms + AttnRes";
    by_group[grp] += n;
  }
  EXPECT_EQ(sum, 2881540);
  EXPECT_EQ(n_kda, 5);

  const auto g = k3::count_parameters(c);
  // The only difference: count_parameters counts A_log as the release stores it, padded to
  // head_dim (32) when head_dim > num_heads (4); the fixture stores num_heads entries.
  const int64_t a_log_padding = n_kda * (c.kda_head_dim - c.kda_num_heads);
  EXPECT_EQ(a_log_padding, 5 * 28);
  EXPECT_EQ(k3::total_params(g), sum + a_log_padding);

  std::set<std::string> names;
  for (const auto& x : g) {
    names.insert(x.name);
    const int64_t expect = by_group[x.name] + (x.name == "KDA attention" ? a_log_padding : 0);
    EXPECT_EQ(x.total, expect) << x.name;
  }
  for (const auto& [name, n] : by_group) EXPECT_TRUE(names.count(name)) << name;

  // Active: everything but the input embedding and the unselected experts.
  const int64_t n_moe = c.num_hidden_layers - 1;
  EXPECT_EQ(expert0, 3 * 64 * 64);
  EXPECT_EQ(k3::active_params(g),
            sum + a_log_padding - by_group["embedding"] - n_moe * (c.num_experts - c.num_experts_per_token) * expert0);
}

TEST(ParamCount, DerivedConfigSizes) {
  auto counts = [](const char* name) {
    const auto g = k3::count_parameters(k3::load_config(kSrc + "/configs/" + name + ".json"));
    return std::pair<int64_t, int64_t>(k3::total_params(g), k3::active_params(g));
  };
  const auto tiny = counts("k3-tiny"), small = counts("k3-small"), b1 = counts("k3-1b");
  EXPECT_GT(tiny.first, 1'000'000);
  EXPECT_LT(tiny.first, 10'000'000);
  EXPECT_GT(small.first, 80'000'000);
  EXPECT_LT(small.first, 130'000'000);
  EXPECT_GT(b1.first, 900'000'000);
  EXPECT_LT(b1.first, 1'100'000'000);
  EXPECT_GT(b1.second, 130'000'000);
  EXPECT_LT(b1.second, 170'000'000);
}

TEST(ParamCount, TiedEmbeddingsCountOnce) {
  json j = fixture_json();
  j["text_config"]["tie_word_embeddings"] = true;
  const auto tied = k3::count_parameters(k3::parse_config(j.dump(), "tied.json"));
  const auto untied = k3::count_parameters(k3::load_config(kFixture));
  EXPECT_EQ(k3::total_params(untied) - k3::total_params(tied), 1024 * 128);
  EXPECT_EQ(k3::active_params(untied), k3::active_params(tied));
  EXPECT_EQ(group(tied, "embedding").active, 1024 * 128);
}

TEST(ParamCount, NoQLoraUsesQProj) {
  json j = fixture_json();
  j["text_config"]["q_lora_rank"] = nullptr;
  const auto g0 = k3::count_parameters(k3::parse_config(j.dump(), "noq.json"));
  const auto g1 = k3::count_parameters(k3::load_config(kFixture));
  // 3 MLA layers: q_proj [4*48, 128] replaces q_a [64,128] + q_a_layernorm [64] + q_b [4*48, 64].
  EXPECT_EQ(group(g0, "MLA attention").total - group(g1, "MLA attention").total,
            3 * ((4 * 48 * 128) - (64 * 128 + 64 + 4 * 48 * 64)));
}

// (f) the CLI.
TEST(InspectCli, KimiK3) {
  const RunResult r = run_k3("inspect --config '" + kKimiK3 + "'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("2.780T"));
  EXPECT_THAT(r.output, HasSubstr("104.2B"));
  EXPECT_THAT(r.output, HasSubstr("total parameters: 2.780T"));
  EXPECT_THAT(r.output, HasSubstr("active parameters: 104.2B (excluding the input embedding)"));
  EXPECT_THAT(r.output, HasSubstr("69 KDA, 24 MLA"));
  EXPECT_THAT(r.output, HasSubstr("3,7,11,15,19,23,27,31,35,39,43,47,51,55,59,63,67,71,75,79,83,87,91,92"));
  EXPECT_THAT(r.output, HasSubstr("vision_config: present"));
  EXPECT_THAT(r.output, HasSubstr("MXFP4: yes"));
}

TEST(InspectCli, NotJsonFails) {
  const std::string path = ::testing::TempDir() + "k3_inspect_not_json.json";
  {
    std::ofstream out(path);
    out << "this is not json\n";
  }
  const RunResult r = run_k3("inspect --config '" + path + "'");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("error:"));
  EXPECT_THAT(r.output, HasSubstr(path));
  std::remove(path.c_str());
}

TEST(InspectCli, HelpSaysWhatItDoes) {
  const RunResult r = run_k3("inspect --help");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("config.json"));
  EXPECT_THAT(r.output, HasSubstr("--config"));
}
