// The RL loop (`k3 rl`, `k3 distill`: train/rl_loop.h), its episodes (train/episode.h) and the calculator
// environment, on a k3-tiny-a model as `k3 init` makes it with the tests' tiny tokenizer:
//   - the calculator's tasks, tool and score against their definitions; group-normalised advantages against theirs;
//   - a tool turn continues the conversation exactly as the chat template renders it; an episode's draws are a
//     function of its seed;
//   - the trainer's log-probabilities of the sampled tokens against the sampler's (CPU f32 engine, float64
//     trainer) with router replay (the 1e-6), and without it the routing differences are counted;
//   - rollouts on the float64 engine: the trainer's log-probabilities are the sampler's to rounding, and in the
//     deterministic mode bit for bit;
//   - partial rollouts: which tokens came from which policy, carried episodes continuing under the next one;
//   - exact resume; the effort reward's budget; distillation from the policy itself gives no update.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "eval/plots.h"
#include "kernels/gemm/linear_f64.h"
#include "model/init_random.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "train/advantages.h"
#include "train/checkpoint.h"
#include "train/environment.h"
#include "train/episode.h"
#include "train/rl_loop.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/temp_dir.h"
#include "util/tiny_tokenizer.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;
using ::testing::HasSubstr;
using ojson = nlohmann::ordered_json;

namespace {

// A random policy never closes its message, so its episodes end on a budget. The tests end them on the context
// length: the knowledge-base tasks' questions differ in length, so episodes end after different numbers of tokens
// (and at different steps, which partial rollouts need), and an effort budget between those numbers gives their
// returns, and so the update, something to tell apart.
struct TinyPolicy {
  k3test::TempDir dir{"rl"};
  std::string model, teacher;  // the policy; another random model of the same shapes
  int64_t max_context = 0;
  double tau = 0;  // the median of generated / b0 over the first tasks
  TinyPolicy() {
    model = dir.file("model");
    RandomInitOptions opt;
    opt.seed = 1;
    write_random_model(fixture("k3-tiny-a/config.json"), model, opt);
    k3test::write_tiny_tokenizer(model);
    teacher = dir.file("teacher");
    opt.seed = 2;
    write_random_model(fixture("k3-tiny-a/config.json"), teacher, opt);
    const Tokenizer tok = Tokenizer::load_dir(model);
    auto env = make_environment("kb", {{"hops", 2}});
    std::vector<int64_t> prompt;
    std::vector<double> b0;
    for (int64_t i = 0; i < 8; ++i) {
      const Task t = env->task(3, i);
      prompt.push_back(start_episode(tok, t, i, 0, 0).prompt_len);
      b0.push_back(double(reference_tokens(tok, t)));
    }
    max_context = *std::min_element(prompt.begin(), prompt.end()) + 20;
    std::vector<double> ratio;
    for (size_t i = 0; i < prompt.size(); ++i) ratio.push_back(double(max_context - prompt[i]) / b0[i]);
    std::sort(ratio.begin(), ratio.end());
    tau = ratio[ratio.size() / 2];
  }
  RlOptions options(const std::string& out) const {
    RlOptions o;
    o.model_dir = model, o.out_dir = dir.file(out);
    o.env = "kb", o.env_options = {{"hops", 2}};
    o.iterations = 2, o.prompts = 2, o.samples = 2;
    o.episode.max_tokens = 64, o.episode.max_turns = 2, o.episode.max_context = max_context;
    o.effort_tau_start = o.effort_tau_end = tau;
    o.lr = 1e-3, o.seed = 3, o.save_every = 1;
    return o;
  }
};

std::vector<nlohmann::json> records(const std::string& run) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Everything a record holds but wall times and speeds.
nlohmann::json without_timings(nlohmann::json r) {
  for (const char* k : {"rollout_s", "train_s", "sync_s", "rollout_tok_s", "train_tok_s", "tool_s"}) r.erase(k);
  return r;
}

TrainState checkpoint_state(const std::string& run, int64_t iteration) {
  const std::string dir = run + "/" + step_name(iteration);
  ParamStore P = ParamStore::from_model_dir(dir);
  TrainState st;
  load_checkpoint(dir, P, st);
  return st;
}

}  // namespace

TEST(CalculatorEnvironment, TasksToolAndScore) {
  auto env = make_environment("calculator", {{"digits", 2}});
  const Task a = env->task(7, 3), b = env->task(7, 3), c = env->task(8, 3);
  EXPECT_EQ(a.request, b.request);
  EXPECT_NE(a.request.dump() + a.answer.dump(), c.request.dump() + c.answer.dump());
  // The answer is the question's value, and the reference solution calls the tool with the question's expression.
  const std::string q = a.request["messages"][0]["content"].get<std::string>();
  const std::string expr = q.substr(8, q.size() - 9);  // "What is " ... "?"
  nlohmann::json state;
  EXPECT_EQ(env->call(a, "calculator", {{"expression", expr}}, state).content, a.answer.get<std::string>());
  const std::string args = a.reference[0]["tool_calls"][0]["function"]["arguments"].get<std::string>();
  EXPECT_EQ(ojson::parse(args)["expression"], expr);
  EXPECT_EQ(a.reference[1]["content"], a.answer);

  EXPECT_EQ(env->call(a, "calculator", {{"expression", "2 + 3 * (4 - 6)"}}, state).content, "-4");
  EXPECT_EQ(env->call(a, "calculator", {{"expression", "84 / 4"}}, state).content, "21");
  EXPECT_THAT(env->call(a, "calculator", {{"expression", "7 / 2"}}, state).content, HasSubstr("not an integer"));
  EXPECT_THAT(env->call(a, "calculator", {{"expression", "1 / 0"}}, state).content, HasSubstr("division by zero"));
  EXPECT_THAT(env->call(a, "calculator", {{"expression", "3 +"}}, state).content, HasSubstr("error"));
  EXPECT_THAT(env->call(a, "calculator", {{"expression", "(((1"}}, state).content, HasSubstr("missing ')'"));
  EXPECT_THAT(env->call(a, "calculator", {{"x", 1}}, state).content, HasSubstr("'expression'"));
  EXPECT_THAT(env->call(a, "search", {}, state).content, HasSubstr("no tool 'search'"));
  EXPECT_TRUE(env->call(a, "calculator", {{"expression", "5"}}, state).error.empty());  // the tool's errors are text

  XtmlAssistantMessage m;
  m.response = "The answer is " + a.answer.get<std::string>() + ".";
  EXPECT_EQ(env->score(a, m, state), 1.0);
  m.response = a.answer.get<std::string>() + "0";
  EXPECT_EQ(env->score(a, m, state), 0.0);
  m.response = "no number";
  EXPECT_EQ(env->score(a, m, state), 0.0);

  EXPECT_THAT(k3test::error_of([] { make_environment("chess", {}); }), HasSubstr("unknown environment 'chess'"));
  EXPECT_THAT(k3test::error_of([] { make_environment("calculator", {{"digits", 9}}); }), HasSubstr("'digits'"));
  EXPECT_THAT(k3test::error_of([] { make_environment("calculator", {{"base", 2}}); }), HasSubstr("unknown option"));
}

// "by_hand": that fraction of the reference solutions answers at once; the tasks themselves do not change.
TEST(CalculatorEnvironment, ByHandReferencesAnswerWithoutTheTool) {
  auto plain = make_environment("calculator", {{"digits", 2}});
  auto none = make_environment("calculator", {{"digits", 2}, {"by_hand", 0.0}});
  auto all = make_environment("calculator", {{"digits", 2}, {"by_hand", 1.0}});
  auto half = make_environment("calculator", {{"digits", 2}, {"by_hand", 0.5}});
  int by_hand = 0;
  const int n = 400;
  for (int i = 0; i < n; ++i) {
    const Task p = plain->task(5, i), z = none->task(5, i), a = all->task(5, i), h = half->task(5, i);
    EXPECT_EQ(z.request, p.request);
    EXPECT_EQ(z.reference, p.reference);
    for (const Task* t : {&a, &h}) {
      EXPECT_EQ(t->request, p.request);
      EXPECT_EQ(t->answer, p.answer);
    }
    for (const Task* t : {&a, &h}) {
      if (t == &h && h.reference.size() != 1) continue;
      ASSERT_EQ(t->reference.size(), 1u);
      EXPECT_FALSE(t->reference[0].contains("tool_calls"));
      EXPECT_EQ(t->reference[0]["content"], p.answer);
    }
    if (h.reference.size() == 1) {
      ++by_hand;
    } else {
      EXPECT_EQ(h.reference, p.reference);
    }
  }
  EXPECT_GT(by_hand, n * 4 / 10);
  EXPECT_LT(by_hand, n * 6 / 10);
  for (const nlohmann::json& bad : {nlohmann::json(1.5), nlohmann::json(-0.1), nlohmann::json("half")})
    EXPECT_THAT(k3test::error_of([&] {
                  make_environment("calculator", {{"by_hand", bad}});
                }),
                HasSubstr("'by_hand' must be a number in [0, 1]"));
}

// Group-normalised advantages against their definition (train/advantages.h).
TEST(Advantages, GroupNormalised) {
  const std::vector<double> a = group_advantages({1, 0, 0, 1, 2, 2, 2, 2, 0, 3, 0, 0}, 4);
  const double r3 = std::sqrt(3.0);  // {0, 3, 0, 0}: mean 3/4, standard deviation 3√3/4
  const std::vector<double> want = {1, -1, -1, 1, 0, 0, 0, 0, -1 / r3, r3, -1 / r3, -1 / r3};
  ASSERT_EQ(a.size(), want.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], want[i], 1e-5) << i;
  EXPECT_THAT(k3test::error_of([] { group_advantages({1, 2, 3}, 2); }), HasSubstr("not groups of 2"));
}

// Each hop of the chain earns its reward once; the reference solution follows the chain; the answer is its end.
TEST(KbEnvironment, HopsAreRewardedOnceAndTheAnswerIsTheChainsEnd) {
  auto env = make_environment("kb", {{"hops", 3}, {"hop_reward", 0.25}});
  const Task t = env->task(5, 2);
  EXPECT_EQ(t.request, env->task(5, 2).request);
  ASSERT_EQ(t.reference.size(), 7u);  // three calls and results, then the answer
  nlohmann::json state;
  double got = 0;
  for (int k = 0; k < 3; ++k) {
    const ojson args =
        ojson::parse(t.reference[size_t(2 * k)]["tool_calls"][0]["function"]["arguments"].get<std::string>());
    const ToolOutcome out = env->call(t, "lookup", args, state);
    EXPECT_EQ(out.content, t.reference[size_t(2 * k + 1)]["content"]);
    EXPECT_EQ(out.reward, 0.25);
    got += out.reward;
    EXPECT_EQ(env->call(t, "lookup", args, state).reward, 0.0);  // once
  }
  EXPECT_EQ(got, 0.75);
  EXPECT_EQ(env->call(t, "lookup", {{"entity", "Nobody"}, {"relation", "city"}}, state).content, "unknown");
  EXPECT_THAT(env->call(t, "lookup", {{"entity", 3}}, state).content, HasSubstr("error"));
  XtmlAssistantMessage m;
  m.response = "It is " + t.reference[6]["content"].get<std::string>() + ".";
  EXPECT_EQ(env->score(t, m, state), 1.0);
  m.response = "I do not know.";
  EXPECT_EQ(env->score(t, m, state), 0.0);
  EXPECT_THAT(k3test::error_of([] { make_environment("kb", {{"hops", 4}}); }), HasSubstr("'hops'"));
}

TEST(RetrievalEnvironment, PasskeyTasksScoreTheKey) {
  k3test::TempDir d("rl-retrieval");
  const std::string tok = k3test::write_tiny_tokenizer(d.file("tok"));
  std::ofstream(d.file("filler.txt")) << "The river ran past the old mill.\nSheep grazed on the hill above it.\n"
                                         "Nobody in the village remembered when the bridge was built.\n";
  auto env = make_environment("retrieval", {{"filler", d.file("filler.txt")}, {"tokenizer", tok}, {"max_tokens", 200}});
  const Task t = env->task(1, 4);
  const std::string prompt = t.request["messages"][0]["content"].get<std::string>();
  const std::string key = t.answer.get<std::string>();
  EXPECT_NE(prompt.find(key), std::string::npos);  // the key is in the document
  XtmlAssistantMessage m;
  m.response = "The pass key is " + key + ".";
  EXPECT_EQ(env->score(t, m, {}), 1.0);
  m.response = "The pass key is 1.";
  EXPECT_EQ(env->score(t, m, {}), key == "1" ? 1.0 : 0.0);
  EXPECT_THAT(k3test::error_of([&] { make_environment("retrieval", {{"tokenizer", tok}}); }), HasSubstr("'filler'"));
}

// The prompt, the reference's first assistant message as the policy would write it, and the continuation after its
// tool result are exactly the rendering of the conversation through the tool result with the generation prompt.
TEST(Episode, ToolTurnContinuesTheRendering) {
  k3test::TempDir d("rl-render");
  const Tokenizer tok = Tokenizer::load_dir(k3test::write_tiny_tokenizer(d.path()));
  auto env = make_environment("calculator", {});
  const Task t = env->task(1, 0);
  const Episode e = start_episode(tok, t, 0, 0, 1);
  ojson through = t.request["messages"], with = through;
  through.push_back(t.reference[0]);
  with.push_back(t.reference[0]);
  with.push_back(t.reference[1]);
  ojson req = t.request;
  req["messages"] = through, req["add_generation_prompt"] = false;
  std::vector<int32_t> ids = encode_segments(tok, render_chat(req));
  ASSERT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + e.prompt_len), e.ids);  // the prompt is a prefix
  const std::vector<int32_t> next = turn_continuation(tok, t, through, with);
  ids.insert(ids.end(), next.begin(), next.end());
  req["messages"] = with, req["add_generation_prompt"] = true;
  EXPECT_EQ(ids, encode_segments(tok, render_chat(req)));
  EXPECT_GT(reference_tokens(tok, t), 10);
}

// An episode's draws are a function of its seed alone: the same ids run again or among other episodes (the batch
// only changes the engine's rounding, 1e-6 at most on the log-probabilities), other ids under another seed.
TEST(Episode, DrawsAreAFunctionOfTheSeed) {
  TinyPolicy p;
  const Tokenizer tok = Tokenizer::load_dir(p.model);
  const std::unique_ptr<Engine> engine = Engine::load(p.model, EngineOptions{});
  auto env = make_environment("kb", {{"hops", 2}});
  EpisodeOptions eo;
  eo.max_tokens = 12, eo.max_turns = 2;
  auto run = [&](const std::vector<std::pair<int64_t, uint64_t>>& which) {  // (task, seed) per episode
    std::vector<Episode> eps;
    for (const auto& [task, seed] : which) eps.push_back(start_episode(tok, env->task(3, task), task, 0, seed));
    std::vector<Episode*> ptrs;
    for (Episode& e : eps) ptrs.push_back(&e);
    run_episodes(*engine, tok, *env, ptrs, eo, 0, 0);
    return eps;
  };
  const auto batch = run({{0, 11}, {1, 12}, {2, 13}, {0, 14}}), again = run({{0, 11}, {1, 12}, {2, 13}, {0, 14}});
  for (size_t i = 0; i < batch.size(); ++i) {
    EXPECT_EQ(batch[i].ids, again[i].ids) << i;
    EXPECT_EQ(batch[i].logp, again[i].logp) << i;
    EXPECT_GT(batch[i].generated(), 0) << i;
  }
  const auto alone = run({{1, 12}});
  ASSERT_EQ(alone[0].ids, batch[1].ids);
  for (size_t t = 0; t < alone[0].logp.size(); ++t) EXPECT_NEAR(alone[0].logp[t], batch[1].logp[t], 1e-6) << t;
  EXPECT_NE(batch[0].ids, batch[3].ids);  // one task, two seeds
}

TEST(RlLoop, TrainerLogprobsAreTheSamplersWithRouterReplay) {
  TinyPolicy p;
  RlOptions o = p.options("replay");
  o.iterations = 2, o.prompts = 3;
  run_rl(o);
  const auto recs = records(o.out_dir);
  ASSERT_EQ(recs.size(), 2u);
  // The plots' data (`k3 rl` draws them at the end): one line per iteration.
  eval::write_rl_plots(o.out_dir, o.out_dir + "/metrics.jsonl", "");
  std::ifstream dat(o.out_dir + "/plot-data/rl.dat");
  int lines = 0;
  for (std::string line; std::getline(dat, line);) lines += !line.empty() && line[0] != '#';
  EXPECT_EQ(lines, 2);
  EXPECT_TRUE(std::filesystem::exists(o.out_dir + "/plot-data/rl_mismatch.gp"));
  for (const auto& r : recs) {
    std::printf(
        "router replay, iteration %d: trainer against sampler, max |Δ log p| %.3g (mean %.3g) over %d "
        "tokens\n",
        r["iteration"].get<int>(), r["logprob_mismatch_max"].get<double>(), r["logprob_mismatch_mean"].get<double>(),
        r["trained_tokens"].get<int>());
    EXPECT_GT(r["trained_tokens"].get<int>(), 0);
    EXPECT_LE(r["logprob_mismatch_max"].get<double>(), 1e-6);  // the bar
    EXPECT_EQ(r["routing_differ"].get<double>(), -1.0);        // replayed: nothing to compare
    EXPECT_TRUE(std::isfinite(r["grad_norm"].get<double>()));
  }
  // Without replay the trainer routes itself, and the record says how often that differed.
  RlOptions n = p.options("own-routing");
  n.router_replay = false, n.iterations = 1, n.prompts = 3;
  run_rl(n);
  const auto r = records(n.out_dir).at(0);
  std::printf("without replay: routing differed at %.4f of (position, MoE layer); max |Δ log p| %.3g\n",
              r["routing_differ"].get<double>(), r["logprob_mismatch_max"].get<double>());
  EXPECT_GE(r["routing_differ"].get<double>(), 0.0);
  EXPECT_LT(r["routing_differ"].get<double>(), 0.05);
}

// Rollouts on the float64 engine sample from the CPU trainer's own parameters: the trainer's log-probabilities are
// the sampler's to rounding, with partial rollouts carrying episodes across updates (the engine reads the updated
// parameters without a reload; distillation from another model makes every update move them).
TEST(RlLoop, Float64RolloutsAreTheTrainersToRounding) {
  TinyPolicy p;
  RlOptions o = p.options("f64");
  o.partial = 0.5, o.iterations = 3, o.prompts = 2, o.samples = 3;
  o.teachers = {p.teacher};
  o.rollout.precision = Precision::F64;
  run_rl(o);
  const auto recs = records(o.out_dir);
  ASSERT_EQ(recs.size(), 3u);
  int64_t stale = 0;
  for (const auto& r : recs) {
    std::printf("float64 rollouts, iteration %d: max |Δ log p| %.3g over %d tokens, gradient norm %.3g\n",
                r["iteration"].get<int>(), r["logprob_mismatch_max"].get<double>(), r["trained_tokens"].get<int>(),
                r["grad_norm"].get<double>());
    EXPECT_GT(r["trained_tokens"].get<int>(), 0);
    EXPECT_GT(r["grad_norm"].get<double>(), 0.0);
    EXPECT_LE(r["logprob_mismatch_max"].get<double>(), 1e-11);
    stale += r["stale_tokens"].get<int64_t>();
  }
  EXPECT_GT(stale, 0);  // later updates trained tokens an earlier policy sampled
}

// The deterministic mode: the trainer's log-probabilities are the float64 sampler's bit for bit, through updates
// and partial rollouts; and the batch-invariant forward is off again after the run.
TEST(RlLoop, DeterministicModeIsBitwise) {
  TinyPolicy p;
  RlOptions o = p.options("deterministic");
  o.partial = 0.5, o.iterations = 3, o.prompts = 2, o.samples = 3;
  o.teachers = {p.teacher};
  o.rollout.precision = Precision::F64, o.deterministic = true;
  run_rl(o);
  EXPECT_FALSE(f64_batch_invariant());
  for (const auto& r : records(o.out_dir)) {
    EXPECT_GT(r["trained_tokens"].get<int>(), 0);
    EXPECT_GT(r["grad_norm"].get<double>(), 0.0);
    EXPECT_EQ(r["logprob_mismatch_max"].get<double>(), 0.0) << "iteration " << r["iteration"];
  }
  RlOptions f32 = p.options("deterministic-f32");
  f32.deterministic = true;
  EXPECT_THAT(k3test::error_of([&] { run_rl(f32); }), HasSubstr("--deterministic: needs the CPU trainer"));
  RlOptions gpu64 = p.options("f64-on-the-gpu");
  gpu64.rollout = {Device::CUDA, Precision::F64};
  EXPECT_THAT(k3test::error_of([&] { run_rl(gpu64); }), HasSubstr("the float64 engine runs on the CPU"));
}

// A deterministic run without a KL term has nothing above zero for the mismatch plot's log scale: it is drawn on a
// linear one, and says why. With one value above zero, the log scale is back.
TEST(RlPlots, AllZeroMismatchIsDrawnOnALinearScale) {
  k3test::TempDir dir("rl-plot");
  auto script = [&](double kl) {
    {
      std::ofstream m(dir.file("metrics.jsonl"));
      for (int i = 1; i <= 2; ++i)
        m << ojson{{"iteration", i},
                   {"reward", 0.5},
                   {"logprob_mismatch_max", 0.0},
                   {"logprob_mismatch_mean", 0.0},
                   {"kl", i == 2 ? kl : 0.0}}
                 .dump()
          << "\n";
    }
    eval::write_rl_plots(dir.path().string(), dir.file("metrics.jsonl"), "");
    std::ifstream gp(dir.file("plot-data/rl_mismatch.gp"));
    return std::string((std::istreambuf_iterator<char>(gp)), std::istreambuf_iterator<char>());
  };
  const std::string zero = script(0.0);
  EXPECT_THAT(zero, HasSubstr("all zero: bit for bit"));
  EXPECT_THAT(zero, ::testing::Not(HasSubstr("logscale")));
  EXPECT_THAT(script(1e-9), HasSubstr("set logscale y"));
}

// λ = 0.5: each iteration trains once half its episodes are done; the others go on under the next policy. Every
// sampled token is marked with the iteration that sampled it, a carried episode's older tokens keep their
// log-probabilities, and the groups train only once all their episodes are done.
TEST(RlLoop, PartialRolloutsKeepWhichPolicySampledEachToken) {
  TinyPolicy p;
  RlOptions o = p.options("partial");
  o.partial = 0.5, o.iterations = 3, o.prompts = 2, o.samples = 3;
  o.teachers = {p.teacher};  // distillation from another model: every iteration updates the policy
  run_rl(o);
  const auto recs = records(o.out_dir);
  ASSERT_EQ(recs.size(), 3u);
  EXPECT_GT(recs[0]["carried_out"].get<int>(), 0);
  EXPECT_EQ(recs[1]["carried_in"], recs[0]["carried_out"]);
  for (int64_t it = 1; it <= 3; ++it) {
    const TrainState st = checkpoint_state(o.out_dir, it);
    for (const auto& j : st.meta["carried"]) {
      const Episode e = Episode::from_json(j);
      EXPECT_FALSE(e.done);
      for (size_t t = 0; t < e.ids.size(); ++t) {
        EXPECT_EQ(e.sampled[t] != 0, e.policy[t] >= 0);
        EXPECT_LT(e.policy[t], it);  // sampled by a policy of this iteration or before
        if (t > 0 && e.policy[t - 1] >= 0 && e.policy[t] >= 0) {
          EXPECT_GE(e.policy[t], e.policy[t - 1]);
        }
      }
    }
    for (const auto& j : st.meta["waiting"]) EXPECT_TRUE(Episode::from_json(j).done);
  }
  // The carried episodes finish under the next policy: their older tokens are trained against the policy that
  // sampled them, which the update has since moved; the tokens of the iteration's own policy match the sampler's.
  int64_t stale = 0;
  for (const auto& r : recs) {
    std::printf(
        "iteration %d: %d trained tokens of an older policy, max |log ratio| %.3g; own tokens' mismatch "
        "%.3g\n",
        r["iteration"].get<int>(), r["stale_tokens"].get<int>(), r["stale_log_ratio_max"].get<double>(),
        r["logprob_mismatch_max"].get<double>());
    EXPECT_LE(r["logprob_mismatch_max"].get<double>(), 1e-6);
    stale += r["stale_tokens"].get<int64_t>();
    if (r["iteration"].get<int>() > 1 && r["stale_tokens"].get<int>() > 0) {
      EXPECT_GT(r["stale_log_ratio_max"].get<double>(), 1e-4);
    }
  }
  EXPECT_EQ(recs[0]["stale_tokens"], 0);
  EXPECT_GT(stale, 0);
}

TEST(RlLoop, ResumesExactly) {
  TinyPolicy p;
  RlOptions whole = p.options("whole");
  whole.iterations = 3, whole.partial = 0.75, whole.teachers = {p.teacher};
  run_rl(whole);
  RlOptions cut = p.options("cut");
  cut.iterations = 3, cut.partial = 0.75, cut.teachers = {p.teacher};
  int seen = 0;
  cut.on_record = [&](const std::string&) { return ++seen < 2; };
  run_rl(cut);
  cut.on_record = nullptr, cut.resume = true;
  const RlResult r = run_rl(cut);
  EXPECT_EQ(r.iterations_run, 1);
  const auto a = records(whole.out_dir), b = records(cut.out_dir);
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(without_timings(a[i]), without_timings(b[i])) << "record " << i;
  double moved = 0;  // the updates did something to resume
  for (const auto& rec : a) moved += rec["grad_norm"].get<double>();
  EXPECT_GT(moved, 0.0);
  RlOptions other_sampler = cut;  // float64 rollouts change the numbers: not the same run
  other_sampler.rollout.precision = Precision::F64;
  EXPECT_THAT(k3test::error_of([&] { run_rl(other_sampler); }), HasSubstr("other options"));
  cut.prompts = 5;
  EXPECT_THAT(k3test::error_of([&] { run_rl(cut); }), HasSubstr("other options"));
}

TEST(RlLoop, EffortBudgetCountsEpisodesOverIt) {
  TinyPolicy p;
  RlOptions o = p.options("effort");
  o.iterations = 1;
  o.effort_tau_start = o.effort_tau_end = 1e-3;  // every episode writes more than a thousandth of its reference
  o.episode.max_context = 0, o.episode.max_tokens = 8;
  run_rl(o);
  const auto r = records(o.out_dir).at(0);
  EXPECT_EQ(r["effort_violations"], r["episodes"]);
  EXPECT_DOUBLE_EQ(r["reward"].get<double>(), r["outcome"].get<double>() + r["dense_reward"].get<double>() - 1.0);
}

// The policy as its own teacher: every token's reward log π_teacher − log π_old is the f32 engine against itself,
// 0, so nothing moves.
TEST(RlLoop, DistillingFromItselfGivesNoGradient) {
  TinyPolicy p;
  RlOptions o = p.options("distill");
  o.iterations = 1, o.teachers = {p.model};
  run_rl(o);
  const auto r = records(o.out_dir).at(0);
  EXPECT_GT(r["trained_tokens"].get<int>(), 0);
  EXPECT_LE(r["grad_norm"].get<double>(), 1e-12);  // whatever the effort reward: distillation does not read it
}

// --iterations 0: the held-out evaluation of the model alone, the one a run makes before its first iteration.
TEST(RlLoop, ZeroIterationsOnlyEvaluate) {
  TinyPolicy p;
  RlOptions run = p.options("run");
  run.iterations = 1, run.eval_tasks = 3;
  run_rl(run);
  RlOptions only = p.options("only");
  only.iterations = 0, only.eval_tasks = 3;
  const RlResult r = run_rl(only);
  EXPECT_EQ(r.iterations, 0);
  EXPECT_TRUE(r.last_checkpoint.empty());
  EXPECT_FALSE(std::filesystem::exists(only.out_dir + "/latest"));
  const auto a = records(run.out_dir), b = records(only.out_dir);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(a.at(0), b.at(0));  // the same tasks, greedy and sampled, as the run's first evaluation
  for (const char* k : {"eval_success", "eval_sampled_success", "eval_tokens", "eval_sampled_tokens", "eval_tool_calls",
                        "eval_sampled_tool_calls"})
    EXPECT_TRUE(b[0].contains(k)) << k;
  EXPECT_GT(b[0]["eval_sampled_tokens"].get<double>(), 0.0);
  EXPECT_TRUE(a.at(1).contains("tool_calls_per_episode"));
  only.eval_tasks = 0;
  EXPECT_THAT(k3test::error_of([&] { run_rl(only); }), HasSubstr("give --eval-tasks"));
}

TEST(RlLoop, BadOptionsAreNamed) {
  TinyPolicy p;
  RlOptions o = p.options("bad");
  o.partial = 0;
  EXPECT_THAT(k3test::error_of([&] { run_rl(o); }), HasSubstr("--partial"));
  o = p.options("bad");
  o.episode.temperature = 0.7f;
  EXPECT_THAT(k3test::error_of([&] { run_rl(o); }), HasSubstr("temperature must be 1"));
  o = p.options("bad");
  o.env = "nope";
  EXPECT_THAT(k3test::error_of([&] { run_rl(o); }), HasSubstr("unknown environment"));
  o = p.options("bad");
  o.resume = true;
  EXPECT_THAT(k3test::error_of([&] { run_rl(o); }), HasSubstr("no checkpoint"));
}
