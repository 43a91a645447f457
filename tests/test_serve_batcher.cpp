// Continuous batching (serve/batcher.h) on the k3-tiny fixture model on the CPU and on a scripted engine:
//   - sequences generating side by side on their own threads, with prompts of 1 to 70 tokens cut into 7-token
//     chunks between the others' decode steps, get the logits their engine's own session gives for the same
//     tokens (the independent truth), to the last bit: every row of a CPU forward is computed from its own
//     sequence only, whatever else the step holds; and the steps did batch them (sequences per step > 1);
//   - admission: at most max_batch slots, the cache budget counted at full length, first come first served;
//     a sequence that can never fit is an error naming the bytes; an acquire past its deadline gives nullptr;
//   - the prefix cache: greedy generation from prompts that share cached whole chunks with an earlier one equals
//     generation without the cache, logits to the bit, on the CPU and (bf16) on the GPU, for prompts ending a
//     token before, at and after a chunk boundary and three chunks in, and one leaving the cached prefix
//     mid-chunk; the trie holds a shared chunk once and evicts least recently used unpinned leaves;
//   - an engine error fails the appends of that step with a k3::Error and the slot refuses more; the other
//     slots and the batcher go on;
//   - over HTTP: concurrent greedy chat requests each get the reply the same request gets alone, and
//     /metrics shows the batching; with the prefix cache, completions of prompts ending at 511/512/513 and
//     1535/1536/1537 tokens (chunks of 512) after a longer one, and a two-turn chat, equal a server's without it.
#include <gtest/gtest.h>

#if defined(K3_HAVE_SERVE)
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <cmath>
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
#include "util/cuda_test.h"
#include "util/scripted_engine.h"
#include "util/serve_test.h"
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

using Listening = k3test::ServeOnLoopback;
std::string write_tokenizer(const k3test::TempDir& dir) { return k3test::write_tiny_tokenizer(dir); }

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
  // First come, first served: with 60 of 100 held, w1 (50 tokens) waits for room, and w2 (10), which would fit,
  // waits behind it; once the 60 are released both are admitted.
  std::unique_ptr<sv::Batcher::Slot> h1, h2;
  std::thread w1([&] { h1 = b.acquire(50, Clock::now() + std::chrono::seconds(10)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  std::thread w2([&] { h2 = b.acquire(10, Clock::now() + std::chrono::seconds(10)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  c.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(b.stats().admitting, 2) << "10 tokens would fit the budget, but w1 came first";
  EXPECT_EQ(b.stats().slots, 1);
  a.reset();
  w1.join();
  w2.join();
  EXPECT_TRUE(h1 && h2);
  EXPECT_EQ(b.stats().reserved_bytes, 60 * per_token);
  h1.reset();
  h2.reset();
  // max_batch: three slots held, a fourth waits.
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

// A snapshot that fails (say, out of device memory for the prefix cache) costs the cache, not the request.
TEST(ServeBatcher, AFailedSnapshotDropsOnlyTheCacheEntry) {
  const k3::K3Config cfg = tiny_engine()->config();
  struct NoSnapshots : k3test::ScriptedEngine {
    using ScriptedEngine::ScriptedEngine;
    std::unique_ptr<k3::SequenceSnapshot> snapshot(k3::EngineSequence&, int64_t) override {
      k3::fail("no memory for a snapshot (a test's failure)");
    }
  } engine(cfg, {5, 6, 7});
  sv::BatcherOptions o;
  o.prefill_chunk = 4;
  o.prefix_cache_bytes = size_t(1) << 20;
  sv::Batcher b(engine, o);
  auto slot = b.acquire(16, Clock::time_point::max());
  const std::vector<float> l = slot->append({1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  EXPECT_EQ(std::max_element(l.begin(), l.end()) - l.begin(), 7) << "the third forward's scripted token";
  EXPECT_NO_THROW(slot->append({7}));
  EXPECT_EQ(b.stats().prefix.blocks, 0);
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

// Generation whose decode steps run ahead on the engine thread (Slot::run_ahead) picks the ids that stepping one
// token at a time on the engine's own session picks: greedy and sampled at temperature 1 with a seed each, six
// sequences at once beside two that step one token at a time, some stopped early by keep_going. The steps batched
// them, and every slot, stopped or not, was released.
TEST(ServeBatcher, RunningAheadPicksWhatSteppingPicks) {
  const auto engine = tiny_engine();
  const k3::K3Config& cfg = engine->config();
  const int V = int(cfg.vocab_size);
  const int kSteps = 12, kSeqs = 8;
  auto params = [](int s) {
    k3::SamplingParams p;
    p.greedy = s % 2 == 0;
    p.temperature = 1.0f;
    p.seed = uint64_t(100 + s);
    return p;
  };
  auto stop_at = [](int s) { return s % 3 == 1 ? 5 : kSteps + 1; };  // some stop after their 5th token
  auto run = [&](const k3::PickFn& append, const k3::RunAhead& ahead, int s) {
    k3::Sampler sampler(params(s));
    int made = 0;
    return k3::generate_until(
               append, cfg, prompt_of(3 + 4 * s, s, V), kSteps, sampler, [&](int32_t) { return ++made < stop_at(s); },
               {}, {}, ahead)
        .tokens;
  };
  std::vector<std::vector<int32_t>> alone, together(kSeqs);
  for (int s = 0; s < kSeqs; ++s) alone.push_back(run(engine->pick_session(), {}, s));
  sv::BatcherOptions o;
  o.max_batch = kSeqs;
  o.prefill_chunk = 8;
  sv::Batcher b(*engine, o);
  std::vector<std::thread> threads;
  for (int s = 0; s < kSeqs; ++s)
    threads.emplace_back([&, s] {
      auto slot = b.acquire(3 + 4 * s + kSteps + 1, Clock::time_point::max());
      // Sequences 6 and 7 step one token at a time among the others.
      together[size_t(s)] = run(slot->pick_fn(), s < 6 ? slot->run_ahead() : k3::RunAhead{}, s);
    });
  for (auto& t : threads) t.join();
  for (int s = 0; s < kSeqs; ++s) {
    EXPECT_EQ(together[size_t(s)], alone[size_t(s)]) << "sequence " << s;
    EXPECT_EQ(int(alone[size_t(s)].size()), std::min(kSteps, stop_at(s))) << "sequence " << s;
  }
  const sv::Batcher::Stats st = b.stats();
  EXPECT_GT(st.step_sequences, st.steps) << "the steps batched several sequences";
  EXPECT_GT(st.decode_steps, 0);
  EXPECT_EQ(st.slots, 0);
}

// A slot whose reader is slow runs ahead by kAheadDepth results and no more, while another slot's steps go on;
// once read, it runs its whole budget and no step past it.
TEST(ServeBatcher, RunningAheadWaitsForItsReader) {
  const k3::K3Config cfg = tiny_engine()->config();
  k3test::ScriptedEngine engine(cfg, {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16});
  sv::BatcherOptions o;
  o.max_batch = 2;
  sv::Batcher b(engine, o);
  auto slow = b.acquire(16, Clock::time_point::max()), busy = b.acquire(16, Clock::time_point::max());
  const k3::TokenPick greedy{true, true, 1.0f, 0.0, false};
  EXPECT_EQ(slow->step({1, 2}, greedy).id, 5);
  const k3::RunAhead ahead = slow->run_ahead();
  int picks = 0;
  ahead.start(5, 8, -1, [&] { return ++picks, greedy; });
  EXPECT_EQ(busy->step({1}, greedy).id, 5);
  for (int i = 0; i < 6; ++i) busy->step({1}, greedy);
  EXPECT_EQ(picks, 2) << "two results wait for the slow reader; no third step ran";
  EXPECT_EQ(b.stats().step_tokens_total, 2 + 1 + 6 + 2);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(ahead.next().id, 6 + i) << "step " << i;
  EXPECT_THROW(ahead.next(), k3::Error) << "past the 8 steps it was given";
  EXPECT_EQ(picks, 8);
  ahead.stop();
  EXPECT_THROW(slow->step({1}, greedy), k3::Error) << "a slot that ran ahead takes no steps";
  EXPECT_EQ(b.stats().step_tokens_total, 2 + 1 + 6 + 8);
}

// A run ahead ends at its stop id; an engine error in one of its steps reaches its reader; a slot released while
// it runs ahead (its reader gone without stopping it) leaves the batcher serving the others.
TEST(ServeBatcher, RunningAheadEndsStopsAndFails) {
  const k3::K3Config cfg = tiny_engine()->config();
  FailingEngine engine(cfg, 7);  // the script is empty: every pick is eos; a forward holding 7 fails
  sv::BatcherOptions o;
  o.max_batch = 3;
  sv::Batcher b(engine, o);
  const k3::TokenPick greedy{true, true, 1.0f, 0.0, false};
  const auto eos = int32_t(cfg.eos_token_id);
  {
    auto slot = b.acquire(16, Clock::time_point::max());
    slot->step({1}, greedy);
    const k3::RunAhead ahead = slot->run_ahead();
    ahead.start(3, 10, eos, [&] { return greedy; });
    EXPECT_EQ(ahead.next().id, eos);
    EXPECT_THROW(ahead.next(), k3::Error) << "no step after the stop id";
    ahead.stop();
  }
  {
    auto slot = b.acquire(16, Clock::time_point::max());
    slot->step({1}, greedy);
    const k3::RunAhead ahead = slot->run_ahead();
    ahead.start(7, 10, -1, [&] { return greedy; });
    try {
      ahead.next();
      ADD_FAILURE() << "the engine error was not reported";
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("ran out of memory"), std::string::npos) << e.what();
    }
    ahead.stop();
  }
  for (int round = 0; round < 20; ++round) {  // released at once, with steps in flight
    auto slot = b.acquire(16, Clock::time_point::max());
    slot->step({1}, greedy);
    slot->run_ahead().start(3, 10, -1, [&] { return greedy; });
  }
  auto after = b.acquire(4, Clock::time_point::max());
  EXPECT_EQ(after->step({1, 2}, greedy).id, eos);
  after.reset();
  EXPECT_EQ(b.stats().slots, 0);
}

// While a sequence decodes, a prompt's chunks join one step in prefill_every (3 here), the steps between being
// decodes alone; each chunk still goes in whole and the prompt's pick is the script's.
TEST(ServeBatcher, PromptsJoinDecodingStepsEveryFewSteps) {
  const k3::K3Config cfg = tiny_engine()->config();
  struct Logging : k3test::ScriptedEngine {
    using ScriptedEngine::ScriptedEngine;
    std::mutex mu;
    std::vector<std::vector<size_t>> steps;  // each forward's token counts
    std::vector<float> forward(const std::vector<k3::EngineSequence*>& seqs,
                               const std::vector<std::vector<int32_t>>& tokens, bool all_positions,
                               const k3::ForwardHooks* hooks = nullptr) override {
      std::vector<size_t> n;
      for (const auto& t : tokens) n.push_back(t.size());
      {
        std::lock_guard<std::mutex> lock(mu);
        steps.push_back(n);
      }
      return ScriptedEngine::forward(seqs, tokens, all_positions, hooks);
    }
  } engine(cfg, {5, 6, 7, 8, 9, 10, 11, 12}, std::chrono::milliseconds(1));
  sv::BatcherOptions o;
  o.max_batch = 2;
  o.prefill_chunk = 4;
  o.prefill_every = 3;
  sv::Batcher b(engine, o);
  const k3::TokenPick greedy{true, true, 1.0f, 0.0, false};
  auto decoder = b.acquire(64, Clock::time_point::max());
  decoder->step({1, 2}, greedy);
  const k3::RunAhead ahead = decoder->run_ahead();
  ahead.start(5, 40, -1, [&] { return greedy; });
  std::thread reader([&] {
    for (int i = 0; i < 40; ++i) ahead.next();
    ahead.stop();
  });
  auto prompt = b.acquire(64, Clock::time_point::max());
  std::vector<int32_t> twenty(20, 3);
  EXPECT_EQ(prompt->step(twenty, greedy).id, 9) << "the fifth forward of its sequence: the script's fifth id";
  reader.join();
  int chunks = 0, mixed = 0;
  int64_t last = -100;
  for (size_t i = 0; i < engine.steps.size(); ++i) {
    const std::vector<size_t>& n = engine.steps[i];
    const bool has_prompt = std::count(n.begin(), n.end(), size_t(4)) > 0;
    const bool has_decode = std::count(n.begin(), n.end(), size_t(1)) > 0;
    if (!has_prompt || i == 0) continue;
    ++chunks;
    if (has_decode) {
      ++mixed;
      EXPECT_GE(int64_t(i) - last, 3) << "step " << i << ": a prompt chunk came " << int64_t(i) - last
                                      << " steps after the previous one";
    }
    last = int64_t(i);
  }
  EXPECT_EQ(chunks, 5);
  EXPECT_GT(mixed, 0) << "the chunks went in beside the decoding sequence";
}

// Prompt rows (an image's projected tokens) reach the forward through the batcher's chunks: a prompt whose rows
// span chunk boundaries gives the logits of the engine's own session with the same rows, to the bit; two prompts
// with the same ids and different rows give their own sessions' logits with the prefix cache on (it serves and
// keeps only the chunks before the first row), and the chunk before the rows was served from it.
TEST(ServeBatcher, PromptRowsGoInAcrossChunksAndPastTheCache) {
  const auto engine = tiny_engine();
  const int V = int(engine->config().vocab_size);
  const int64_t D = engine->config().hidden_size;
  std::vector<int32_t> prompt = prompt_of(30, 7, V);
  for (int i = 12; i < 23; ++i) prompt[size_t(i)] = 789;  // the rows' places: 12..22
  std::vector<std::vector<float>> rows(2, std::vector<float>(size_t(11 * D)));
  for (int k = 0; k < 2; ++k)
    for (size_t i = 0; i < rows[size_t(k)].size(); ++i)
      rows[size_t(k)][i] = 0.05f * std::sin(0.37f * float(i) + 1.3f * float(k));
  auto rows_of = [&](int k) { return std::vector<k3::InputRows>{k3::InputRows{12, 11, rows[size_t(k)].data()}}; };
  sv::BatcherOptions o;
  o.prefill_chunk = 5;  // chunks 10-15 and 20-25 cut the rows
  o.prefix_cache_bytes = size_t(1) << 30;
  sv::Batcher b(*engine, o);
  std::vector<float> first;
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE("rows " + std::to_string(k));
    const k3::PickFn alone = engine->pick_session(rows_of(k));
    const std::vector<float> want = alone(prompt, k3::TokenPick::logits()).logits;
    auto slot = b.acquire(40, Clock::time_point::max());
    slot->set_prompt_rows(rows_of(k));
    const std::vector<float> got = slot->append(prompt);
    ASSERT_EQ(got.size(), size_t(V));
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), size_t(V) * sizeof(float)));
    EXPECT_EQ(slot->cached_tokens(), k == 0 ? 0 : 10) << "chunks before the rows only";
    if (k == 0) first = got;
  }
  const std::vector<float> other = engine->pick_session(rows_of(1))(prompt, k3::TokenPick::logits()).logits;
  EXPECT_NE(0, std::memcmp(first.data(), other.data(), size_t(V) * sizeof(float))) << "the rows made a difference";
}

// Greedy generation from prompts that share cached whole chunks equals generation without the cache, logits to
// the bit: prompts ending a token before, at and after one chunk (16 tokens) and three chunks, and one that
// leaves the cached prefix mid-chunk. The cache was filled by a longer prompt with the same beginning; the hits
// are the whole chunks that still leave a token to run.
void check_prefix_cache(k3::Engine& engine) {
  const int V = int(engine.config().vocab_size);
  const int P = 16, kSteps = 6;
  std::vector<int32_t> base = prompt_of(70, 3, V);
  std::vector<int32_t> diverging(base.begin(), base.begin() + 20);
  for (int i = 0; i < 15; ++i) diverging.push_back(int32_t((i * 29 + 5) % V));
  sv::BatcherOptions plain, cached;
  plain.prefill_chunk = cached.prefill_chunk = P;
  cached.prefix_cache_bytes = size_t(1) << 30;
  sv::Batcher off(engine, plain), on(engine, cached);
  auto run = [&](sv::Batcher& b, const std::vector<int32_t>& prompt) {
    auto slot = b.acquire(int64_t(prompt.size()) + kSteps + 1, Clock::time_point::max());
    return greedy_run(slot->fn(), prompt, kSteps);
  };
  run(on, base);  // fills chunks 0..3
  EXPECT_EQ(on.stats().prefix.blocks, 4);
  struct Case {
    std::vector<int32_t> prompt;
    int64_t hit;
  };
  std::vector<Case> cases;
  for (const int L : {P - 1, P, P + 1, 3 * P - 1, 3 * P, 3 * P + 1})
    cases.push_back({std::vector<int32_t>(base.begin(), base.begin() + L), int64_t((L - 1) / P) * P});
  cases.push_back({diverging, P});
  for (const Case& c : cases) {
    SCOPED_TRACE("prompt of " + std::to_string(c.prompt.size()) + " tokens");
    const int64_t before = on.stats().prefix.hit_tokens;
    const GreedyRun want = run(off, c.prompt), got = run(on, c.prompt);
    EXPECT_EQ(on.stats().prefix.hit_tokens - before, c.hit);
    EXPECT_EQ(got.tokens, want.tokens);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    for (size_t i = 0; i < want.logits.size(); ++i)
      EXPECT_EQ(0, std::memcmp(got.logits[i].data(), want.logits[i].data(), size_t(V) * sizeof(float))) << i;
  }
}

TEST(ServeBatcher, PrefixCacheGivesTheSameLogits) { check_prefix_cache(*tiny_engine()); }

TEST(ServeBatcher, PrefixCacheGivesTheSameLogitsOnTheGpu) {
  K3_REQUIRE_GPU();
  check_prefix_cache(*k3::Engine::load(k3test::fixture("k3-tiny-a"), {k3::Device::CUDA, k3::Precision::BF16}));
}

// The cache's trie on its own: a chunk cached twice is held once, eviction takes the least recently used leaf
// that no running sequence extends, never a pinned one, and keeps within the budget.
TEST(ServeBatcher, PrefixCacheEvictsLeastRecentlyUsedLeaves) {
  const k3::K3Config cfg = tiny_engine()->config();
  k3test::ScriptedEngine engine(cfg, {});
  const int64_t P = 4;
  const size_t per_block = P * k3test::ScriptedEngine::kBytesPerToken + P * sizeof(int32_t);
  sv::PrefixCache cache(P, 3 * per_block);
  auto snap = [&](int64_t begin) {
    auto s = std::make_unique<k3test::ScriptedEngine::Snap>();
    s->begin = begin, s->end = begin + P;
    return s;
  };
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9}, b = {1, 2, 3, 4, 9, 9, 9, 9, 9};
  sv::PrefixCache::Node* a0 = cache.insert(nullptr, a.data(), snap(0));
  sv::PrefixCache::Node* a1 = cache.insert(a0, a.data() + 4, snap(4));
  EXPECT_EQ(cache.insert(nullptr, b.data(), snap(0)), a0) << "the same first chunk is held once";
  EXPECT_EQ(cache.stats().blocks, 2);
  EXPECT_EQ(cache.match(a).size(), 2u);
  EXPECT_EQ(cache.match(b).size(), 1u);
  sv::PrefixCache::pin(a1);
  sv::PrefixCache::Node* b1 = cache.insert(a0, b.data() + 4, snap(4));  // three blocks: at the budget
  EXPECT_EQ(cache.stats().blocks, 3);
  const std::vector<int32_t> c = {7, 7, 7, 7, 7};
  cache.insert(nullptr, c.data(), snap(0));  // a fourth: the least recently used unpinned leaf goes (b1)
  EXPECT_EQ(cache.stats().blocks, 3);
  EXPECT_LE(cache.stats().bytes, 3 * per_block);
  EXPECT_EQ(cache.match(b).size(), 1u) << "b's second chunk was evicted";
  EXPECT_EQ(cache.match(a).size(), 2u) << "a's second chunk is pinned";
  (void)b1;
  sv::PrefixCache::unpin(a1);
}

// Concurrent greedy chat requests over HTTP: each gets the reply it gets alone.
TEST(ServeBatcher, ConcurrentRequestsGetTheirOwnReplies) {
  k3test::TempDir dir("serve-batcher");
  sv::ServeOptions o;
  o.host = "127.0.0.1";
  o.port = 0;
  o.model_id = "k3-tiny";
  o.max_batch = 8;
  o.prefill_chunk = 9;
  Listening server(tiny_engine(), write_tokenizer(dir), o);
  auto client = [&] { return server.client(); };
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
    for (const char* k : {"prompt_tokens", "completion_tokens"})  // (cached_tokens: the first run filled the cache)
      EXPECT_EQ(together[size_t(i)]["usage"][k], alone[size_t(i)]["usage"][k]) << i;
  }
  auto m = client().Get("/metrics");
  ASSERT_TRUE(m);
  auto value = [&](const std::string& name) {
    const size_t p = m->body.find("\n" + name + " ");
    return p == std::string::npos ? -1.0 : std::stod(m->body.substr(p + name.size() + 2));
  };
  EXPECT_GT(value("k3_engine_step_sequences_total"), value("k3_engine_steps_total")) << m->body;
}

// The prefix cache over HTTP, against a server without it: completions of prompts ending at 511, 512, 513, 1535,
// 1536 and 1537 tokens (chunks of 512) after a 1,600-token prompt with the same beginning, and a two-turn chat
// whose second turn repeats the first, give the same greedy text and usage; the cache was used.
TEST(ServeBatcher, PrefixCacheServesWhatAServerWithoutItServes) {
  k3test::TempDir dir("serve-prefix");
  const std::string tok_dir = write_tokenizer(dir);
  auto start = [&](size_t cache_bytes) {
    sv::ServeOptions o;
    o.host = "127.0.0.1";
    o.port = 0;
    o.model_id = "k3-tiny";
    o.prefix_cache_bytes = cache_bytes;
    return std::make_unique<Listening>(tiny_engine(), tok_dir, o);
  };
  auto on = start(size_t(1) << 30), off = start(0);
  const int V = 768;
  const std::vector<int32_t> base = prompt_of(1600, 11, V);
  auto complete = [&](Listening& s, int len) {
    const json body = {{"model", "k3-tiny"},
                       {"prompt", std::vector<int32_t>(base.begin(), base.begin() + len)},
                       {"max_tokens", 6},
                       {"temperature", 0}};
    auto r = s.client().Post("/v1/completions", body.dump(), "application/json");
    return r && r->status == 200 ? json::parse(r->body) : json{{"failed", r ? r->body : "no response"}};
  };
  complete(*on, 1600);
  for (const int len : {511, 512, 513, 1535, 1536, 1537}) {
    SCOPED_TRACE("prompt of " + std::to_string(len) + " tokens");
    const json a = complete(*on, len), b = complete(*off, len);
    ASSERT_FALSE(a.contains("failed") || b.contains("failed")) << a.dump() << b.dump();
    EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
    for (const char* k : {"prompt_tokens", "completion_tokens"}) EXPECT_EQ(a["usage"][k], b["usage"][k]);
    EXPECT_EQ(a["usage"]["prompt_tokens_details"]["cached_tokens"], (len - 1) / 512 * 512);
    EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  }
  // Two turns: the second request repeats the first turn (with its reply) and adds a question.
  std::string system = "You are a careful assistant.";
  for (int i = 0; i < 120; ++i) system += " Answer in short sentences and check every number twice.";
  auto chat = [&](Listening& s, const json& messages) {
    const json body = {{"model", "k3-tiny"}, {"messages", messages}, {"max_tokens", 8}, {"temperature", 0}};
    auto r = s.client().Post("/v1/chat/completions", body.dump(), "application/json");
    return r && r->status == 200 ? json::parse(r->body) : json{{"failed", r ? r->body : "no response"}};
  };
  json turn = json::array({json{{"role", "system"}, {"content", system}}, json{{"role", "user"}, {"content", "Hi."}}});
  const json a1 = chat(*on, turn), b1 = chat(*off, turn);
  ASSERT_FALSE(a1.contains("failed") || b1.contains("failed")) << a1.dump() << b1.dump();
  EXPECT_EQ(a1["choices"][0]["message"], b1["choices"][0]["message"]);
  EXPECT_GT(a1["usage"]["prompt_tokens"].get<int64_t>(), 512) << "the system prompt spans a whole chunk";
  json reply = a1["choices"][0]["message"];
  reply.erase("reasoning_content");
  turn.push_back(reply);
  turn.push_back(json{{"role", "user"}, {"content", "And then?"}});
  const json a2 = chat(*on, turn), b2 = chat(*off, turn);
  ASSERT_FALSE(a2.contains("failed") || b2.contains("failed")) << a2.dump() << b2.dump();
  EXPECT_EQ(a2["choices"][0]["message"], b2["choices"][0]["message"]);
  for (const char* k : {"prompt_tokens", "completion_tokens"}) EXPECT_EQ(a2["usage"][k], b2["usage"][k]);
  EXPECT_GE(a2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), 512);
  auto m = on->client().Get("/metrics");
  ASSERT_TRUE(m);
  // Hits: 513, 1535, 1536, 1537 (512, 1024, 1024, 1536 tokens) and the second turn (its first turn's chunks).
  EXPECT_NE(m->body.find("k3_prefix_cache_hits_total 5\n"), std::string::npos) << m->body;
  const size_t p = m->body.find("\nk3_prefix_cache_hit_tokens_total ");
  ASSERT_NE(p, std::string::npos);
  EXPECT_GE(std::stod(m->body.substr(p + 34)), 4096 + 512) << m->body;
}

#else
TEST(ServeBatcher, NeedsTheHttpServer) { GTEST_SKIP() << "this build has no HTTP server (libcpp-httplib-dev)"; }
#endif  // K3_HAVE_SERVE
