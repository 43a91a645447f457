// A tiny training corpus and the `k3 train` arguments the training-loop tests share.
#pragma once
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli.h"
#include "compare.h"
#include "temp_dir.h"
#include "tiny_tokenizer.h"

namespace k3test {

// A shard of English documents tokenised with the first 768 o200k ranks (+256 specials = the
// fixture's vocabulary of 1024).
struct Corpus {
  k3test::TempDir dir{"train_loop"};
  std::string shard;
  Corpus() {
    write_tiny_tokenizer(dir.path() / "tok");
    std::vector<std::string> args = {"data", "--tokenizer", dir.file("tok"), "--out", dir.file("shard.bin")};
    for (int d = 0; d < 6; ++d) {
      const std::string f = dir.file(std::string("doc").append(std::to_string(d)).append(".txt"));
      std::ofstream t(f);
      for (int r = 0; r < 20; ++r)
        t << "the cat sat on the mat and the dog sat on the log. " << (d % 2 ? "a bird flew over the tree. " : "")
          << "numbers " << r << " and " << d << " repeat.\n";
      args.push_back(f);
    }
    const k3test::Outcome r = run_k3(args);
    if (r.status != 0) throw std::runtime_error(r.output);
    shard = dir.file("shard.bin");
  }
};

inline std::vector<std::string> train_args(const Corpus& c, const std::string& out) {
  return {"train",
          "--config",
          fixture("k3-tiny-a/config.json"),
          "--data",
          c.shard,
          "--out",
          out,
          "--stages",
          "32:768,64:768",
          "--tokens-per-step",
          "128",
          "--save-every",
          "1",
          "--lr",
          "3e-3",
          "--seed",
          "3"};
}

// One number of every step record of a run's metrics.jsonl (the held-out records have no "loss", "grad_norm", ...).
inline std::vector<double> step_metric(const std::string& out, const char* key) {
  std::vector<double> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json r = nlohmann::json::parse(line);
    if (r.contains(key)) v.push_back(r[key].get<double>());
  }
  return v;
}

inline std::vector<double> losses(const std::string& out) { return step_metric(out, "loss"); }

// The held-out records of metrics.jsonl: (step, eval_loss).
inline std::vector<std::pair<int64_t, double>> eval_losses(const std::string& out) {
  std::vector<std::pair<int64_t, double>> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    const nlohmann::json r = nlohmann::json::parse(line);
    if (r.contains("eval_loss")) v.emplace_back(r["step"].get<int64_t>(), r["eval_loss"].get<double>());
  }
  return v;
}

}  // namespace k3test
