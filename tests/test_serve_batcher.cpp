// Continuous batching (serve/batcher.h) on the k3-tiny fixture model on the CPU and on a scripted engine:
//   - sequences generating side by side on their own threads, with prompts of 1 to 70 tokens cut into 7-token
//     chunks between the others' decode steps, get the logits their engine's own session gives for the same
//     tokens (the independent truth), to the last bit: every row of a CPU forward is computed from its own
//     sequence only, whatever else the step holds; and the steps did batch them (sequences per step > 1);
//   - admission: at most max_batch slots, the cache budget counted at full length, first come first served;
//     a sequence that can never fit is an error naming the bytes; an acquire past its deadline gives nullptr;
//   - an engine error fails the appends of that step with a k3::Error and the slot refuses more; the other
//     slots and the batcher go on;
//   - over HTTP: concurrent greedy chat requests each get the reply the same request gets alone, and
//     /metrics shows the batching.
#include <gtest/gtest.h>

#if defined(K3_HAVE_SERVE)
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "model/engine.h"
#include "model/generate.h"
#include "model/sampler.h"
#include "serve/batcher.h"
#include "serve/server.h"
#include "tokenizer/tokenizer.h"
#include "util/compare.h"
#include "util/scripted_engine.h"
#include "util/temp_dir.h"

namespace {

namespace sv = k3::serve;
using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

std::unique_ptr<k3::Engine> tiny_engine() {
  return k3::Engine::load(k3test::fixture("k3-tiny-a"), k3::EngineOptions{});
}

// Greedy generation of n tokens through `append`, every step's logits kept.
struct GreedyRun {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
};
GreedyRun greedy_run(const k3::AppendFn& append, std::vector<int32_t> prompt, int n) {
  GreedyRun r;
  std::vector<float> l = append(prompt);
  for (int i = 0; i < n; ++i) {
    r.logits.push_back(l);
    const int32_t id = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
    r.tokens.push_back(id);
    l = append({id});
  }
  return r;
}

std::vector<int32_t> prompt_of(int len, int seed, int vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < len; ++i) p.push_back(int32_t((seed * 131 + i * 17) % vocab));
  return p;
}

// An engine that fails every forward holding a given first token; otherwise the scripted engine's.
class FailingEngine : public k3test::ScriptedEngine {
 public:
  FailingEngine(const k3::K3Config& cfg, int32_t poison) : ScriptedEngine(cfg, {}), poison_(poison) {}
  std::vector<float> forward(const std::vector<k3::EngineSequence*>& seqs,
                             const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                             const k3::ForwardHooks* hooks = nullptr) override {
    for (const auto& t : tokens)
      if (t.front() == poison_) k3::fail("the engine ran out of memory (a test's failure)");
    return ScriptedEngine::forward(seqs, tokens, all_positions, hooks);
  }

 private:
  int32_t poison_;
};

}  // namespace

TEST(ServeBatcher, ConcurrentSequencesGetTheirSessionsLogits) {
  const auto engine = tiny_engine();
  const int V = int(engine->config().vocab_size);
  const int lens[] = {1, 5, 70, 16, 33, 2};
  const int kSteps = 10;
  // Alone: each prompt through the engine's own session.
  std::vector<GreedyRun> alone;
  for (int s = 0; s < 6; ++s) alone.push_back(greedy_run(engine->session(), prompt_of(lens[s], s, V), kSteps));
  // Together: six threads on one batcher, prompts in 7-token chunks.
  sv::BatcherOptions o;
  o.max_batch = 6;
  o.prefill_chunk = 7;
  o.step_tokens = 20;
  sv::Batcher b(*engine, o);
  std::vector<GreedyRun> together(6);
  std::vector<std::thread> threads;
  for (int s = 0; s < 6; ++s)
    threads.emplace_back([&, s] {
      auto slot = b.acquire(lens[s] + kSteps + 1, Clock::time_point::max());
      together[size_t(s)] = greedy_run(slot->fn(), prompt_of(lens[s], s, V), kSteps);
    });
  for (auto& t : threads) t.join();
  for (int s = 0; s < 6; ++s) {
    SCOPED_TRACE("sequence " + std::to_string(s));
    EXPECT_EQ(together[size_t(s)].tokens, alone[size_t(s)].tokens);
    ASSERT_EQ(together[size_t(s)].logits.size(), alone[size_t(s)].logits.size());
    for (size_t i = 0; i < alone[size_t(s)].logits.size(); ++i)
      EXPECT_EQ(0, std::memcmp(together[size_t(s)].logits[i].data(), alone[size_t(s)].logits[i].data(),
                               size_t(V) * sizeof(float)))
          << "step " << i;
  }
  const sv::Batcher::Stats st = b.stats();
  EXPECT_EQ(st.slots, 0);
  EXPECT_EQ(st.reserved_bytes, 0u);
  EXPECT_GT(st.step_sequences, st.steps) << "the steps batched several sequences";
  int64_t tokens = 0;
  for (int s = 0; s < 6; ++s) tokens += lens[s] + kSteps;
  EXPECT_EQ(st.step_tokens_total, tokens);
}

TEST(ServeBatcher, AdmissionHoldsTheBatchAndTheBudget) {
  const k3::K3Config cfg = tiny_engine()->config();
  k3test::ScriptedEngine engine(cfg, {});
  const size_t per_token = k3test::ScriptedEngine::kBytesPerToken;
  sv::BatcherOptions o;
  o.max_batch = 3;
  o.cache_budget = 100 * per_token;
  sv::Batcher b(engine, o);
  const auto soon = [] { return Clock::now() + std::chrono::milliseconds(50); };
  auto a = b.acquire(60, soon());
  ASSERT_TRUE(a);
  EXPECT_EQ(b.stats().reserved_bytes, 60 * per_token);
  EXPECT_FALSE(b.acquire(41, soon())) << "60 + 41 tokens exceed the budget of 100";
  auto c = b.acquire(40, soon());
  ASSERT_TRUE(c);
  EXPECT_THROW(b.acquire(101, soon()), k3::Error) << "could never fit";
  try {
    b.acquire(101, soon());
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(101 * per_token)), std::string::npos) << e.what();
  }
  // Full budget: a waiter is admitted once a slot is released, before a later one.
  std::atomic<int> order{0}, first{0}, second{0};
  std::thread w1([&] {
    auto s = b.acquire(50, Clock::now() + std::chrono::seconds(10));
    first = s ? ++order : -1;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  std::thread w2([&] {
    auto s = b.acquire(10, Clock::now() + std::chrono::seconds(10));
    second = s ? ++order : -1;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_EQ(b.stats().admitting, 2);
  EXPECT_EQ(order.load(), 0) << "10 tokens would fit the budget, but w1 came first";
  a.reset();
  w1.join();
  w2.join();
  EXPECT_EQ(first.load(), 1);
  EXPECT_EQ(second.load(), 2);
  // max_batch: three slots held, a fourth waits.
  c.reset();
  auto s1 = b.acquire(1, soon()), s2 = b.acquire(1, soon()), s3 = b.acquire(1, soon());
  ASSERT_TRUE(s1 && s2 && s3);
  EXPECT_FALSE(b.acquire(1, soon()));
  s2.reset();
  EXPECT_TRUE(b.acquire(1, soon()));
}

TEST(ServeBatcher, AnEngineErrorFailsItsStepOnly) {
  const k3::K3Config cfg = tiny_engine()->config();
  FailingEngine engine(cfg, 7);
  sv::BatcherOptions o;
  o.max_batch = 2;
  o.gather = std::chrono::microseconds(0);  // steps of one sequence each: the poison fails only its own
  sv::Batcher b(engine, o);
  auto bad = b.acquire(4, Clock::time_point::max());
  auto good = b.acquire(4, Clock::time_point::max());
  try {
    bad->append({7, 1});
    ADD_FAILURE() << "the engine error was not reported";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("ran out of memory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(bad->append({1}), k3::Error) << "a failed sequence refuses more";
  const std::vector<float> l = good->append({1, 2});
  EXPECT_EQ(l.size(), size_t(cfg.vocab_size));
  EXPECT_EQ(std::max_element(l.begin(), l.end()) - l.begin(), cfg.eos_token_id) << "the script is empty: eos";
}

TEST(ServeBatcher, StopFailsWhatWaits) {
  const k3::K3Config cfg = tiny_engine()->config();
  k3test::ScriptedEngine engine(cfg, {});
  sv::BatcherOptions o;
  o.max_batch = 1;
  sv::Batcher b(engine, o);
  auto held = b.acquire(4, Clock::time_point::max());
  std::atomic<bool> threw{false};
  std::thread waiter([&] {
    try {
      b.acquire(4, Clock::time_point::max());
    } catch (const k3::Error&) {
      threw = true;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  b.stop();
  waiter.join();
  EXPECT_TRUE(threw.load());
  EXPECT_THROW(held->append({1}), k3::Error);
}

// Concurrent greedy chat requests over HTTP: each gets the reply it gets alone.
TEST(ServeBatcher, ConcurrentRequestsGetTheirOwnReplies) {
  k3test::TempDir dir("serve-batcher");
  std::filesystem::create_directories(dir.path() / "tok");
  {
    std::ifstream in(k3test::fixture("tokenizer/o200k.tiktoken"));
    std::ofstream out(dir.file("tok/tiktoken.model"));
    std::string line;
    for (int i = 0; i < 768 && std::getline(in, line); ++i) out << line << "\n";
  }
  sv::ServeOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.model_id = "k3-tiny";
  o.max_batch = 8;
  o.prefill_chunk = 9;
  sv::Server server(tiny_engine(), k3::Tokenizer::load_dir(dir.file("tok")), o);
  const int port = server.bind();
  std::thread listener([&] { server.listen(); });
  auto client = [&] {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    return c;
  };
  for (int i = 0; i < 200 && !client().Get("/health"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const char* questions[] = {"Name three colours.",
                             "What is two and two?",
                             "Say hello.",
                             "Write a long sentence about the sea and the sky and the wind.",
                             "Why?",
                             "Count to five.",
                             "Tell me a story about a cat.",
                             "Ok."};
  auto ask = [&](int i) {
    const json body = {{"model", "k3-tiny"},
                       {"messages", json::array({json{{"role", "user"}, {"content", questions[i]}}})},
                       {"temperature", 0},
                       {"max_tokens", 10 + i}};
    auto r = client().Post("/v1/chat/completions", body.dump(), "application/json");
    return r && r->status == 200 ? json::parse(r->body) : json{{"failed", r ? r->body : "no response"}};
  };
  std::vector<json> alone, together(8);
  for (int i = 0; i < 8; ++i) alone.push_back(ask(i));
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) threads.emplace_back([&, i] { together[size_t(i)] = ask(i); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < 8; ++i) {
    ASSERT_FALSE(alone[size_t(i)].contains("failed")) << alone[size_t(i)].dump();
    ASSERT_FALSE(together[size_t(i)].contains("failed")) << together[size_t(i)].dump();
    EXPECT_EQ(together[size_t(i)]["choices"][0]["message"], alone[size_t(i)]["choices"][0]["message"]) << i;
    EXPECT_EQ(together[size_t(i)]["usage"], alone[size_t(i)]["usage"]) << i;
  }
  auto m = client().Get("/metrics");
  ASSERT_TRUE(m);
  auto value = [&](const std::string& name) {
    const size_t p = m->body.find("\n" + name + " ");
    return p == std::string::npos ? -1.0 : std::stod(m->body.substr(p + name.size() + 2));
  };
  EXPECT_GT(value("k3_engine_step_sequences_total"), value("k3_engine_steps_total")) << m->body;
  server.stop();
  listener.join();
}

#else
TEST(ServeBatcher, NeedsTheHttpServer) { GTEST_SKIP() << "this build has no HTTP server (libcpp-httplib-dev)"; }
#endif  // K3_HAVE_SERVE
