// Constrained decoding's cost per token (serve/turn_constraint.h): the time to build the vocabulary's
// byte trie once, and to mask one step's logits in each kind of state a JSON reply passes through
// (structure, inside a string, object keys, a number). Median of --reps masks.
//
//   build/bench_serve_mask [--ranks tests/fixtures/tokenizer/o200k.tiktoken] [--reps 20]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#if defined(K3_HAVE_SERVE)
#include "serve/turn_constraint.h"
#include "tokenizer/tokenizer.h"

using namespace k3;
using namespace k3::serve;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  CLI::App app{"constrained decoding: trie build and per-token mask time"};
  std::string ranks = std::string(K3_SOURCE_DIR_FOR_BENCH) + "/tests/fixtures/tokenizer/o200k.tiktoken";
  int reps = 20;
  app.add_option("--ranks", ranks, "a tiktoken ranks file")->capture_default_str();
  app.add_option("--reps", reps, "masks timed per state")->check(CLI::PositiveNumber)->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const Tokenizer tok = Tokenizer::load(ranks);
    auto t0 = Clock::now();
    const TokenTrie trie(tok);
    const double build_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    std::printf("vocabulary: %lld ranks, trie of %zu nodes built in %.1f ms\n", (long long)tok.num_ranks(),
                trie.nodes().size(), build_ms);
    const auto schema = std::make_shared<const JsonSchema>(JsonSchema::compile(nlohmann::json::parse(
        R"({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name"], "additionalProperties": false})")));
    TurnConstraint c(tok, trie, TurnSpec{false, schema, {}});
    std::vector<float> logits(size_t(tok.vocab_size()), 0.0f);
    std::printf("%-24s %10s %10s\n", "state", "mask ms", "allowed");
    auto time_state = [&](const char* what, const std::string& then) {
      std::vector<double> ms;
      int allowed = 0;
      for (int r = 0; r < reps; ++r) {
        std::vector<float> l = logits;
        const auto a = Clock::now();
        c.mask(l.data(), int64_t(l.size()));
        ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
        allowed = int(std::count(l.begin(), l.end(), 0.0f));
      }
      std::nth_element(ms.begin(), ms.begin() + long(ms.size() / 2), ms.end());
      std::printf("%-24s %10.3f %10d\n", what, ms[ms.size() / 2], allowed);
      for (int32_t id : tok.encode(then, false))
        if (!c.accept(id)) throw std::runtime_error("the bench's text left the grammar");
    };
    time_state("object start", "{\"name\":\"");
    time_state("inside a string", "Bob\",");
    time_state("object keys", "\"n\":");
    time_state("integer", "1");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
#else
int main() {
  std::puts("bench_serve_mask: this build has no k3 serve (libcpp-httplib-dev)");
  return 0;
}
#endif
