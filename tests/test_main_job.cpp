// The main job (scripts/run.sh) at micro scale, through the k3 binary: every component together.
// A Brown-format corpus is synthesised (tagged sentences over a random lexicon), then exactly the
// demo's chain runs: k3 corpus brown -> k3 tokenizer train -> k3 corpus retrieval -> k3 data ->
// k3 train (curriculum, Quantile Balancing, held-out eval) -> k3 generate -> k3 eval. Each step must
// succeed and hand the next what it needs; eval.json must report the held-out loss, retrieval at
// 1/4..4x the last training length, and the expert load of every MoE layer.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "train/checkpoint.h"
#include "util/cli.h"
#include "util/compare.h"
#include "util/temp_dir.h"

using k3test::fixture;
using k3test::run_k3;
namespace fs = std::filesystem;

namespace {

// 14 samples in two genres; sentences of words drawn from a 300-word random lexicon, tagged.
void write_fake_brown(const fs::path& dir) {
  fs::create_directories(dir);
  std::mt19937 rng(11);
  std::vector<std::string> lexicon;
  for (int i = 0; i < 300; ++i) {
    std::string w;
    for (int n = 3 + int(rng() % 6); n > 0; --n) w += char('a' + rng() % 26);
    lexicon.push_back(w);
  }
  std::ofstream cats(dir / "cats.txt");
  for (int s = 0; s < 14; ++s) {
    const std::string id = std::string(s < 7 ? "ca" : "cb") + "0" + std::to_string(s % 7 + 1);
    cats << id << (s < 7 ? " news\n" : " fiction\n");
    std::ofstream f(dir / id);
    for (int line = 0; line < 60; ++line) {
      f << "\n\n\t";
      const int words = 6 + int(rng() % 10);
      for (int w = 0; w < words; ++w) {
        std::string word = lexicon[rng() % lexicon.size()];
        if (w == 0) word[0] = char(word[0] - 'a' + 'A');
        f << word << "/nn ";
        if (w == words / 2) f << ",/, ";
      }
      f << "./.\n";
    }
  }
}

void ok(const std::vector<std::string>& args) {
  const k3test::Outcome r = run_k3(args);
  ASSERT_EQ(r.status, 0) << r.command << "\n" << r.output;
}

std::vector<std::string> txt_files(const fs::path& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".txt") v.push_back(e.path().string());
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

TEST(MainJob, EveryStepOfTheDemoChainAtMicroScale) {
  k3test::TempDir d("main_job");
  const fs::path root = d.path();
  write_fake_brown(root / "brown-npm");

  const std::string brown = (root / "brown").string(), train_docs = (root / "brown" / "train").string();
  const std::string tok = (root / "tok").string(), tasks = (root / "tasks").string();
  ASSERT_NO_FATAL_FAILURE(
      ok({"corpus", "brown", "--from", (root / "brown-npm").string(), "--out", brown, "--heldout-every", "7"}));
  ASSERT_EQ(txt_files(root / "brown" / "train").size(), 12u);
  ASSERT_EQ(txt_files(root / "brown" / "heldout").size(), 2u);

  // The fixture model's vocabulary: 768 ranks + 256 specials = 1024.
  std::vector<std::string> tok_args = {"tokenizer", "train", "--vocab-size", "768", "--out", (root / "tok").string(),
                                       "--corpus"};
  for (const std::string& f : txt_files(root / "brown" / "train")) tok_args.push_back(f);
  ASSERT_NO_FATAL_FAILURE(ok(tok_args));

  // The fixed text of a task is long in a 768-rank vocabulary learned on random words: ~140 tokens.
  ASSERT_NO_FATAL_FAILURE(ok({"corpus", "retrieval", "--task", "passkey", "--filler", train_docs, "--tokenizer", tok,
                              "--out", tasks, "--count", "12", "--max-tokens", "200"}));
  ASSERT_NO_FATAL_FAILURE(ok({"corpus", "retrieval", "--task", "multikey", "--keys", "2", "--filler", train_docs,
                              "--tokenizer", tok, "--out", tasks, "--count", "8", "--max-tokens", "220"}));
  ASSERT_EQ(txt_files(root / "tasks").size(), 20u);

  std::vector<std::string> data_args = {"data", "--tokenizer", (root / "tok").string(), "--out",
                                        (root / "train.bin").string()};
  for (const auto& dir : {root / "brown" / "train", root / "tasks"})
    for (const std::string& f : txt_files(dir)) data_args.push_back(f);
  ASSERT_NO_FATAL_FAILURE(ok(data_args));
  std::vector<std::string> held_args = {"data", "--tokenizer", (root / "tok").string(), "--out",
                                        (root / "heldout.bin").string()};
  for (const std::string& f : txt_files(root / "brown" / "heldout")) held_args.push_back(f);
  ASSERT_NO_FATAL_FAILURE(ok(held_args));

  const std::string run = (root / "run").string();
  ASSERT_NO_FATAL_FAILURE(
      ok({"train", "--config", fixture("k3-tiny-a/config.json"), "--data", (root / "train.bin").string(), "--eval-data",
          (root / "heldout.bin").string(), "--eval-tokens", "512", "--out", run, "--stages", "32:256,64:256",
          "--tokens-per-step", "128", "--balance", "qb-exact", "--save-every", "2"}));
  const std::string ckpt = k3::train::latest_checkpoint(run);
  ASSERT_EQ(fs::path(ckpt).filename(), "step-00000004");

  const k3test::Outcome g = run_k3({"generate", "--model", ckpt, "--tokenizer", (root / "tok").string(), "--prompt",
                                    "The", "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "40"});
  ASSERT_EQ(g.status, 0) << g.output;
  EXPECT_NE(g.output.find("generated: 6 tokens"), std::string::npos) << g.output;

  ASSERT_NO_FATAL_FAILURE(ok({"eval", "--model", run, "--tokenizer", tok, "--heldout", (root / "heldout.bin").string(),
                              "--heldout-tokens", "512", "--filler", (root / "brown" / "heldout").string(), "--samples",
                              "2", "--out", (root / "eval").string(), "--no-plots"}));
  std::ifstream in(root / "eval" / "eval.json");
  const nlohmann::json J = nlohmann::json::parse(in);
  EXPECT_EQ(J["train_length"].get<int64_t>(), 64);
  EXPECT_TRUE(std::isfinite(J["heldout"]["loss"].get<double>()));
  EXPECT_GT(J["heldout"]["predictions"].get<int64_t>(), 100);
  EXPECT_EQ(J["expert_load"]["layers"].size(), 7u);  // layers 1..7 of the fixture are LatentMoE
  std::vector<int64_t> lengths;
  for (const auto& l : J["retrieval"]["lengths"]) lengths.push_back(l.get<int64_t>());
  EXPECT_EQ(lengths, (std::vector<int64_t>{16, 32, 64, 128, 256}));
}
