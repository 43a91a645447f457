// k3 eval (src/eval, src/cli/cmd_eval.cpp), against independent truths:
//  - nll_sum on hand-made logits (log 2, log 3 by hand);
//  - heldout_loss against a direct sum of log-softmax over Model::forward, each document piece run
//    alone with its own cache, the pieces cut by a separate, plain loop in the test;
//  - expert-load statistics against hand counts, and the hooks' totals against tokens x k;
//  - greedy_continuations (batched) against model/generate.h's greedy decoding of each prompt alone;
//  - retrieval scoring is an exact text match, reproducible from its seeds; the numbers it reports
//    are consistent with the per-sample details (no accuracy value is assumed: the fixture is untrained);
//  - metrics.jsonl parsing; the CLI writes parseable eval.json whose loss equals the library's, the
//    PNGs when gnuplot is there, the data/scripts and a clear note when it is not, and clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "eval/eval.h"
#include "eval/plots.h"
#include "eval/run_metrics.h"
#include "model/generate.h"
#include "tokenizer/bpe_train.h"
#include "train/data.h"
#include "util/cli.h"
#include "util/fixture.h"
#include "util/temp_dir.h"

using namespace k3;

namespace {

constexpr uint32_t kEod = 1000;  // the fixture's vocabulary is 1024

// Hand-made ids: documents of various lengths (one of a single token) separated by kEod.
std::vector<uint32_t> hand_tokens() {
  std::vector<uint32_t> t;
  const int lens[] = {37, 1, 90, 12, 55, 3, 70};
  uint32_t x = 7;
  for (int n : lens) {
    for (int i = 0; i < n; ++i) {
      x = (x * 1103515245u + 12345u) & 0x7fffffffu;
      t.push_back(x % 900);
    }
    t.push_back(kEod);
  }
  return t;
}

double direct_nll(Model& m, const std::vector<int32_t>& seq) {
  SequenceCache c = m.new_cache();
  const std::vector<float> logits = m.forward({&c}, {seq}, true);
  const int64_t V = m.config().vocab_size;
  double sum = 0;
  for (size_t t = 0; t + 1 < seq.size(); ++t) {
    long double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp((long double)logits[t * V + v]);
    sum += double(std::log(z) - (long double)logits[t * V + seq[t + 1]]);
  }
  return sum;
}

// A byte-level tokenizer (256 ranks + 256 specials = 512 ids, inside the fixture's 1024).
void write_byte_tokenizer(const std::string& dir) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.push_back(std::string(1, char(b)));
  write_tokenizer_dir(dir, tokens);
}

const char kFiller[] =
    "The quick brown fox jumps over the lazy dog.\n"
    "A small river ran past the old mill.\n"
    "She read the letter twice before she answered.\n"
    "Rain fell on the quiet town all night.\n"
    "They walked home along the dark road.\n"
    "The committee met on Tuesday to discuss the budget.\n"
    "Nobody knew where the key had gone.\n"
    "He painted the fence a pale shade of green.\n";

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

TEST(Eval, NllSumMatchesHandValues) {
  // Row 0: two equal logits -> log 2. Row 1: logits {0, log 2, 0}: p(1) = 2/4 -> log 2; p(0) = 1/4 -> log 4.
  const float logits[] = {5.0f, 5.0f, 0.0f, float(std::log(2.0)), 0.0f, 0.0f};
  const int32_t next_a[] = {1, 1};
  EXPECT_NEAR(eval::nll_sum(logits, 1, 2, next_a), std::log(2.0), 1e-6);
  EXPECT_NEAR(eval::nll_sum(logits + 2, 1, 3, next_a + 1), std::log(2.0), 1e-6);
  const int32_t next_b[] = {0};
  EXPECT_NEAR(eval::nll_sum(logits + 2, 1, 3, next_b), std::log(4.0), 1e-6);
  const int32_t bad[] = {3};
  EXPECT_THROW(eval::nll_sum(logits + 2, 1, 3, bad), Error);
}

TEST(Eval, UnigramEntropyMatchesHandValue) {
  const uint32_t t[] = {1, 1, 2, 2, 3, 3, 3, 3};
  EXPECT_NEAR(train::unigram_entropy(t, 8), -(0.25 * std::log(0.25) * 2 + 0.5 * std::log(0.5)), 1e-12);
  EXPECT_EQ(train::unigram_entropy(t, 2), 0.0);
}

TEST(Eval, HeldoutLossEqualsDirectLogSoftmaxSum) {
  Model& m = k3test::tiny();
  k3test::TempDir dir("heldout");
  const std::vector<uint32_t> toks = hand_tokens();
  const std::string shard_path = dir.file("ho.bin");
  train::write_token_shard(shard_path, toks, kEod);
  const train::TokenShard shard = train::TokenShard::open(shard_path);

  const int64_t window = 48, cap = 250;  // cap < shard size: the cut is honoured
  ASSERT_LT(cap, int64_t(toks.size()));
  eval::ExpertLoad load(m.config());
  int64_t calls = 0;
  const eval::HeldoutResult r =
      eval::heldout_loss(k3test::tiny_engine(), shard, cap, window, &load, [&](int64_t, int64_t) { ++calls; });

  // Independent: windows [p, p+window) of the first `cap` tokens, cut after each kEod, 1-token pieces dropped.
  double sum = 0;
  int64_t predictions = 0, sequences = 0, windows = 0;
  for (int64_t p = 0; p + 2 <= cap; p += window) {
    ++windows;
    std::vector<int32_t> cur;
    auto flush = [&] {
      if (cur.size() >= 2) {
        sum += direct_nll(m, cur);
        predictions += int64_t(cur.size()) - 1;
        ++sequences;
      }
      cur.clear();
    };
    for (int64_t i = p; i < std::min(p + window, cap); ++i) {
      cur.push_back(int32_t(toks[size_t(i)]));
      if (toks[size_t(i)] == kEod) flush();
    }
    flush();
  }
  EXPECT_EQ(r.tokens, cap);
  EXPECT_EQ(r.windows, windows);
  EXPECT_EQ(calls, windows);
  EXPECT_EQ(r.sequences, sequences);
  EXPECT_EQ(r.predictions, predictions);
  EXPECT_NEAR(r.loss, sum / double(predictions), 1e-4 * std::abs(sum / double(predictions)));
  EXPECT_NEAR(r.perplexity, std::exp(r.loss), 1e-9 * r.perplexity);
  EXPECT_NEAR(r.unigram_entropy, train::unigram_entropy(toks.data(), cap), 1e-12);

  // Every token of every run piece is routed to k experts in every MoE layer.
  int64_t routed_tokens = 0;
  for (int64_t p = 0; p + 2 <= cap; p += window)
    for (const auto& piece : train::window_pieces(shard, p, std::min(window, cap - p)))
      routed_tokens += int64_t(piece.size());
  const auto stats = load.stats();
  ASSERT_FALSE(stats.empty());
  for (const auto& s : stats) {
    EXPECT_TRUE(m.config().is_moe_layer(s.layer));
    EXPECT_EQ(s.assignments, routed_tokens * m.config().num_experts_per_token) << "layer " << s.layer;
    double share_sum = 0;
    for (double x : s.share) share_sum += x;
    EXPECT_NEAR(share_sum, 1.0, 1e-12);
  }
}

TEST(Eval, ExpertLoadStatisticsMatchHandCounts) {
  // counts {4,2,2,0}: 8 assignments, mean 2, MaxVio 4/2-1 = 1, shares 0.5/0.25/0.25/0, one unused.
  const auto s = eval::load_stats(3, {4, 2, 2, 0});
  EXPECT_EQ(s.layer, 3);
  EXPECT_EQ(s.assignments, 8);
  EXPECT_DOUBLE_EQ(s.max_vio, 1.0);
  EXPECT_DOUBLE_EQ(s.max_share, 0.5);
  EXPECT_DOUBLE_EQ(s.min_share, 0.0);
  EXPECT_EQ(s.unused_experts, 1);
  EXPECT_EQ(s.share, (std::vector<double>{0.5, 0.25, 0.25, 0.0}));
  // Perfect balance: MaxVio 0.
  EXPECT_DOUBLE_EQ(eval::load_stats(1, {3, 3, 3}).max_vio, 0.0);

  // Through add(): rows x k ids of one MoE layer, counted per expert; a dense layer is refused.
  const K3Config& c = k3test::tiny().config();
  eval::ExpertLoad load(c);
  ASSERT_FALSE(load.moe_layers().empty());
  const int64_t l = load.moe_layers()[0];
  const int32_t idx[] = {0, 1, 1, 2, 0, 1};  // 3 rows, k = 2
  load.add(l, idx, 3, 2);
  const auto st = load.stats()[0];
  EXPECT_EQ(st.counts[0], 2);
  EXPECT_EQ(st.counts[1], 3);
  EXPECT_EQ(st.counts[2], 1);
  EXPECT_EQ(st.assignments, 6);
  EXPECT_NEAR(st.max_vio, 3.0 / (6.0 / double(c.num_experts)) - 1.0, 1e-12);
  EXPECT_EQ(st.unused_experts, c.num_experts - 3);
  if (c.first_k_dense_replace > 0) {
    EXPECT_THROW(load.add(0, idx, 3, 2), Error);
  }
  const int32_t out_of_range[] = {int32_t(c.num_experts)};
  EXPECT_THROW(load.add(l, out_of_range, 1, 1), Error);
}

TEST(Eval, ExactMatchIsVerbatim) {
  EXPECT_TRUE(eval::exact_match(" 71432", " 71432"));
  EXPECT_FALSE(eval::exact_match("71432", " 71432"));
  EXPECT_FALSE(eval::exact_match(" 71432.", " 71432"));
  EXPECT_FALSE(eval::exact_match(" 71433", " 71432"));
  EXPECT_FALSE(eval::exact_match("", " 71432"));
}

TEST(Eval, BatchedGreedyEqualsGenerateOneByOne) {
  const std::vector<std::vector<int32_t>> prompts = {{203, 802, 2, 239, 451},
                                                     {17, 5},
                                                     {900, 901, 902, 3, 4, 5, 6, 7, 8, 9, 10}};
  const auto batched = eval::greedy_continuations(k3test::tiny_engine(), prompts, 6);
  ASSERT_EQ(batched.size(), prompts.size());
  for (size_t b = 0; b < prompts.size(); ++b) {
    Sampler s(SamplingParams{});
    const GenerateResult g = generate(k3test::tiny_engine(), prompts[b], 6, s);
    // generate() stops on eos; compare the common prefix (and it must be all of g's tokens).
    ASSERT_LE(g.tokens.size(), batched[b].size());
    EXPECT_EQ(std::vector<int32_t>(batched[b].begin(), batched[b].begin() + int64_t(g.tokens.size())), g.tokens)
        << "prompt " << b;
  }
}

TEST(Eval, RetrievalIsReproducibleAndConsistent) {
  k3test::TempDir dir("retrieval");
  write_byte_tokenizer(dir.path().string());
  const Tokenizer tok = Tokenizer::load_dir(dir.path().string());
  const data::RetrievalTaskGenerator gen(tok, {kFiller});
  const int64_t len = gen.min_tokens(data::RetrievalTask::Passkey) + 40;
  const auto a = eval::retrieval_accuracy(k3test::tiny_engine(), tok, gen, data::RetrievalTask::Passkey, len, 3);
  const auto b = eval::retrieval_accuracy(k3test::tiny_engine(), tok, gen, data::RetrievalTask::Passkey, len, 3);
  ASSERT_FALSE(a.skipped);
  EXPECT_EQ(a.task, "passkey");
  EXPECT_EQ(a.samples, 3);
  ASSERT_EQ(a.details.size(), 3u);
  int64_t correct = 0;
  double depth = 0;
  for (size_t i = 0; i < a.details.size(); ++i) {
    const auto& s = a.details[i];
    EXPECT_EQ(s.seed, eval::retrieval_seed(data::RetrievalTask::Passkey, len, int64_t(i)));
    EXPECT_LE(s.prompt_tokens, len);
    EXPECT_GE(s.depth, 0.0);
    EXPECT_LE(s.depth, 1.0);
    EXPECT_EQ(s.answer[0], ' ');
    EXPECT_EQ(s.correct, eval::exact_match(s.output, s.answer));
    // Byte tokenizer: the answer is one token per byte, so as many tokens were decoded (each a byte,
    // or "<id>" for an id past the tokenizer's 512: the untrained fixture emits such ids).
    EXPECT_GE(s.output.size(), s.answer.size()) << s.output;
    EXPECT_EQ(s.output, b.details[i].output);
    EXPECT_EQ(s.answer, b.details[i].answer);
    correct += s.correct;
    depth += s.depth;
  }
  EXPECT_EQ(a.correct, correct);
  EXPECT_DOUBLE_EQ(a.accuracy, double(correct) / 3.0);
  EXPECT_NEAR(a.mean_depth, depth / 3.0, 1e-12);
  // Samples differ from each other (different seeds).
  EXPECT_NE(a.details[0].answer, a.details[1].answer);
  // Too short for the fixed text: skipped with a note, not an error.
  const auto s = eval::retrieval_accuracy(k3test::tiny_engine(), tok, gen, data::RetrievalTask::MultiKey, 20, 3);
  EXPECT_TRUE(s.skipped);
  EXPECT_NE(s.note.find("minimum"), std::string::npos);
}

TEST(Eval, RunMetricsParse) {
  k3test::TempDir dir("metrics");
  std::ofstream(dir.file("metrics.jsonl"))
      << R"({"step":1,"loss":7.5,"max_vio":[1.0,2.0],"seq_len":64,"stage":0,"tokens":4096,"skipped":false})"
         "\n"
      << R"({"step":2,"loss":null,"max_vio":[0.5,1.5],"seq_len":64,"stage":0,"tokens":8192,"skipped":true})"
         "\n"
      << R"({"step":3,"loss":6.5,"max_vio":[0.25,0.75],"seq_len":256,"stage":1,"tokens":12288,"skipped":false})"
         "\n"
      << R"({"step":3,"eval_loss":6.25,"eval_predictions":100,"unigram_entropy":5.5})"
         "\n"
      << R"({"step":4,"loss":6.)";  // torn last line of a run in progress
  const eval::RunMetrics r = eval::read_run_metrics(dir.path().string());
  ASSERT_EQ(r.steps.size(), 3u);
  EXPECT_EQ(r.steps[0].max_vio, (std::vector<double>{1.0, 2.0}));
  EXPECT_TRUE(std::isnan(r.steps[1].loss));
  EXPECT_EQ(r.steps[2].seq_len, 256);
  ASSERT_EQ(r.evals.size(), 1u);
  EXPECT_DOUBLE_EQ(r.evals[0].eval_loss, 6.25);
  EXPECT_EQ(r.trained_length(), 256);
  EXPECT_EQ(r.trained_length(2), 64);
  EXPECT_EQ(r.last_seq_len(), 256);
  EXPECT_EQ(r.tokens_at(3), 12288);
  EXPECT_EQ(eval::checkpoint_step("/x/run/step-00000050"), 50);
  EXPECT_EQ(eval::checkpoint_step("/x/run/step-00000050/"), 50);
  EXPECT_EQ(eval::checkpoint_step("/x/run/model"), -1);

  std::ofstream(dir.file("bad.jsonl")) << "{\"step\":1}\nnot json\n{\"step\":2}\n";
  try {
    eval::read_run_metrics(dir.file("bad.jsonl"));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.jsonl:2"), std::string::npos) << e.what();
  }
}

// The whole command on the fixture model: eval.json parses, its held-out loss is the library's, and
// the plots are drawn (when gnuplot is installed) or skipped with a note (when it is not).
TEST(EvalCli, WritesJsonAndPlots) {
  Model& m = k3test::tiny();
  k3test::TempDir dir("cli");
  write_byte_tokenizer(dir.file("tok"));
  std::filesystem::create_directories(dir.file("filler"));
  std::ofstream(dir.file("filler/a.txt")) << kFiller;
  const std::vector<uint32_t> toks = hand_tokens();
  train::write_token_shard(dir.file("ho.bin"), toks, kEod);
  std::filesystem::create_directories(dir.file("run"));
  {
    std::ofstream f(dir.file("run/metrics.jsonl"));
    for (int s = 1; s <= 30; ++s)
      f << nlohmann::json({{"step", s},
                           {"loss", 7.0 - 0.05 * s},
                           {"max_vio", {1.0 / s, 2.0 / s}},
                           {"seq_len", s <= 15 ? 64 : 128},
                           {"tokens", 4096 * s},
                           {"stage", s <= 15 ? 0 : 1},
                           {"skipped", false}})
               .dump()
        << "\n";
    f << R"({"step":30,"eval_loss":6.0,"eval_predictions":10,"unigram_entropy":5.0})"
         "\n";
  }
  const Tokenizer tok = Tokenizer::load_dir(dir.file("tok"));
  const int64_t len = data::RetrievalTaskGenerator(tok, {kFiller}).min_tokens(data::RetrievalTask::Passkey) + 16;
  const std::vector<std::string> args = {"eval",
                                         "--model",
                                         k3test::fixture("k3-tiny-a"),
                                         "--tokenizer",
                                         dir.file("tok"),
                                         "--heldout",
                                         dir.file("ho.bin"),
                                         "--filler",
                                         dir.file("filler"),
                                         "--run",
                                         dir.file("run"),
                                         "--lengths",
                                         std::to_string(len) + ",40",
                                         "--samples",
                                         "2",
                                         "--heldout-tokens",
                                         "200",
                                         "--out",
                                         dir.file("out")};
  const k3test::Outcome r = k3test::run_k3(args);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("held-out:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("retrieval accuracy"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("training length L = 128"), std::string::npos) << r.output;

  const nlohmann::json j = nlohmann::json::parse(read(dir.file("out/eval.json")));
  EXPECT_EQ(j["train_length"], 128);
  const train::TokenShard shard = train::TokenShard::open(dir.file("ho.bin"));
  const eval::HeldoutResult h = eval::heldout_loss(k3test::tiny_engine(), shard, 200, 128);
  EXPECT_NEAR(j["heldout"]["loss"].get<double>(), h.loss, 1e-6 * h.loss);  // not bit-exact: BLAS kernels may differ
  EXPECT_EQ(j["heldout"]["predictions"].get<int64_t>(), h.predictions);
  EXPECT_EQ(j["expert_load"]["layers"].size(), eval::ExpertLoad(m.config()).moe_layers().size());
  ASSERT_EQ(j["retrieval"]["results"].size(), 4u);  // passkey, multikey x 2 lengths
  int skipped = 0;
  for (const auto& p : j["retrieval"]["results"]) {
    skipped += p["skipped"].get<bool>();
    if (!p["skipped"].get<bool>()) {
      EXPECT_EQ(p["details"].size(), 2u);
    }
  }
  EXPECT_GE(skipped, 2);  // 40 tokens hold neither task; multikey needs more than passkey
  EXPECT_EQ(j["run"]["steps"], 30);

  const bool have_gnuplot = !eval::find_gnuplot().empty();
  for (const char* name : {"loss", "maxvio", "retrieval", "expert_load"}) {
    EXPECT_TRUE(std::filesystem::exists(dir.file(std::string("out/plot-data/") + name + ".gp"))) << name;
    if (have_gnuplot) {
      const std::string png = read(dir.file(std::string("out/") + name + ".png"));
      ASSERT_GT(png.size(), 1000u) << name << "\n" << r.output;
      EXPECT_EQ(png.substr(1, 3), "PNG") << name;
    }
  }

  // A relative --out (as scripts/run.sh passes it): the plots are drawn all the same.
  if (have_gnuplot) {
    const k3test::Outcome rel =
        k3test::run_shell("cd " + k3test::shell_quote(dir.path().string()) + " && " +
                          k3test::k3_command({"eval", "--model", k3test::fixture("k3-tiny-a"), "--heldout", "ho.bin",
                                              "--train-length", "64", "--heldout-tokens", "100", "--out", "rel/out"}));
    ASSERT_EQ(rel.status, 0) << rel.output;
    EXPECT_EQ(rel.output.find("gnuplot failed"), std::string::npos) << rel.output;
    EXPECT_GT(read(dir.file("rel/out/expert_load.png")).size(), 1000u) << rel.output;
  }

  // No gnuplot: JSON and data still written, PNGs skipped with the install hint.
  const k3test::Outcome n = k3test::run_shell(
      "K3_GNUPLOT=/nonexistent/gnuplot " + k3test::shell_quote(K3_BINARY) + " eval --model " +
      k3test::shell_quote(k3test::fixture("k3-tiny-a")) + " --heldout " + k3test::shell_quote(dir.file("ho.bin")) +
      " --train-length 64 --heldout-tokens 100 --out " + k3test::shell_quote(dir.file("out2")));
  ASSERT_EQ(n.status, 0) << n.output;
  EXPECT_NE(n.output.find("apt-get install gnuplot-nox"), std::string::npos) << n.output;
  EXPECT_TRUE(std::filesystem::exists(dir.file("out2/eval.json")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("out2/plot-data/expert_load.gp")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("out2/expert_load.png")));
  EXPECT_NE(n.output.find("skipped loss.png: no --run"), std::string::npos) << n.output;
}

TEST(EvalCli, ClearErrors) {
  k3test::TempDir dir("errors");
  auto run = [](const std::vector<std::string>& a) { return k3test::run_k3(a); };
  const std::string model = k3test::fixture("k3-tiny-a");

  auto r = run({"eval", "--model", dir.file("nope"), "--heldout", "x", "--train-length", "64"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--model " + dir.file("nope") + ": no such directory"), std::string::npos) << r.output;

  r = run({"eval", "--model", dir.path().string(), "--heldout", "x", "--train-length", "64"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("not a checkpoint (no config.json)"), std::string::npos) << r.output;

  r = run(
      {"eval", "--model", model, "--heldout", dir.file("missing.bin"), "--train-length", "64", "--out", dir.file("o")});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--heldout " + dir.file("missing.bin") + ": no such file"), std::string::npos) << r.output;

  train::write_token_shard(dir.file("ho.bin"), {1, 2, 3, kEod}, kEod);
  r = run({"eval", "--model", model, "--heldout", dir.file("ho.bin"), "--out", dir.file("o")});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("give --train-length"), std::string::npos) << r.output;

  r = run({"eval", "--model", model, "--train-length", "64"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("nothing to evaluate"), std::string::npos) << r.output;

  r = run({"eval", "--model", model, "--filler", dir.file("nofiller"), "--train-length", "64", "--out", dir.file("o")});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("no tiktoken.model"), std::string::npos) << r.output;

  r = run({"eval", "--model", model, "--filler", dir.file("x"), "--lengths", "64,abc", "--out", dir.file("o")});
  EXPECT_EQ(r.status, 1);
}
