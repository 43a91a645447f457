// A tiny supervised fine-tuning setup the `k3 sft` tests share: a model directory of k3-tiny-a's config initialised
// as `k3 init` does (seed 1) with the tiny tokenizer, and chat conversations (JSONL) in which a user asks for the sum
// of two digits and the assistant answers, with its reasoning in the think channel. (Not the fixture's own weights:
// they amplify a relative perturbation up to ~2e5-fold, docs/NUMERICS.md, so an fp32 run could not follow a float64
// one over several updates.)
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "compare.h"
#include "model/init_random.h"
#include "temp_dir.h"
#include "tiny_tokenizer.h"

namespace k3test {

// n conversations from `seed`, one JSON object per line.
inline std::string addition_conversations(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out;
  for (int i = 0; i < n; ++i) {
    const int a = int(rng() % 10), b = int(rng() % 10);
    const nlohmann::ordered_json conv = {
        {"messages",
         {{{"role", "user"}, {"content", "What is " + std::to_string(a) + " plus " + std::to_string(b) + "?"}},
          {{"role", "assistant"},
           {"reasoning_content", std::to_string(a) + " + " + std::to_string(b)},
           {"content", std::to_string(a + b)}}}}};
    out += conv.dump() + "\n";
  }
  return out;
}

struct SftCorpus {
  TempDir dir{"sft"};
  std::string model, train, held_out;
  SftCorpus() {
    model = dir.file("model");
    k3::RandomInitOptions opt;
    opt.seed = 1;
    k3::write_random_model(fixture("k3-tiny-a/config.json"), model, opt);
    write_tiny_tokenizer(model);
    train = dir.file("train.jsonl"), held_out = dir.file("held_out.jsonl");
    std::ofstream(train) << addition_conversations(48, 1);
    std::ofstream(held_out) << addition_conversations(16, 2);
  }
};

inline std::vector<std::string> sft_args(const SftCorpus& c, const std::string& out) {
  // clang-format off
  return {"sft", "--model", c.model, "--data", c.train, "--out", out,
          "--epochs", "3", "--tokens-per-step", "512", "--lr", "3e-3", "--seed", "5",
          "--grad-lanes", "2", "--save-every", "1", "--eval-data", c.held_out};
  // clang-format on
}

}  // namespace k3test
