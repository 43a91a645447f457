// Regression tests for the 18 defects an adversarial pass found (issue 16), one group per defect
// (D01..D18), each judged at its mechanism: the bounded JSON parse and walks (core/json.h), the one
// output writer (io/output_file.h), the input registry and its SIGBUS report (io/input_registry.h),
// the run-directory lock (io/dir_lock.h), strict numeric flags (cli/args.h) and range checks
// (core/validate.h), up-front memory estimates (core/memory.h) and the non-finite checks of the
// forward and of training (model/nonfinite.h, core/finite.h).
//
// End-to-end cases run the k3 binary (K3_TEST_BINARY=path runs another build, e.g. one from before
// the fixes, to see these tests fail there) and require a clean k3::Error: exit status 1 and one
// last "error: ..." line that names the flag, file, tensor, field or layer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json.h"
#include "io/dir_lock.h"
#include "io/mapped_file.h"
#include "io/output_file.h"
#include "io/safetensors.h"
#include "model/sampler.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_parse.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/trainer.h"
#include "util/cli.h"
#include "util/cli_error.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/st_file.h"
#include "util/temp_dir.h"
#include "util/tiny_tokenizer.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using k3test::error_line;
using k3test::fixture;
using k3test::Outcome;
using k3test::run_k3;
using k3test::run_shell;
using k3test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

namespace {

const std::string kDeep20k = std::string(20000, '[') + std::string(20000, ']');

// An address-space limit for a k3 command line: what the defect allocated cannot fit under it.
// AddressSanitizer reserves terabytes of shadow address space, so its builds run unlimited.
std::string memory_limit() {
#if defined(__SANITIZE_ADDRESS__)
  return "";
#else
  return "ulimit -v 6291456; ";  // 6 GiB: the CUDA libraries alone map ~1 GiB
#endif
}

using k3test::error_of;

void write_text(const fs::path& p, const std::string& s) { k3test::write_bytes(p, s); }

// A copy of the golden tiny model (config.json + model.safetensors), writable.
fs::path copy_model(const TempDir& d, const std::string& name = "model", bool mxfp4 = false) {
  const fs::path m = d.path() / name;
  fs::create_directories(m);
  fs::copy_file(fixture(mxfp4 ? "k3-tiny-a/config-mxfp4.json" : "k3-tiny-a/config.json"), m / "config.json");
  fs::copy_file(fixture(mxfp4 ? "k3-tiny-a/model-mxfp4.safetensors" : "k3-tiny-a/model.safetensors"),
                m / "model.safetensors");
  fs::permissions(m / "model.safetensors", fs::perms::owner_write, fs::perm_options::add);
  fs::permissions(m / "config.json", fs::perms::owner_write, fs::perm_options::add);
  return m;
}

using k3test::edit_tensor;

void edit_config(const fs::path& dir, const std::function<void(json&)>& edit) {
  json c = json::parse(k3test::read_bytes(dir / "config.json"));
  edit(c["text_config"]);
  write_text(dir / "config.json", c.dump(2));
}

// A tokenizer of the first 768 o200k ranks (+256 specials: the fixture's vocabulary of 1024), and a
// shard of a few English documents made with it by `k3 data`.
struct Corpus {
  TempDir dir{"hardening-corpus"};
  std::string tok, shard;
  Corpus() {
    tok = k3test::write_tiny_tokenizer(dir.path() / "tok");
    std::vector<std::string> args = {"data", "--tokenizer", tok, "--out", dir.file("shard.bin")};
    for (int d = 0; d < 4; ++d) {
      const std::string f = dir.file("doc" + std::to_string(d) + ".txt");
      std::ofstream t(f);
      for (int r = 0; r < 12; ++r)
        t << "the cat sat on the mat and the dog sat on the log, " << r << " and " << d << ".\n";
      args.push_back(f);
    }
    const Outcome r = run_k3(args);
    if (r.status != 0) throw std::runtime_error(r.output);
    shard = dir.file("shard.bin");
  }
};

const Corpus& corpus() {
  static const Corpus c;
  return c;
}

// Two steps of 32 tokens on the tiny config, a checkpoint after each.
std::vector<std::string> train_args(const std::string& out,
                                    const std::string& config = fixture("k3-tiny-a/config.json")) {
  return {"train",
          "--config",
          config,
          "--data",
          corpus().shard,
          "--out",
          out,
          "--stages",
          "16:64",
          "--tokens-per-step",
          "32",
          "--save-every",
          "1",
          "--seed",
          "3",
          "--grad-lanes",
          "1"};
}

// args with each FLAG VALUE pair of `more` set (replacing the flag's value when args has it) and each
// other flag (one followed by another flag, or last) appended.
std::vector<std::string> with(std::vector<std::string> args, const std::vector<std::string>& more) {
  for (size_t i = 0; i < more.size(); ++i) {
    const bool has_value = i + 1 < more.size() && more[i + 1].rfind("--", 0) != 0;
    const auto it = std::find(args.begin(), args.end(), more[i]);
    if (has_value && it != args.end() && it + 1 != args.end()) *(it + 1) = more[i + 1];
    else
      args.insert(args.end(), more.begin() + std::ptrdiff_t(i), more.begin() + std::ptrdiff_t(i + (has_value ? 2 : 1)));
    i += has_value;
  }
  return args;
}

}  // namespace

// ---- D01: deep JSON -----------------------------------------------------------------------------

TEST(Hardening, D01_DeepJsonInARequestIsAnErrorNotAStackOverflow) {
  TempDir d("d01");
  const std::string tools = R"({"tools":[{"type":"function","function":{"name":"f","parameters":{"x":)" + kDeep20k +
                            R"(}}}],"messages":[{"role":"user","content":"x"}]})";
  const std::string content =
      R"({"messages":[{"role":"user","content":)" + std::string(200000, '[') + std::string(200000, ']') + "}]}";
  write_text(d.path() / "tools.json", tools);
  write_text(d.path() / "content.json", content);
  for (const char* f : {"tools.json", "content.json"})
    EXPECT_THAT(error_line(run_k3({"chat-template", "--request", d.file(f)})),
                AllOf(HasSubstr(d.file(f)), HasSubstr("nested deeper than 256 levels")));
  // Arguments of a tool call in the history are a JSON string, parsed again: bounded too.
  const std::string args = R"({"messages":[{"role":"assistant","content":"","tool_calls":[{"type":"function",)"
                           R"("function":{"name":"f","arguments":)" +
                           json(R"({"x":)" + kDeep20k + "}").dump() + "}}]}]}";
  write_text(d.path() / "args.json", args);
  EXPECT_THAT(error_line(run_k3({"chat-template", "--request", d.file("args.json")})),
              AllOf(HasSubstr("arguments"), HasSubstr("deeper than 256 levels")));
}

TEST(Hardening, D01_TheDepthBoundIsExact) {
  const std::string ok = std::string(k3::kMaxJsonDepth, '[') + std::string(k3::kMaxJsonDepth, ']');
  const std::string deep = "[" + ok + "]";
  const json v = k3::parse_json(ok, "ok");
  EXPECT_EQ(k3::python_json_dumps(nlohmann::ordered_json::parse(ok), true), ok);  // every walk takes the deepest
  EXPECT_THAT(error_of([&] { k3::parse_json(deep, "deep"); }), HasSubstr("deep: JSON nested deeper than 256 levels"));
  EXPECT_FALSE(k3::try_parse_json(deep).has_value());
  // Brackets inside strings do not count.
  EXPECT_NO_THROW(k3::parse_json("[\"" + std::string(1000, '[') + "\\\"[\"]", "strings"));
}

TEST(Hardening, D01_DeepToolArgumentsInModelOutputAreKeptAsText) {
  const std::string head =
      "<|open|>response<|sep|>ok<|close|>response<|sep|><|open|>tools<|sep|>"
      "<|open|>call tool=\"f\" index=\"1\"<|sep|>";
  const std::string tail = "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
  for (const std::string& body :
       {"<|open|>argument key=\"x\" type=\"array\"<|sep|>" + kDeep20k + "<|close|>argument<|sep|>",
        "<|open|>json<|sep|>{\"x\": " + kDeep20k + "}<|close|>json<|sep|>"}) {
    const k3::XtmlAssistantMessage m =
        k3::parse_assistant(k3::xtml_pieces_from_text(head + body + tail), k3::XtmlStart::kMessageBody);
    ASSERT_EQ(m.tool_calls.size(), 1u);
    const k3::XtmlToolCall& c = m.tool_calls[0];
    EXPECT_TRUE(c.raw_arguments.has_value() || (c.arguments.contains("x") && c.arguments["x"].is_string()));
    const std::string out = k3::python_json_dumps(m.to_openai(), false);  // the output walks do not overflow
    EXPECT_NE(out.find(std::string(100, '[')), std::string::npos);        // the text is kept
  }
}

TEST(Hardening, D01_WalksRefuseDeepValuesBuiltInMemory) {
  nlohmann::ordered_json v = 1;
  for (int i = 0; i < 20000; ++i) {  // built by moves (a copy would recurse), destroyed iteratively
    nlohmann::ordered_json outer = nlohmann::ordered_json::array();
    outer.push_back(std::move(v));
    v = std::move(outer);
  }
  EXPECT_THAT(error_of([&] { k3::python_json_dumps(v, false); }), HasSubstr("nested deeper than 256"));
  EXPECT_THAT(error_of([&] { k3::deep_sorted(v); }), HasSubstr("nested deeper than 256"));
}

TEST(Hardening, D01_DeepSafetensorsHeaderIsAnError) {
  TempDir d("d01st");
  const std::string path = d.file("deep.safetensors");
  k3test::write_bytes(path, k3test::st_bytes("{\"__metadata__\":{},\"a\":" + kDeep20k + "}", ""));
  EXPECT_THAT(error_of([&] { k3::SafeTensors::open(path); }), AllOf(HasSubstr(path), HasSubstr("nested deeper")));
}

// ---- D02: device nodes and FIFOs as --out --------------------------------------------------------

TEST(Hardening, D02_AnOutputThatIsAFifoOrADeviceIsRefusedAndLeftAlone) {
  TempDir d("d02");
  const std::string fifo = d.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  EXPECT_THAT(error_line(run_k3({"logits", "--model", fixture("k3-tiny-a"), "--ids", "1", "--out", fifo})),
              AllOf(HasSubstr(fifo), HasSubstr("FIFO")));
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  // A device node (root only): the defect replaced /dev/null this way.
  const std::string dev = d.file("null");
  if (::mknod(dev.c_str(), S_IFCHR | 0666, makedev(1, 3)) != 0) GTEST_SKIP() << "mknod needs root";
  EXPECT_THAT(error_line(run_k3({"logits", "--model", fixture("k3-tiny-a"), "--ids", "1", "--out", dev})),
              AllOf(HasSubstr(dev), HasSubstr("character device")));
  ASSERT_EQ(::lstat(dev.c_str(), &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST(Hardening, D02_OutputFileRefusesLinksAndDirectories) {
  TempDir d("d02b");
  const std::string victim = d.file("victim"), link = d.file("link");
  write_text(victim, "precious");
  fs::create_symlink(victim, link);
  EXPECT_THAT(error_of([&] { k3::write_file_atomic(link, "x"); }), HasSubstr("symbolic link"));
  EXPECT_THAT(error_of([&] { k3::write_file_atomic(d.path().string(), "x"); }), HasSubstr("is a directory"));
  EXPECT_EQ(k3test::read_bytes(victim), "precious");
  EXPECT_TRUE(fs::is_symlink(link));
}

// ---- D03: non-finite results are errors naming where they first appeared -------------------------

TEST(Hardening, D03_NanFlagsAreRefused) {
  TempDir d("d03");
  EXPECT_THAT(error_line(run_k3(with(train_args(d.file("run")), {"--min-lr-ratio", "nan"}))),
              HasSubstr("--min-lr-ratio"));
  EXPECT_FALSE(fs::exists(d.path() / "run" / "latest"));
  k3::train::TrainOptions o;  // the library refuses it too (a server or a script calls train() directly)
  o.min_lr_ratio = std::nan("");
  EXPECT_THAT(error_of([&] { k3::train::train(o); }), HasSubstr("--min-lr-ratio must be a finite number in [0, 1]"));
}

TEST(Hardening, D03_AnUpdateThatOverflowsStopsBeforeItIsSaved) {
  TempDir d("d03u");
  const std::string run = d.file("run");
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--lr", "1.7e308"}))),
              AllOf(HasSubstr("step 1: the optimizer update made parameter '"), HasSubstr("Inf"),
                    HasSubstr("no checkpoint has been written yet")));
  EXPECT_FALSE(fs::exists(fs::path(run) / "latest"));
}

TEST(Hardening, D03_NanWeightNamesTheTensorInLogitsGradAndEval) {
  TempDir d("d03w");
  const fs::path m = copy_model(d);
  const std::string kvb = "language_model.model.layers.3.self_attn.kv_b_proj.weight";  // an MLA layer
  edit_tensor(m / "model.safetensors", kvb, [](char* p, size_t) { p[0] = char(0xc0), p[1] = char(0x7f); });  // bf16 NaN
  const std::string out = d.file("out.safetensors");
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1,2,3", "--out", out})),
              AllOf(HasSubstr("layer 3's attn_out (MLA)"), HasSubstr(kvb), HasSubstr("NaN")));
  EXPECT_THAT(error_line(run_k3({"generate", "--model", m.string(), "--ids", "1,2,3", "--max-new-tokens", "2"})),
              HasSubstr(kvb));
  EXPECT_THAT(error_line(run_k3({"grad", "--model", m.string(), "--ids", "1,2,3", "--out", out})),
              AllOf(HasSubstr(kvb), HasSubstr("NaN")));
  EXPECT_THAT(error_line(
                  run_k3({"eval", "--model", m.string(), "--tokenizer", corpus().tok, "--heldout", corpus().shard,
                          "--heldout-tokens", "64", "--train-length", "16", "--out", d.file("eval")})),
              HasSubstr(kvb));
  EXPECT_FALSE(fs::exists(out));
  EXPECT_FALSE(fs::exists(d.path() / "eval" / "eval.json"));
}

TEST(Hardening, D03_InfEmbeddingRowIsNamed) {
  TempDir d("d03e");
  const fs::path m = copy_model(d);
  const std::string emb = "language_model.model.embed_tokens.weight";
  edit_tensor(m / "model.safetensors", emb, [](char* p, size_t) {
    for (int i = 0; i < 128; ++i) p[2 * (128 * 7 + i)] = char(0x80), p[2 * (128 * 7 + i) + 1] = char(0x7f);
  });  // row 7 = +Inf (bf16 0x7f80)
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1,7", "--out", d.file("o")})),
              AllOf(HasSubstr("the embedding, token row 1"), HasSubstr(emb), HasSubstr("+Inf")));
}

TEST(Hardening, D03_Mxfp4ScaleByte0xFFIsNamed) {
  TempDir d("d03x");
  const fs::path m = copy_model(d, "model", /*mxfp4=*/true);
  const k3test::StFile f = k3test::read_st(m / "model.safetensors");
  // Every scale of layer 1 (the first MoE layer) is E8M0 NaN, so whichever experts are routed to hit one.
  for (const auto& [name, v] : f.header.items())
    if (name.find("layers.1.") != std::string::npos && name.find("weight_scale") != std::string::npos)
      edit_tensor(m / "model.safetensors", name, [](char* p, size_t n) { std::memset(p, 0xFF, n); });
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1,2,3", "--out", d.file("o")})),
              AllOf(HasSubstr("layer 1's ffn_out (LatentMoE)"), HasSubstr("weight_scale"), HasSubstr("0xFF")));
}

TEST(Hardening, D03_OverflowFromFiniteWeightsNamesTheLayer) {
  TempDir d("d03o");
  const fs::path m = copy_model(d);
  // bf16 3.4e38 everywhere in layer 0's KDA q_proj: finite weights whose products overflow float32.
  edit_tensor(m / "model.safetensors", "language_model.model.layers.0.self_attn.q_proj.weight", [](char* p, size_t n) {
    for (size_t i = 0; i + 1 < n; i += 2) p[i] = char(0x7f), p[i + 1] = char(0x7f);
  });
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1,2,3", "--out", d.file("o")})),
              AllOf(HasSubstr("layer 0's attn_out (KDA)"), HasSubstr("every weight there is finite")));
}

TEST(Hardening, D03_HugeConfigScaleIsRefusedByName) {
  TempDir d("d03c");
  const fs::path m = copy_model(d);
  edit_config(m, [](json& t) { t["routed_scaling_factor"] = 1e300; });
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1", "--out", d.file("o")})),
              AllOf(HasSubstr("routed_scaling_factor"), HasSubstr("(0, 10000]")));
}

// ---- D04: one process per run directory ---------------------------------------------------------

TEST(Hardening, D04_ASecondTrainOnTheSameRunDirectoryIsRefused) {
  TempDir d("d04");
  const std::string run = d.file("run");
  {
    const k3::DirectoryLock held(run, "run directory");  // as a running `k3 train --out run` holds it
    EXPECT_THAT(error_of([&] { k3::DirectoryLock again(run, "run directory"); }),
                HasSubstr("in use by another k3 process (pid " + std::to_string(::getpid()) + ")"));
    EXPECT_THAT(error_line(run_k3(train_args(run))),
                AllOf(HasSubstr(run), HasSubstr("in use by another k3 process (pid " + std::to_string(::getpid()))));
    EXPECT_FALSE(fs::exists(fs::path(run) / "metrics.jsonl"));  // the refused run wrote nothing
  }
  const Outcome r = run_k3(train_args(run));  // the lock went with its holder
  EXPECT_EQ(r.status, 0) << r.output;
}

// ---- D05: an output equal to an input -----------------------------------------------------------

TEST(Hardening, D05_AnOutputThatIsAnInputIsRefusedAndTheInputKept) {
  TempDir d("d05");
  const fs::path m = copy_model(d);
  const std::string weights = (m / "model.safetensors").string(), before = k3test::read_bytes(weights);
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1", "--out", weights})),
              AllOf(HasSubstr(weights), HasSubstr("is an input of this command")));
  // Another spelling of the same file, and a hard link to it.
  fs::create_hard_link(weights, d.path() / "link.safetensors");
  for (const std::string& other : {(m / ".." / "model" / "model.safetensors").string(), d.file("link.safetensors")})
    EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1", "--out", other})),
                HasSubstr("is an input of this command"));
  EXPECT_EQ(k3test::read_bytes(weights), before);
  const std::string text = d.file("in.txt");
  write_text(text, "some text\n");
  EXPECT_THAT(error_line(run_k3({"data", "--tokenizer", corpus().tok, "--out", text, text})),
              AllOf(HasSubstr(text), HasSubstr("is an input of this command")));
  EXPECT_EQ(k3test::read_bytes(text), "some text\n");
}

// ---- D06: a tiny temperature ---------------------------------------------------------------------

TEST(Hardening, D06_ATinyTemperatureSamplesLikeGreedy) {
  auto ids = [](std::vector<std::string> extra) {
    const Outcome r =
        run_k3(with({"generate", "--ids", "203,802,2,239", "--max-new-tokens", "8", "--print-ids"}, extra),
               "2>/dev/null");
    EXPECT_EQ(r.status, 0) << r.output;
    return k3test::lines_of(r.output).back();
  };
  const std::string greedy = ids({"--greedy"});
  EXPECT_EQ(ids({"--temperature", "1e-40", "--seed", "1"}), greedy);
  EXPECT_EQ(ids({"--temperature", "1e-40", "--top-k", "5", "--seed", "2"}), greedy);
  EXPECT_EQ(ids({"--temperature", "1e-40", "--top-p", "0.9", "--seed", "3"}), greedy);
  // In process: the smallest positive float.
  std::vector<float> logits = {1.0f, 3.0f, -2.0f, 2.999f};
  k3::SamplingParams p;
  p.greedy = false;
  p.temperature = 1e-45f;
  for (uint64_t s = 0; s < 50; ++s) {
    p.seed = s;
    k3::Sampler sampler(p);
    EXPECT_EQ(sampler.sample(logits.data(), 4), 1);
  }
  // -Inf masks a token; +Inf and NaN, or nothing but -Inf, are errors rather than a made-up draw.
  k3::Sampler sampler(p);
  const std::vector<float> masked = {-INFINITY, 0.5f, -INFINITY}, pos_inf = {0.0f, INFINITY},
                           none = {-INFINITY, -INFINITY};
  EXPECT_EQ(sampler.sample(masked.data(), 3), 1);
  EXPECT_THAT(error_of([&] { sampler.sample(pos_inf.data(), 2); }), HasSubstr("logit 1 is +Inf"));
  EXPECT_THAT(error_of([&] { sampler.sample(none.data(), 2); }), HasSubstr("every logit is -Inf"));
}

// ---- D07: temporary files ------------------------------------------------------------------------

TEST(Hardening, D07_APlantedLinkAtTheOldTemporaryNameRedirectsNothing) {
  TempDir d("d07");
  const std::string out = d.file("out.json"), victim = d.file("victim");
  write_text(victim, "precious");
  // The old writer used OUT.tmp.<pid>; whatever it uses now must not follow a link planted there.
  fs::create_symlink(victim, out + ".tmp." + std::to_string(::getpid()));
  k3::write_file_atomic(out, "new");
  EXPECT_EQ(k3test::read_bytes(out), "new");
  EXPECT_EQ(k3test::read_bytes(victim), "precious");
  // A link planted at the temporary's own name: the exclusive create refuses it and follows nothing.
  const std::string planted = d.file(".out.json.tmp.0123456789abcdef");
  fs::create_symlink(victim, planted);
  errno = 0;
  EXPECT_EQ(k3::create_new_file(planted), -1);
  EXPECT_EQ(errno, EEXIST);
  fs::create_symlink(d.file("nowhere"), d.file("dangling"));  // O_CREAT alone would create its target
  EXPECT_EQ(k3::create_new_file(d.file("dangling")), -1);
  EXPECT_FALSE(fs::exists(d.path() / "nowhere"));
  EXPECT_EQ(k3test::read_bytes(victim), "precious");
  // Temporary names are random: writers of one path at once never share one.
  k3::OutputFile a(out), b(out);
  EXPECT_NE(a.temp_path(), b.temp_path());
  EXPECT_EQ(fs::path(a.temp_path()).filename().string().rfind(".out.json.tmp.", 0), 0u) << a.temp_path();
  EXPECT_TRUE(fs::is_regular_file(a.temp_path()));
}

// ---- D08: --save-every 0 -------------------------------------------------------------------------

TEST(Hardening, D08_SaveEveryZeroIsRefused) {
  TempDir d("d08");
  EXPECT_THAT(error_line(run_k3(with(train_args(d.file("run")), {"--save-every", "0"}))),
              HasSubstr("--save-every must be an integer >= 1, got 0"));
}

// ---- D09: memory blow-ups are refused up front ---------------------------------------------------

TEST(Hardening, D09_ARankBeyondTheFileIsRefusedWithoutAllocating) {
  TempDir d("d09");
  std::string ranks;
  for (int b = 0; b < 256; ++b) {
    static const char* kB64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    ranks += std::string(1, kB64[(b >> 2) & 63]) + kB64[(b & 3) << 4] + "== " + std::to_string(b) + "\n";
  }
  ranks += "YWI= 300000000\n";  // "ab"
  write_text(d.path() / "tiktoken.model", ranks);
  // The old loader asked for ~10 GB here.
  const Outcome r =
      run_shell(memory_limit() + k3test::k3_command({"tokenize", "--ranks", d.file("tiktoken.model"), "--text", "ab"}));
  EXPECT_THAT(error_line(r), AllOf(HasSubstr("tiktoken.model:257"), HasSubstr("rank 300000000 is out of range")));
}

TEST(Hardening, D09_GradLanesAndInitAreEstimatedBeforeAllocating) {
  TempDir d("d09b");
  EXPECT_THAT(error_line(run_k3(with(train_args(d.file("run")), {"--grad-lanes", "1000000"}))),
              AllOf(HasSubstr("--grad-lanes 1000000"), HasSubstr("of memory, but only")));
  const std::string k3 = std::string(K3_SOURCE_DIR) + "/configs/kimi-k3.json";
  const Outcome r = run_shell(memory_limit() + k3test::k3_command({"init", "--config", k3, "--out", d.file("big")}));
  // 2.780T: the text model's 2.779T and the vision tower and projector, which k3 init writes too.
  EXPECT_THAT(error_line(r), AllOf(HasSubstr("k3 init"), HasSubstr("2.780T parameters"), HasSubstr("needs")));
  EXPECT_FALSE(fs::exists(d.path() / "big" / "model.safetensors"));
}

// ---- D10: FIFOs and devices as inputs ------------------------------------------------------------

TEST(Hardening, D10_FifoAndDeviceInputsAreRefusedNotWaitedOn) {
  TempDir d("d10");
  // `timeout` turns a hang into status 124, which error_line rejects.
  auto k3t = [](const std::vector<std::string>& args) {
    return run_shell("timeout 60 env " + k3test::k3_command(args));
  };
  for (const char* file : {"config.json", "model.safetensors"}) {
    const fs::path m = copy_model(d, std::string("m-") + file);
    fs::remove(m / file);
    ASSERT_EQ(::mkfifo((m / file).c_str(), 0644), 0);
    EXPECT_THAT(error_line(k3t({"logits", "--model", m.string(), "--ids", "1", "--out", d.file("o")})),
                AllOf(HasSubstr((m / file).string()), HasSubstr("FIFO")));
  }
  ASSERT_EQ(::mkfifo(d.file("ranks").c_str(), 0644), 0);
  EXPECT_THAT(error_line(k3t({"tokenize", "--ranks", d.file("ranks"), "--text", "x"})), HasSubstr("FIFO"));
  EXPECT_THAT(error_line(k3t(with(train_args(d.file("run")), {"--data", d.file("ranks")}))), HasSubstr("FIFO"));
  EXPECT_THAT(error_line(k3t({"tokenize", "--ranks", corpus().tok + "/tiktoken.model", "--text-file", "/dev/zero"})),
              AllOf(HasSubstr("/dev/zero"), HasSubstr("device")));
}

// ---- D11, D12: resuming -------------------------------------------------------------------------

TEST(Hardening, D11_ResumeRefusesOtherSettingsAndReportsAFinishedRun) {
  TempDir d("d11");
  const std::string run = d.file("run");
  ASSERT_EQ(run_k3(train_args(run)).status, 0);
  // The run's identity: refused, every difference named.
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--resume", "--seed", "4", "--tokens-per-step", "16"}))),
              AllOf(HasSubstr("train_state.bin"), HasSubstr("--seed: the run used 3, this command gives 4"),
                    HasSubstr("--tokens-per-step: the run used 32, this command gives 16")));
  const fs::path cfg = d.path() / "config.json";
  json c = json::parse(k3test::read_bytes(fixture("k3-tiny-a/config.json")));
  c["text_config"]["rms_norm_eps"] = 1e-6;
  write_text(cfg, c.dump());
  EXPECT_THAT(error_line(run_k3(with(train_args(run, cfg.string()), {"--resume"}))),
              HasSubstr("--config: the config differs"));
  // The plan: refused unless asked for, then taken with a note.
  const std::vector<std::string> longer = with(train_args(run), {"--stages", "16:96", "--resume"});
  EXPECT_THAT(error_line(run_k3(longer)),
              AllOf(HasSubstr("--stages: the run used [\"16:64\"]"), HasSubstr("--change-plan")));
  Outcome r = run_k3(with(longer, {"--change-plan"}));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("continuing on a new plan"), HasSubstr("trained 3 steps (1 in this run)")));
  // The same settings again: nothing left to do, said plainly, with the checkpoint.
  r = run_k3(longer);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, AllOf(HasSubstr("already complete"), HasSubstr("step-00000003")));
}

TEST(Hardening, D12_ATornMetricsLineIsDroppedAndACorruptStateIsNamed) {
  TempDir d("d12");
  const std::string run = d.file("run");
  ASSERT_EQ(run_k3(train_args(run)).status, 0);
  // Back to step 1, with the line a kill during step 2's record would leave.
  write_text(fs::path(run) / "latest", "step-00000001\n");
  std::ofstream(run + "/metrics.jsonl", std::ios::app) << "{\"step\": 2, \"lo";
  Outcome r = run_k3(with(train_args(run), {"--resume"}));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("dropped a torn last line"));
  // A state file whose header lacks a key, then one that claims more data than it holds.
  const std::string state = run + "/step-00000002/train_state.bin";
  const std::string bytes = k3test::read_bytes(state);
  uint64_t len = 0;
  std::memcpy(&len, bytes.data() + 8, 8);
  auto rewrite = [&](const std::function<void(json&)>& edit) {
    json h = json::parse(bytes.substr(16, len));
    edit(h);
    const std::string hs = h.dump();
    const uint64_t n = hs.size();
    write_text(state,
               bytes.substr(0, 8) + std::string(reinterpret_cast<const char*>(&n), 8) + hs + bytes.substr(16 + len));
  };
  rewrite([](json& h) { h["meta"].erase("data_pos"); });
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--resume"}))), AllOf(HasSubstr(state), HasSubstr("data_pos")));
  rewrite([](json& h) { h["optimizer_size"] = uint64_t(1) << 60; });
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--resume"}))),
              AllOf(HasSubstr(state), HasSubstr("more than the file holds")));
}

// ---- D13, D14: flag and field values ------------------------------------------------------------

TEST(Hardening, D13_MessagesNameTheFlagOrField) {
  TempDir d("d13");
  EXPECT_THAT(error_line(run_k3(with(train_args(d.file("run")), {"--warmup", "nan"}))),
              AllOf(HasSubstr("--warmup"), HasSubstr("'nan'")));
  const fs::path m = copy_model(d);
  edit_config(m, [](json& t) { t["linear_attn_config"]["gate_lower_bound"] = -1e300; });
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1", "--out", d.file("o")})),
              AllOf(HasSubstr("config.json: field 'text_config.linear_attn_config.gate_lower_bound'"),
                    HasSubstr("-1e+300")));
  EXPECT_THAT(error_line(run_k3({"logits", "--model", fixture("k3-tiny-a"), "--ids", "1", "--out", ""})),
              HasSubstr("the output path is empty"));
}

TEST(Hardening, D14_OutOfRangeNumbersAreRefused) {
  TempDir d("d14");
  const std::string run = d.file("run");
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--lr", "-1"}, {"--clip", "-1"}, {"--tokens", "-5"}, {"--eval-tokens", "-5"}, {"--qb-ema", "1"}})
    EXPECT_THAT(error_line(run_k3(with(train_args(run), {flag, value}))), HasSubstr(flag)) << flag;
  // Integers that do not fit are refused, not saturated; negative unsigned ones are not wrapped.
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--tokens", "99999999999999999999"}))),
              AllOf(HasSubstr("--tokens"), HasSubstr("out of range")));
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--seed", "-1"}))),
              AllOf(HasSubstr("--seed"), HasSubstr("non-negative")));
  EXPECT_THAT(error_line(run_k3({"generate", "--max-new-tokens", "1e3"})), HasSubstr("--max-new-tokens"));
  // Special ids outside the vocabulary, in a config and in a shard.
  const fs::path m = copy_model(d);
  edit_config(m, [](json& t) { t["eos_token_id"] = 5000; });
  EXPECT_THAT(error_line(run_k3({"logits", "--model", m.string(), "--ids", "1", "--out", d.file("o")})),
              AllOf(HasSubstr("eos_token_id"), HasSubstr("outside the vocabulary")));
  k3::train::write_token_shard(d.file("eod.bin"), {1, 2, 3, 4, 5000}, 5000);
  EXPECT_THAT(error_line(run_k3(with(train_args(run), {"--data", d.file("eod.bin")}))),
              AllOf(HasSubstr("eod.bin"), HasSubstr("end-of-document id 5000")));
}

// ---- D15: a shard with nothing to predict --------------------------------------------------------

TEST(Hardening, D15_AShardOfOnlyEndOfDocumentIdsIsRefused) {
  TempDir d("d15");
  k3::train::write_token_shard(d.file("empty.bin"), std::vector<uint32_t>(100, 770), 770);
  EXPECT_THAT(error_line(run_k3(with(train_args(d.file("run")), {"--data", d.file("empty.bin")}))),
              AllOf(HasSubstr("empty.bin"), HasSubstr("nothing to predict")));
}

// ---- D16: safetensors headers -------------------------------------------------------------------

TEST(Hardening, D16_DuplicateNamesAndUnreferencedBytesAreRefused) {
  TempDir d("d16");
  const std::string path = d.file("t.safetensors"), data(16, '\0');
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string b = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]})";
  k3test::write_bytes(path, k3test::st_bytes("{" + a + "," + b + "}", data));
  EXPECT_THAT(error_of([&] { k3::SafeTensors::open(path); }), AllOf(HasSubstr(path), HasSubstr("\"a\" appears twice")));
  const std::string c = R"("c":{"dtype":"F32","shape":[2],"data_offsets":[8,16]})";
  k3test::write_bytes(path, k3test::st_bytes("{" + c + "}", data));  // bytes 0..8 belong to nothing
  EXPECT_THAT(error_of([&] { k3::SafeTensors::open(path); }),
              HasSubstr("bytes 0..8 of the data section belong to no tensor"));
  k3test::write_bytes(path, k3test::st_bytes("{" + a + "}", data));  // bytes 8..16 trail
  EXPECT_THAT(error_of([&] { k3::SafeTensors::open(path); }), HasSubstr("the last 8 bytes of the file"));
}

// ---- D17: a mapped input that shrinks ------------------------------------------------------------

TEST(HardeningDeathTest, D17_ATruncatedMappedInputIsNamedNotABareSigbus) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempDir d("d17");
  const std::string path = d.file("weights.bin");
  write_text(path, std::string(1 << 16, 'x'));
  EXPECT_EXIT(
      {
        k3::MappedFile f(path, "model weights");
        if (::truncate(path.c_str(), 0) != 0) std::abort();
        volatile uint8_t sink = f.data()[1 << 15];  // a page that no longer exists
        (void)sink;
        std::exit(0);
      },
      ::testing::ExitedWithCode(1), "error: .*weights.bin: the file was truncated or overwritten while k3 had it");
}

// ---- D18: a tokenizer_config.json without K3's control tokens ------------------------------------

TEST(Hardening, D18_ATokenizerConfigWithoutEndOfMsgIsRefused) {
  TempDir d("d18");
  const fs::path tok = d.path() / "tok";
  fs::create_directories(tok);
  fs::copy_file(corpus().tok + "/tiktoken.model", tok / "tiktoken.model");
  json cfg = json::parse(k3::k3_tokenizer_config_json(768));
  cfg["added_tokens_decoder"].erase("770");  // <|end_of_msg|> = 768 + 2
  write_text(tok / "tokenizer_config.json", cfg.dump());
  EXPECT_THAT(error_of([&] { k3::Tokenizer::load_dir(tok.string()); }),
              AllOf(HasSubstr("tokenizer_config.json"), HasSubstr("<|end_of_msg|> at id 770")));
  write_text(d.path() / "doc.txt", "hello\n");
  EXPECT_THAT(error_line(run_k3({"data", "--tokenizer", tok.string(), "--out", d.file("s.bin"), d.file("doc.txt")})),
              HasSubstr("<|end_of_msg|>"));
}
