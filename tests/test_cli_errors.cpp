// End-to-end tests of the `k3` binary on bad input: broken model directories (built in a unique
// temp dir from the tiny fixture), bad configs and bad flags. Every case must end in a clean
// k3::Error -- exit status 1, the last line of output starting with "error:" and naming the file
// and the tensor or field -- never a crash or a sanitizer report. Also the two success paths
// (`k3 logits` against an in-process forward, `k3 generate` against the golden greedy ids) and the
// atomic-write promise (no `.tmp.` file left beside --out).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "model/model.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

#include "util/cli.h"
#include "util/cli_error.h"
#include "util/st_file.h"

namespace {

using k3test::Outcome;
using k3test::run_k3;

const std::string kFixture = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-tiny-a";
const std::string kKvB = "language_model.model.layers.3.self_attn.kv_b_proj.weight";  // MLA layer, [256, 32]

using k3test::error_line;
using k3test::lines_of;
using k3test::read_bytes;
using k3test::read_st;
using k3test::StFile;
using k3test::write_bytes;
using k3test::write_st;

std::string join(const std::vector<int64_t>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + std::to_string(v[i]);
  return s;
}

const k3::SafeTensors& golden() {
  static k3::SafeTensors g = k3::SafeTensors::open(kFixture + "/golden.safetensors");
  return g;
}

class CliErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() / ("k3-cli-errors-" + std::to_string(::getpid()) + "-" + info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }

  // A copy of the fixture (config.json + model.safetensors) in root_/name.
  fs::path model_dir(const std::string& name = "model") {
    const fs::path d = root_ / name;
    fs::create_directories(d);
    fs::copy_file(kFixture + "/config.json", d / "config.json", fs::copy_options::overwrite_existing);
    fs::copy_file(kFixture + "/model.safetensors", d / "model.safetensors", fs::copy_options::overwrite_existing);
    fs::permissions(d / "model.safetensors", fs::perms::owner_write, fs::perm_options::add);
    return d;
  }
  void edit_config(const fs::path& dir, const std::function<void(json&)>& edit) {
    json c = json::parse(read_bytes(dir / "config.json"));
    edit(c);
    write_bytes(dir / "config.json", c.dump(2));
  }
  Outcome logits(const fs::path& dir, const std::vector<std::string>& ids = {"1,2,3"}) {
    std::vector<std::string> args = {"logits", "--model", dir.string(), "--out", (root_ / "out.safetensors").string()};
    for (const auto& i : ids) args.insert(args.end(), {"--ids", i});
    return run_k3(args);
  }
  Outcome generate(const fs::path& dir, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {"generate", "--model", dir.string(), "--ids", "1,2,3", "--max-new-tokens", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_k3(args);
  }
  // Neither a partial output nor a stray temp file may remain after a failed `k3 logits`.
  void expect_no_output_files() {
    for (const auto& e : fs::directory_iterator(root_))
      EXPECT_THAT(e.path().filename().string(), ::testing::Not(HasSubstr("out.safetensors"))) << e.path();
  }

  fs::path root_;
};

// ---- model.safetensors ------------------------------------------------------------------------

TEST_F(CliErrors, TruncatedInTheDataNamesFileAndATensorPastTheEnd) {
  const fs::path d = model_dir();
  const fs::path st = d / "model.safetensors";
  const StFile f = read_st(st);
  const uint64_t cut = f.data.size() / 2;
  fs::resize_file(st, 8 + f.header_len + cut);
  const std::string e = error_line(logits(d));
  EXPECT_THAT(e, AllOf(HasSubstr(st.string()), HasSubstr("past the end of the data"), HasSubstr("truncated")));
  // The tensor it names really does end past the cut.
  const size_t a = e.find("tensor '"), b = e.find('\'', a + 8);
  ASSERT_NE(a, std::string::npos) << e;
  const std::string name = e.substr(a + 8, b - a - 8);
  ASSERT_TRUE(f.header.contains(name)) << e;
  EXPECT_GT(f.header[name]["data_offsets"][1].get<uint64_t>(), cut) << e;
  expect_no_output_files();
  // generate reads the same loader.
  EXPECT_THAT(error_line(generate(d)), AllOf(HasSubstr(st.string()), HasSubstr("past the end of the data")));
}

TEST_F(CliErrors, TruncatedInsideTheHeaderNamesFile) {
  const fs::path d = model_dir();
  const fs::path st = d / "model.safetensors";
  const StFile f = read_st(st);
  fs::resize_file(st, 8 + f.header_len / 2);
  EXPECT_THAT(error_line(logits(d)), AllOf(HasSubstr(st.string()), HasSubstr("truncated"),
                                           HasSubstr("header says " + std::to_string(f.header_len))));
  expect_no_output_files();
}

TEST_F(CliErrors, HeaderShapeDisagreeingWithTheByteSpanNamesTensor) {
  const fs::path d = model_dir();
  const fs::path st = d / "model.safetensors";
  StFile f = read_st(st);
  ASSERT_EQ(f.header[kKvB]["shape"], json::array({256, 32}));
  f.header[kKvB]["shape"] = {256, 33};  // 16896 bytes of BF16, the span holds 16384
  write_st(st, f);
  EXPECT_THAT(error_line(logits(d)), AllOf(HasSubstr(st.string()), HasSubstr(kKvB), HasSubstr("[256, 33]"),
                                           HasSubstr("16896"), HasSubstr("16384")));
}

TEST_F(CliErrors, HeaderOffsetsPastTheEndOfFileNameTensor) {
  const fs::path d = model_dir();
  const fs::path st = d / "model.safetensors";
  StFile f = read_st(st);
  const uint64_t n = 256 * 32 * 2, end = f.data.size() + 64;
  f.header[kKvB]["data_offsets"] = {end - n, end};  // right size, but ends 64 bytes past EOF
  write_st(st, f);
  EXPECT_THAT(error_line(logits(d)), AllOf(HasSubstr(st.string()), HasSubstr(kKvB), HasSubstr("past the end"),
                                           HasSubstr(std::to_string(end))));
}

TEST_F(CliErrors, MissingTensorNamesTensorAndFile) {
  const fs::path d = model_dir();
  const fs::path st = d / "model.safetensors";
  StFile f = read_st(st);
  ASSERT_TRUE(k3test::erase_tensor(f, kKvB));
  write_st(st, f);
  EXPECT_THAT(error_line(logits(d)), AllOf(HasSubstr(st.string()), HasSubstr("missing tensor '" + kKvB + "'")));
  EXPECT_THAT(error_line(generate(d)), AllOf(HasSubstr(st.string()), HasSubstr(kKvB)));
  expect_no_output_files();
}

TEST_F(CliErrors, WrongShapeIsCaughtByTheModelNamingTensorAndBothShapes) {
  const fs::path d = model_dir();
  const fs::path st = d / "model.safetensors";
  StFile f = read_st(st);
  f.header[kKvB]["shape"] = {32, 256};  // same bytes: the file itself is consistent
  write_st(st, f);
  EXPECT_THAT(error_line(logits(d)),
              AllOf(HasSubstr(st.string()), HasSubstr("tensor '" + kKvB + "'"), HasSubstr("has shape [32, 256]"),
                    HasSubstr("expected [256, 32]"), HasSubstr((d / "config.json").string())));
}

// ---- config.json ------------------------------------------------------------------------------

TEST_F(CliErrors, ConfigThatIsNotJsonNamesTheConfig) {
  const fs::path d = model_dir();
  write_bytes(d / "config.json", "{\"text_config\": {\"vocab_size\": 1024,");
  EXPECT_THAT(error_line(logits(d)), AllOf(HasSubstr((d / "config.json").string()), HasSubstr("not valid JSON")));
  EXPECT_THAT(error_line(generate(d)), HasSubstr((d / "config.json").string()));
}

TEST_F(CliErrors, ZeroBasedLayerListsNameTheFieldAndSayOneBased) {
  const fs::path d = model_dir();
  edit_config(d, [](json& c) {
    c["text_config"]["linear_attn_config"]["kda_layers"] = {0, 1, 2, 4, 5};
    c["text_config"]["linear_attn_config"]["full_attn_layers"] = {3, 6, 7};
  });
  EXPECT_THAT(error_line(logits(d)),
              AllOf(HasSubstr((d / "config.json").string()), HasSubstr("text_config.linear_attn_config.kda_layers"),
                    HasSubstr("entry 0"), HasSubstr("1-based")));
}

TEST_F(CliErrors, HugeSizesAreRefusedBeforeAllocating) {
  // A hostile num_hidden_layers once allocated per-layer arrays first (gigabytes, OOM kill), and huge
  // sizes overflowed int64 parameter counts (UBSan abort in k3 inspect). Both are refused by name.
  const fs::path d = model_dir();
  edit_config(d, [](json& c) { c["text_config"]["num_hidden_layers"] = 1000000000000LL; });
  EXPECT_THAT(error_line(logits(d)),
              AllOf(HasSubstr((d / "config.json").string()), HasSubstr("text_config.num_hidden_layers"),
                    HasSubstr("exceeds the supported maximum")));
  EXPECT_THAT(error_line(run_k3({"inspect", "--config", (d / "config.json").string()})),
              HasSubstr("text_config.num_hidden_layers"));
  edit_config(d, [](json& c) {
    c["text_config"]["num_hidden_layers"] = 8;
    c["text_config"]["vocab_size"] = 9000000000000000000LL;
  });
  EXPECT_THAT(error_line(run_k3({"inspect", "--config", (d / "config.json").string()})),
              HasSubstr("text_config.vocab_size"));
  edit_config(d, [](json& c) {
    c["text_config"]["vocab_size"] = 1024;
    c["text_config"]["num_experts"] = 1 << 20;
    c["text_config"]["moe_intermediate_size"] = 1 << 24;
    c["text_config"]["routed_expert_hidden_size"] = 1 << 24;
  });
  EXPECT_THAT(error_line(run_k3({"inspect", "--config", (d / "config.json").string()})), HasSubstr("2^62 parameters"));
}

TEST_F(CliErrors, HiddenSizeDisagreeingWithTheWeightsNamesTensorShapesAndConfig) {
  const fs::path d = model_dir();
  edit_config(d, [](json& c) { c["text_config"]["hidden_size"] = 256; });
  EXPECT_THAT(error_line(logits(d)),
              AllOf(HasSubstr((d / "model.safetensors").string()),
                    HasSubstr("language_model.model.embed_tokens.weight"), HasSubstr("[1024, 128]"),
                    HasSubstr("[1024, 256]"), HasSubstr((d / "config.json").string())));
}

TEST_F(CliErrors, MissingConfigNamesIt) {
  const fs::path d = model_dir();
  fs::remove(d / "config.json");
  EXPECT_THAT(error_line(logits(d)), HasSubstr((d / "config.json").string()));
  EXPECT_THAT(error_line(generate(d)), HasSubstr((d / "config.json").string()));
  expect_no_output_files();
}

TEST_F(CliErrors, ModelPathThatDoesNotExistIsNamed) {
  const fs::path d = root_ / "no-such-model";
  EXPECT_THAT(error_line(logits(d)), HasSubstr(d.string()));
  EXPECT_THAT(error_line(generate(d)), HasSubstr(d.string()));
  expect_no_output_files();
}

// ---- flags ------------------------------------------------------------------------------------

TEST_F(CliErrors, TokenIdOutsideTheVocabularyNamesIdsAndVocab) {
  for (const std::string ids : {"1024", "5,1,2000"}) {
    const std::string bad = ids == "1024" ? "1024" : "2000";
    EXPECT_THAT(error_line(logits(kFixture, {ids})), AllOf(HasSubstr("--ids"), HasSubstr(bad), HasSubstr("1024)")));
    Outcome g = run_k3({"generate", "--model", kFixture, "--ids", ids, "--max-new-tokens", "2"});
    EXPECT_THAT(error_line(g), AllOf(HasSubstr("--ids"), HasSubstr(bad), HasSubstr("1024)")));
  }
  // In the second row of a batch.
  EXPECT_THAT(error_line(logits(kFixture, {"1,2", "3,1024"})), AllOf(HasSubstr("--ids"), HasSubstr("row 1")));
  expect_no_output_files();
}

TEST_F(CliErrors, MalformedIdsNameTheFlagAndTheItem) {
  for (const auto& [ids, item] : std::vector<std::pair<std::string, std::string>>{{"1,,2", "''"},
                                                                                  {"a", "'a'"},
                                                                                  {"-3", "'-3'"},
                                                                                  {"1,2,", "''"},
                                                                                  {"", "''"},
                                                                                  {"3x", "'3x'"},
                                                                                  {"99999999999", "'99999999999'"}}) {
    EXPECT_THAT(error_line(logits(kFixture, {ids})), AllOf(HasSubstr("--ids"), HasSubstr(item))) << ids;
    Outcome g = run_k3({"generate", "--model", kFixture, "--ids", ids});
    EXPECT_THAT(error_line(g), AllOf(HasSubstr("--ids"), HasSubstr(item))) << ids;
  }
  // The `=` form, which CLI11 can never take for an option name.
  EXPECT_THAT(error_line(run_k3({"generate", "--model", kFixture, "--ids=-3"})),
              AllOf(HasSubstr("--ids"), HasSubstr("'-3'")));
  expect_no_output_files();
}

TEST_F(CliErrors, LogitsRowsOfUnequalLengthAreRefused) {
  EXPECT_THAT(error_line(logits(kFixture, {"1,2,3", "4,5"})),
              AllOf(HasSubstr("--ids"), HasSubstr("same length"), HasSubstr("row 1 has 2")));
  expect_no_output_files();
}

TEST_F(CliErrors, BadSamplingParametersNameTheFlag) {
  EXPECT_THAT(error_line(generate(kFixture, {"--temperature", "0"})), HasSubstr("--temperature"));
  EXPECT_THAT(error_line(generate(kFixture, {"--temperature", "-1"})), HasSubstr("--temperature"));
  EXPECT_THAT(error_line(generate(kFixture, {"--top-p", "1.5"})), AllOf(HasSubstr("--top-p"), HasSubstr("1.5")));
  EXPECT_THAT(error_line(generate(kFixture, {"--top-p", "0"})), HasSubstr("--top-p"));
  EXPECT_THAT(error_line(generate(kFixture, {"--top-k", "-1"})), HasSubstr("--top-k"));
  EXPECT_THAT(error_line(run_k3({"generate", "--model", kFixture, "--ids", "1,2", "--max-new-tokens", "-1"})),
              HasSubstr("--max-new-tokens"));
}

TEST_F(CliErrors, OutputIntoAMissingDirectoryNamesItAndLeavesNothing) {
  const fs::path out = root_ / "no-such-dir" / "logits.safetensors";
  Outcome r = run_k3({"logits", "--model", kFixture, "--ids", "1,2,3", "--out", out.string()});
  EXPECT_THAT(error_line(r), HasSubstr(out.string()));
  EXPECT_FALSE(fs::exists(out.parent_path()));
}

// ---- environment ------------------------------------------------------------------------------

// K3_GEMM is parsed in main before any subcommand runs: a bad value is one clean error naming it,
// and a good one reaches the CPU linears (f32 rounds differently from the default fp64 accumulation,
// which f64 and an unset K3_GEMM both give). The variable is set for the child process only.
TEST_F(CliErrors, K3GemmIsCheckedAndHonoured) {
  const std::vector<int64_t> a = golden().read_i64("ids_a");
  auto run = [&](const std::string& env, const std::string& name) {
    const fs::path out = root_ / (name + ".safetensors");
    const std::vector<std::string> args = {"logits", "--model", kFixture, "--ids", join(a, ","), "--out", out.string()};
    return std::make_pair(k3test::run_shell(k3test::k3_command(args, env)), out);
  };
  for (const char* bad : {"bad", "F32", "fp64", "f32 "}) {
    const auto [r, out] = run("K3_GEMM=" + k3test::shell_quote(bad), "bad");
    EXPECT_EQ(error_line(r), std::string("error: K3_GEMM must be f32 or f64, got '") + bad + "'");
    EXPECT_FALSE(fs::exists(out)) << bad;
  }
  std::vector<std::vector<float>> logits;
  for (const char* env : {"", "K3_GEMM=", "K3_GEMM=f64", "K3_GEMM=f32"}) {
    const auto [r, out] = run(env, "ok");
    ASSERT_EQ(r.status, 0) << r.command << "\n" << r.output;
    logits.push_back(k3::SafeTensors::open(out.string()).read_f32("logits"));
  }
  EXPECT_EQ(logits[1], logits[0]) << "an empty K3_GEMM must leave the default (f64)";
  EXPECT_EQ(logits[2], logits[0]) << "K3_GEMM=f64 must be the default";
  ASSERT_EQ(logits[3].size(), logits[0].size());
  size_t differing = 0;
  double max_diff = 0.0;
  for (size_t i = 0; i < logits[0].size(); ++i) {
    differing += logits[3][i] != logits[0][i];
    max_diff = std::max(max_diff, std::fabs(double(logits[3][i]) - double(logits[0][i])) /
                                      std::max(1.0, std::fabs(double(logits[0][i]))));
  }
  std::printf("K3_GEMM=f32 against f64: %zu of %zu logits differ, max rel diff %.3g\n", differing, logits[0].size(),
              max_diff);
  EXPECT_GT(differing, 0u) << "K3_GEMM=f32 gave the f64 logits bit for bit: it was not applied";
  EXPECT_LE(max_diff, 1e-2);
}

// ---- success paths ----------------------------------------------------------------------------

TEST_F(CliErrors, LogitsWritesTheInProcessForwardAndNoTempFile) {
  // Two rows of 37 ids: ids_a and the first 37 ids of ids_b's first row.
  const std::vector<int64_t> a = golden().read_i64("ids_a"), b = golden().read_i64("ids_b");
  const int64_t T = int64_t(a.size());
  std::vector<std::vector<int32_t>> rows(2);
  for (int64_t i = 0; i < T; ++i) {
    rows[0].push_back(int32_t(a[size_t(i)]));
    rows[1].push_back(int32_t(b[size_t(i)]));
  }
  const fs::path outdir = root_ / "out";
  fs::create_directories(outdir);
  const fs::path out = outdir / "logits.safetensors";
  Outcome r = run_k3({"logits", "--model", kFixture, "--ids", join(a, ","), "--ids",
                      join({b.begin(), b.begin() + T}, ","), "--out", out.string()});
  ASSERT_EQ(r.status, 0) << r.command << "\n" << r.output;
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("Sanitizer")));

  std::vector<std::string> entries;
  for (const auto& e : fs::directory_iterator(outdir)) entries.push_back(e.path().filename().string());
  EXPECT_EQ(entries, std::vector<std::string>{"logits.safetensors"}) << "a .tmp. file was left beside --out";

  const k3::SafeTensors st = k3::SafeTensors::open(out.string());
  EXPECT_EQ(st.names(), std::vector<std::string>{"logits"});
  const k3::TensorView& t = st.get("logits");
  EXPECT_EQ(t.dtype, k3::DType::F32);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, T, 1024}));
  const std::vector<float> got = st.read_f32("logits");

  auto m = k3::Model::load(kFixture);
  std::vector<k3::SequenceCache> caches;
  for (int i = 0; i < 2; ++i) caches.push_back(m->new_cache());
  std::vector<k3::SequenceCache*> ptrs = {&caches[0], &caches[1]};
  const std::vector<float> want = m->forward(ptrs, rows, true);
  ASSERT_EQ(got.size(), want.size());
  double max_diff = 0.0;
  size_t differing = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << i;
    const double dlt = std::fabs(double(got[i]) - double(want[i]));
    max_diff = std::max(max_diff, dlt / std::max(1.0, std::fabs(double(want[i]))));
    differing += got[i] != want[i];
  }
  std::printf("k3 logits vs in-process forward: %zu of %zu values differ, max rel diff %.3g\n", differing, got.size(),
              max_diff);
  EXPECT_LE(max_diff, 1e-6);
}

TEST_F(CliErrors, GenerateGreedyPrintsTheGoldenContinuation) {
  const std::vector<int64_t> a = golden().read_i64("ids_a"), want = golden().read_i64("greedy_full_ids_a");
  ASSERT_EQ(want.size(), 24u);
  const fs::path err = root_ / "stderr.txt";
  Outcome r = run_k3({"generate", "--model", kFixture, "--ids", join(a, ","), "--max-new-tokens", "24", "--print-ids"},
                     "2>" + k3test::shell_quote(err.string()));
  ASSERT_EQ(r.status, 0) << r.command << "\n" << read_bytes(err);
  const std::vector<std::string> lines = lines_of(r.output);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.back(), join(want, " "));
  EXPECT_THAT(read_bytes(err), ::testing::Not(HasSubstr("Sanitizer")));
}

}  // namespace
