#include "train/rl_loop.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

#include "core/error.h"
#include "core/splitmix.h"
#include "io/dir_lock.h"
#include "io/file.h"
#include "io/jsonl.h"
#include "io/output_file.h"
#include "kernels/gemm/linear_f64.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/engine_f64.h"
#include "tokenizer/xtml_chat.h"
#include "train/advantages.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/policy_gradient.h"

namespace k3::train {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

int64_t reference_tokens(const Tokenizer& tok, const Task& task) {
  if (!task.reference.is_array() || task.reference.empty()) return 0;
  ojson req = task.request;
  for (const auto& m : task.reference) req["messages"].push_back(m);
  req["add_generation_prompt"] = false;
  std::vector<uint8_t> assistant;
  encode_segments(tok, render_chat(req), &assistant);
  int64_t n = 0;
  for (uint8_t a : assistant) n += a;
  return n;
}

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

uint64_t episode_seed(uint64_t seed, int64_t task, int64_t sample) {
  return splitmix64(seed ^ splitmix64(uint64_t(task) * 0x100000001b3ULL + uint64_t(sample) + 0x51ed2701ULL));
}

// What identifies a run: a resumed one must repeat it.
nlohmann::json run_recipe(const RlOptions& o, const std::string& config_text) {
  nlohmann::json r = {{"config", config_text},
                      {"env", o.env},
                      {"env_options", o.env_options},
                      {"prompts", o.prompts},
                      {"samples", o.samples},
                      {"max_tokens", o.episode.max_tokens},
                      {"max_turns", o.episode.max_turns},
                      {"partial", o.partial},
                      {"lr", o.lr},
                      {"clip_eps", o.clip_eps},
                      {"kl_coef", o.kl_coef},
                      {"effort_tau", {o.effort_tau_start, o.effort_tau_end}},
                      {"router_replay", o.router_replay},
                      {"teachers", o.teachers},
                      {"teacher_clip", o.teacher_clip},
                      {"seed", o.seed},
                      {"iterations", o.iterations}};
  // The samplers that change the numbers (float64 rollouts sample from unrounded weights), named only when chosen so
  // that runs recorded before they existed still resume.
  if (o.rollout.precision == Precision::F64) r["rollout_precision"] = "f64";
  if (o.deterministic) r["deterministic"] = true;
  return r;
}

// A routing recorded for all of a sequence of T tokens but its last position (sampled, never fed to the engine),
// completed with the experts of the position before: the last position's routing changes no loss term (nothing is
// predicted from it, and every position before it is causal).
RouterReplay complete_routing(const RouterReplay& recorded, const K3Config& c, int64_t T) {
  RouterReplay r = recorded;
  const size_t K = size_t(c.num_experts_per_token);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    std::vector<int32_t>& v = r[size_t(l)];
    K3_CHECK(v.size() >= K && v.size() <= size_t(T) * K, "router replay: layer ", l, " recorded ", v.size() / K,
             " positions of ", T);
    while (v.size() < size_t(T) * K) v.insert(v.end(), v.end() - std::ptrdiff_t(K), v.end());
  }
  return r;
}

struct Trained {
  int64_t episodes = 0, groups = 0, tokens = 0, clipped = 0;
  double loss = 0, kl = 0, ratio = 0, grad_norm = 0;
  double mismatch_max = 0, mismatch_mean = 0;
  int64_t mismatch_tokens = 0;
  int64_t stale_tokens = 0;    // trained tokens an earlier iteration's policy sampled (partial rollouts)
  double stale_max = 0;        // their largest |log π_θ − log π_old|
  double routing_differ = -1;  // fraction of (position, MoE layer) whose expert set differs; -1: not measured
  std::vector<double> max_vio;
};

}  // namespace

RlResult run_rl(const RlOptions& o) {
  if (o.model_dir.empty()) fail("k3 rl: no starting model (--model)");
  if (o.out_dir.empty()) fail("k3 rl: no run directory (--out)");
  if (o.iterations < 0) fail("--iterations must be at least 0, got ", o.iterations);
  if (o.iterations == 0 && o.eval_tasks < 1) fail("--iterations 0 only evaluates the model: give --eval-tasks");
  if (o.iterations == 0 && o.resume) fail("--iterations 0 evaluates --model; it does not --resume a run");
  if (o.prompts < 1) fail("--prompts must be at least 1, got ", o.prompts);
  if (o.samples < 1) fail("--samples must be at least 1, got ", o.samples);
  if (!(o.partial > 0.0 && o.partial <= 1.0)) fail("--partial (λ) must be in (0, 1], got ", o.partial);
  if (!(o.lr > 0.0)) fail("--lr must be > 0, got ", o.lr);
  if (o.effort_tau_start < 0 || o.effort_tau_end < 0) fail("--effort-tau values must be >= 0");
  if (!(o.teacher_clip > 0.0)) fail("--teacher-clip must be > 0, got ", o.teacher_clip);
  if (o.episode.temperature != 1.0f)
    fail("RL trains the policy it samples: the rollout temperature must be 1, got ", o.episode.temperature);
  if (o.save_every < 1) fail("--save-every must be at least 1, got ", o.save_every);
  if (o.rollout.precision == Precision::F64 && o.rollout.device != Device::CPU)
    fail("--rollout-precision f64: the float64 engine runs on the CPU (--rollout-device cpu)");
  if (o.deterministic && (o.gpu || o.rollout.device != Device::CPU || o.rollout.precision != Precision::F64))
    fail("--deterministic: needs the CPU trainer and float64 rollouts on the CPU (--rollout-precision f64)");
  struct BatchInvariance {  // on for the run, restored after it however it ends
    bool before = f64_batch_invariant();
    explicit BatchInvariance(bool on) { set_f64_batch_invariant(before || on); }
    ~BatchInvariance() { set_f64_batch_invariant(before); }
  } const batch_invariance(o.deterministic);
  fs::create_directories(o.out_dir);
  const DirectoryLock run_lock(o.out_dir, "run directory");

  const std::string tok_dir = o.tokenizer_dir.empty() ? o.model_dir : o.tokenizer_dir;
  if (!Tokenizer::dir_has_tokenizer(tok_dir))
    fail(tok_dir, ": no tokenizer (tiktoken.model); give the model's with --tokenizer");
  const Tokenizer tok = Tokenizer::load_dir(tok_dir);
  const std::string config_path = (fs::path(o.model_dir) / "config.json").string();
  const std::string config_text = read_file(config_path, "config");
  const K3Config c = load_config(config_path);
  tok.check_fits(c.vocab_size, tok_dir, c.source);
  std::vector<std::string> tokenizer_files;
  for (const char* f : {"tiktoken.model", "tokenizer_config.json"})
    if (fs::is_regular_file(fs::path(tok_dir) / f)) tokenizer_files.push_back((fs::path(tok_dir) / f).string());
  std::unique_ptr<Environment> env = make_environment(o.env, o.env_options);

  std::vector<std::unique_ptr<Engine>> teachers;
  for (const std::string& t : o.teachers) {
    teachers.push_back(Engine::load(t, o.rollout));
    if (teachers.back()->config().vocab_size != c.vocab_size)
      fail(t, ": the teacher's vocabulary (", teachers.back()->config().vocab_size, ") is not the policy's (",
           c.vocab_size, ")");
  }

  // The trainer's state: the starting model, or the latest checkpoint.
  const std::string resume_dir = o.resume ? latest_checkpoint(o.out_dir) : "";
  if (o.resume && resume_dir.empty()) fail(o.out_dir, ": --resume, but there is no checkpoint (no 'latest')");
  ParamStore P = ParamStore::from_model_dir(resume_dir.empty() ? o.model_dir : resume_dir);
  OptimizerConfig oc;
  oc.weight_decay = o.weight_decay;
  Optimizer optimizer(P, oc, k3_head_splits(P, c));
  const nlohmann::json recipe = run_recipe(o, config_text);
  const std::string metrics_path = (fs::path(o.out_dir) / "metrics.jsonl").string();
  int64_t iteration = 0, next_task = 0;
  std::vector<Episode> carried, waiting;  // unfinished; finished, waiting for their group
  OptimizerState resume_optimizer;
  nlohmann::json resume_balancers;
  int64_t resume_lanes = 0;
  RlResult res;
  if (!resume_dir.empty()) {
    TrainState st;
    load_checkpoint(resume_dir, P, st);
    const std::string state_file = (fs::path(resume_dir) / "train_state.bin").string();
    try {
      if (st.meta.at("recipe") != recipe)
        fail(state_file,
             ": the run was started with other options (environment, sizes, rates, seed, ...); resume "
             "it with the same ones");
      iteration = st.meta.at("iteration").get<int64_t>();
      next_task = st.meta.at("next_task").get<int64_t>();
      for (const auto& e : st.meta.at("carried")) carried.push_back(Episode::from_json(e));
      for (const auto& e : st.meta.at("waiting")) waiting.push_back(Episode::from_json(e));
      resume_optimizer = {st.meta.at("optimizer"), st.optimizer};
      resume_balancers = st.meta.at("balancers");
      resume_lanes = st.meta.at("grad_lanes").get<int64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(state_file, ": corrupt RL state (", e.what(), ")");
    }
    std::string kept;  // records past the checkpoint belong to the run that was cut off
    if (fs::exists(metrics_path))
      for (const JsonlRecord& r : read_jsonl(metrics_path, "run metrics", InputRole::kOwnState).records)
        if (r.value.contains("iteration") && r.value["iteration"].is_number_integer() &&
            r.value["iteration"].get<int64_t>() <= iteration)
          kept += r.text + "\n";
    write_file_atomic(metrics_path, kept);
    res.iterations = iteration;
    res.last_checkpoint = resume_dir;
    std::fprintf(stderr, "resumed from %s after iteration %lld\n", resume_dir.c_str(), (long long)iteration);
  } else {
    write_file_atomic(metrics_path, "");
  }
  BalanceOptions balance;
  // Gradient lanes: the thread count for a new run, the saved count for a resumed one (so it sums in the same order).
  int64_t lanes = resume_lanes > 0 ? resume_lanes : std::max(1, omp_get_max_threads());
  const std::unique_ptr<TrainDevice> device = o.gpu ? make_cuda_train_device(P, c, optimizer, balance, o.cuda)
                                                    : make_cpu_train_device(P, c, optimizer, balance, lanes);
  if (!resume_dir.empty()) device->load_state(resume_optimizer, resume_balancers);
  std::fprintf(stderr,
               "k3 rl: environment %s, %lld tasks x %lld samples per iteration, trainer %s, rollouts %s (%s)%s\n",
               env->name().c_str(), (long long)o.prompts, (long long)o.samples, device->describe().c_str(),
               device_name(o.rollout.device), precision_name(o.rollout.precision),
               o.deterministic ? ", deterministic" : "");

  // The rollout engine holds the policy the trainer has: RUN/policy, rewritten after every update.
  const std::string policy_dir = (fs::path(o.out_dir) / "policy").string();
  std::unique_ptr<Engine> engine;
  // With the CPU trainer and float64 rollouts, the engine samples from P itself, which store_values updates.
  const bool sample_from_P = !o.gpu && o.rollout.precision == Precision::F64;
  auto sync_policy = [&]() {
    device->store_values(P);  // the values and the routers' biases; the optimizer state stays where it is
    // The f32 sampler runs fp32 weights. The CPU trainer's float64 parameters are rounded to them, so that it
    // computes with exactly the policy that sampled (its update and optimizer state stay float64); the GPU
    // trainer's master weights are fp32 already.
    if (!o.gpu && !sample_from_P)
      for (double& v : P.values()) v = double(float(v));
    write_model_dir(policy_dir, config_text, P, tokenizer_files);
    if (sample_from_P) {
      if (!engine) engine = float64_engine(std::shared_ptr<const ParamStore>(std::shared_ptr<void>(), &P), c);
      return;
    }
    engine.reset();
    engine = Engine::load(policy_dir, o.rollout);
  };
  sync_policy();

  const int fd = open_append(metrics_path);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  auto record = [&](const nlohmann::json& rec) {
    const std::string line = rec.dump();
    append_all(fd, line + "\n", metrics_path);
    return !o.on_record || o.on_record(line);
  };

  std::map<int64_t, int64_t> budget_cache;
  auto budget = [&](const Episode& e) {
    auto it = budget_cache.find(e.task_index);
    if (it == budget_cache.end()) it = budget_cache.emplace(e.task_index, reference_tokens(tok, e.task)).first;
    return it->second;
  };

  // Held-out: episodes of tasks from their own stream, greedy and then sampled as the rollouts are (the policy RL
  // improves is the sampled one; its greedy success can lag behind).
  auto evaluate = [&]() {
    const uint64_t eval_seed = splitmix64(o.seed ^ 0xe7a1u);
    auto success_of = [&](bool greedy, double* tokens, double* tool_calls) {
      std::vector<Episode> eps;
      for (int64_t i = 0; i < o.eval_tasks; ++i)
        eps.push_back(start_episode(tok, env->task(eval_seed, i), i, 0, episode_seed(eval_seed, i, 0)));
      std::vector<Episode*> ptrs;
      for (Episode& e : eps) ptrs.push_back(&e);
      EpisodeOptions eo = o.episode;
      eo.greedy = greedy, eo.record_routing = false;
      run_episodes(*engine, tok, *env, ptrs, eo, -1, 0);
      double success = 0, generated = 0, calls = 0;
      for (const Episode& e : eps)
        success += e.outcome > 0, generated += double(e.generated()), calls += double(e.tool_calls);
      const double n = double(o.eval_tasks);
      *tokens = generated / n, *tool_calls = calls / n;
      return success / n;
    };
    double greedy_calls = 0, sampled_tokens = 0, sampled_calls = 0;
    res.last_eval_success = success_of(true, &res.last_eval_tokens, &greedy_calls);
    const double sampled = success_of(false, &sampled_tokens, &sampled_calls);
    if (res.first_eval_success < 0) res.first_eval_success = res.last_eval_success;
    std::fprintf(stderr,
                 "held-out after iteration %lld: success %.3f greedy, %.3f sampled, over %lld tasks; per greedy "
                 "episode %.1f tokens, %.2f tool calls (sampled: %.2f)\n",
                 (long long)iteration, res.last_eval_success, sampled, (long long)o.eval_tasks, res.last_eval_tokens,
                 greedy_calls, sampled_calls);
    return record({{"iteration", iteration},
                   {"eval_success", res.last_eval_success},
                   {"eval_sampled_success", sampled},
                   {"eval_tokens", res.last_eval_tokens},
                   {"eval_tool_calls", greedy_calls},
                   {"eval_sampled_tokens", sampled_tokens},
                   {"eval_sampled_tool_calls", sampled_calls},
                   {"eval_tasks", o.eval_tasks}});
  };
  if (o.eval_tasks > 0 && resume_dir.empty() && !evaluate()) return res;
  if (o.iterations == 0) return res;  // evaluation only

  auto save = [&]() {
    TrainState st;
    OptimizerState os;
    nlohmann::json bj;
    device->save_state(P, os, bj);
    nlohmann::json cj = nlohmann::json::array(), wj = nlohmann::json::array();
    for (const Episode& e : carried) cj.push_back(e.to_json());
    for (const Episode& e : waiting) wj.push_back(e.to_json());
    st.meta = {{"iteration", iteration}, {"next_task", next_task}, {"carried", cj},   {"waiting", wj},
               {"recipe", recipe},       {"optimizer", os.header}, {"balancers", bj}, {"grad_lanes", lanes}};
    st.optimizer = std::move(os.data);
    return save_checkpoint(o.out_dir, iteration, config_text, P, st, tokenizer_files);
  };

  const bool distill = !teachers.empty();
  while (iteration < o.iterations) {
    const double progress = o.iterations > 1 ? double(iteration) / double(o.iterations - 1) : 0.0;
    const double tau = o.effort_tau_start + (o.effort_tau_end - o.effort_tau_start) * progress;
    // 1. Rollouts: the carried episodes and N new tasks' K episodes, stepped together.
    const auto t_roll = Clock::now();
    std::vector<Episode> fresh;
    for (int64_t p = 0; p < o.prompts; ++p, ++next_task) {
      const Task task = env->task(o.seed, next_task);
      for (int64_t k = 0; k < o.samples; ++k)
        fresh.push_back(start_episode(tok, task, next_task, k, episode_seed(o.seed, next_task, k)));
    }
    std::vector<Episode*> batch;
    for (Episode& e : carried) batch.push_back(&e);
    for (Episode& e : fresh) batch.push_back(&e);
    const int64_t carried_in = int64_t(carried.size());
    const int64_t stop = int64_t(std::ceil(o.partial * double(batch.size()) - 1e-9));
    EpisodeOptions eo = o.episode;
    eo.record_routing = o.router_replay || !o.gpu;  // replayed, or compared with the CPU trainer's routing
    const RolloutStats rs = run_episodes(*engine, tok, *env, batch, eo, int32_t(iteration), stop);
    std::vector<Episode> still;
    for (Episode* e : batch) (e->done ? waiting : still).push_back(std::move(*e));
    carried = std::move(still);
    const double roll_s = since(t_roll);

    // 2-3. Complete groups, their returns and advantages.
    std::map<int64_t, int64_t> in_group;
    for (const Episode& e : waiting) ++in_group[e.task_index];
    std::vector<Episode> train_eps, keep;
    for (Episode& e : waiting) (in_group[e.task_index] == o.samples ? train_eps : keep).push_back(std::move(e));
    waiting = std::move(keep);
    std::stable_sort(train_eps.begin(), train_eps.end(), [](const Episode& a, const Episode& b) {
      return a.task_index != b.task_index ? a.task_index < b.task_index : a.sample < b.sample;
    });
    double outcome_sum = 0, dense_sum = 0, reward_sum = 0, success = 0, gen_sum = 0, calls = 0;
    int64_t violations = 0, tool_errors = 0;
    std::map<std::string, int64_t> ends;
    std::vector<double> effort(train_eps.size(), 0.0), returns(train_eps.size(), 0.0);
    for (size_t i = 0; i < train_eps.size(); ++i) {
      const Episode& e = train_eps[i];
      const int64_t b0 = budget(e);
      if (tau > 0 && b0 > 0 && double(e.generated()) > tau * double(b0)) effort[i] = -1.0, ++violations;
      outcome_sum += e.outcome, dense_sum += e.dense_reward();
      returns[i] = e.outcome + e.dense_reward() + effort[i];
      reward_sum += returns[i];
      success += e.outcome > 0, gen_sum += double(e.generated()), calls += double(e.tool_calls);
      tool_errors += e.end == "tool_error";
      ++ends[e.end];
    }
    // Returns-to-go, normalised by the group's whole returns (group_norms: an all-equal group trains nothing).
    const std::vector<GroupNorm> norm = group_norms(returns, o.samples);
    std::vector<PolicySample> samples;
    for (size_t i = 0; i < train_eps.size(); ++i) {
      const Episode& e = train_eps[i];
      const GroupNorm& n = norm[i / size_t(o.samples)];
      PolicySample s;
      s.ids = e.ids, s.sampled = e.sampled, s.behaviour_logp = e.logp, s.reference_logp = e.logp;
      s.advantage.assign(e.ids.size(), 0.0);
      if (!distill) {
        double to_go = e.dense_reward();  // G_t: the dense rewards at or after t
        for (size_t t = 0; t < e.ids.size(); ++t) {
          if (e.sampled[t]) s.advantage[t] = (e.outcome + effort[i] + to_go - n.mean) * n.scale;
          to_go -= e.reward[t];
        }
      }
      samples.push_back(std::move(s));
    }
    if (distill) {  // MOPD: each token's clipped log-ratio to its task's teacher
      for (size_t i = 0; i < samples.size(); ++i) {
        Engine& teacher = *teachers[size_t(train_eps[i].task_index) % teachers.size()];
        const std::vector<double> teacher_logp = teacher.sequence_logprobs(samples[i].ids);
        for (size_t t = 1; t < samples[i].ids.size(); ++t)
          if (samples[i].sampled[t])
            samples[i].advantage[t] =
                std::clamp(teacher_logp[t] - samples[i].behaviour_logp[t], -o.teacher_clip, o.teacher_clip);
      }
    }

    // 4. The update.
    const auto t_train = Clock::now();
    Trained tr;
    tr.episodes = int64_t(train_eps.size()), tr.groups = int64_t(train_eps.size()) / o.samples;
    int64_t train_tokens = 0;
    if (!samples.empty()) {
      std::vector<std::vector<int32_t>> pieces;
      std::vector<TokenMask> masks;
      for (const PolicySample& s : samples) {
        pieces.push_back(s.ids), masks.push_back(s.sampled);
        train_tokens += int64_t(s.ids.size());
      }
      std::vector<RouterReplay> own, replay;
      std::vector<std::vector<double>> lp;
      if (o.router_replay) {
        for (size_t i = 0; i < pieces.size(); ++i)
          replay.push_back(complete_routing(train_eps[i].routing, c, int64_t(pieces[i].size())));
        lp = device->token_logprobs(pieces, &replay, nullptr);
      } else if (!o.gpu) {
        lp = device->token_logprobs(pieces, nullptr, &own);
        // How often the trainer's own routing differs from the rollout's: the expert sets of each (position,
        // MoE layer) the rollout recorded.
        int64_t rows = 0, differ = 0;
        const size_t K = size_t(c.num_experts_per_token);
        for (size_t i = 0; i < pieces.size(); ++i)
          for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
            const std::vector<int32_t>& rec = train_eps[i].routing[size_t(l)];
            for (size_t p = 0; p + K <= rec.size(); p += K) {
              std::set<int32_t> a(rec.begin() + std::ptrdiff_t(p), rec.begin() + std::ptrdiff_t(p + K));
              std::set<int32_t> b(own[i][size_t(l)].begin() + std::ptrdiff_t(p),
                                  own[i][size_t(l)].begin() + std::ptrdiff_t(p + K));
              ++rows, differ += a != b;
            }
          }
        tr.routing_differ = rows ? double(differ) / double(rows) : 0.0;
      } else {
        lp = device->token_logprobs(pieces, nullptr, nullptr);
      }
      // The policy-gradient weights (train/policy_gradient.h), with the trainer-sampler comparison on the tokens
      // this iteration's policy sampled.
      for (const PolicySample& s : samples) tr.tokens += target_count(int64_t(s.ids.size()), {}, &s.sampled);
      const double inv_n = 1.0 / double(std::max<int64_t>(tr.tokens, 1));
      PolicyLossOptions loss_options;
      loss_options.clip_eps = o.clip_eps, loss_options.kl_coef = o.kl_coef;
      std::vector<TokenWeights> weights;
      for (size_t i = 0; i < samples.size(); ++i) {
        const PolicySample& s = samples[i];
        TokenWeights w(s.ids.size(), 0.0);
        for (size_t t = 1; t < s.ids.size(); ++t) {
          if (!s.sampled[t]) continue;
          const double log_ratio = lp[i][t] - s.behaviour_logp[t];
          const PolicyTokenTerm term =
              policy_token_term(lp[i][t], s.behaviour_logp[t], s.reference_logp[t], s.advantage[t], loss_options);
          tr.loss += term.loss * inv_n;
          w[t] = term.weight * inv_n;
          tr.clipped += term.clipped, tr.ratio += term.ratio * inv_n, tr.kl += 0.5 * log_ratio * log_ratio * inv_n;
          if (train_eps[i].policy[t] == int32_t(iteration)) {
            tr.mismatch_max = std::max(tr.mismatch_max, std::abs(log_ratio));
            tr.mismatch_mean += std::abs(log_ratio);
            ++tr.mismatch_tokens;
          } else {
            tr.stale_max = std::max(tr.stale_max, std::abs(log_ratio));
            ++tr.stale_tokens;
          }
        }
        weights.push_back(std::move(w));
      }
      if (tr.mismatch_tokens) tr.mismatch_mean /= double(tr.mismatch_tokens);
      device->weighted_gradients(pieces, masks, weights, o.router_replay ? &replay : nullptr);
      std::string bad;
      tr.grad_norm = device->clip(o.clip, &bad);
      tr.max_vio = device->finish_balance();
      if (!std::isfinite(tr.grad_norm) || !bad.empty())
        fail("iteration ", iteration + 1, ": non-finite gradient", bad.empty() ? "" : " (first in " + bad + ")",
             "; lower --lr");
      if (const std::string b = device->update(o.lr); !b.empty())
        fail("iteration ", iteration + 1, ": the update made parameter ", b, " non-finite; lower --lr");
    }
    const double train_s = since(t_train);
    ++iteration;
    ++res.iterations_run;
    res.iterations = iteration;

    // 5. The rollout engine takes the new policy.
    const auto t_sync = Clock::now();
    if (!samples.empty()) sync_policy();
    const double sync_s = since(t_sync);

    const double n = double(std::max<size_t>(train_eps.size(), 1));
    nlohmann::json rec = {{"iteration", iteration},
                          {"episodes", tr.episodes},
                          {"groups", tr.groups},
                          {"reward", reward_sum / n},
                          {"outcome", outcome_sum / n},
                          {"dense_reward", dense_sum / n},
                          {"success", success / n},
                          {"tokens_per_episode", gen_sum / n},
                          {"tool_calls_per_episode", calls / n},
                          {"effort_tau", tau},
                          {"effort_violations", violations},
                          {"tool_errors", tool_errors},
                          {"ends", ends},
                          {"carried_in", carried_in},
                          {"carried_out", int64_t(carried.size())},
                          {"waiting", int64_t(waiting.size())},
                          {"loss", tr.loss},
                          {"kl", tr.kl},
                          {"ratio", tr.ratio},
                          {"clipped", tr.clipped},
                          {"trained_tokens", tr.tokens},
                          {"logprob_mismatch_max", tr.mismatch_max},
                          {"logprob_mismatch_mean", tr.mismatch_mean},
                          {"routing_differ", tr.routing_differ},
                          {"stale_tokens", tr.stale_tokens},
                          {"stale_log_ratio_max", tr.stale_max},
                          {"grad_norm", tr.grad_norm},
                          {"max_vio", tr.max_vio},
                          {"rollout_s", roll_s},
                          {"train_s", train_s},
                          {"sync_s", sync_s},
                          {"rollout_tokens", rs.sampled},
                          {"rollout_tok_s", double(rs.sampled) / std::max(roll_s, 1e-9)},
                          {"train_tok_s", double(train_tokens) / std::max(train_s, 1e-9)},
                          {"tool_s", rs.tool_seconds}};
    std::fprintf(stderr,
                 "iter %lld/%lld  reward %.3f  success %.3f  len %.1f  over-budget %lld  mismatch %.2e  |g| %.3f  "
                 "rollout %.1fs (%.0f tok/s)  train %.1fs (%.0f tok/s)  carried %lld\n",
                 (long long)iteration, (long long)o.iterations, reward_sum / n, success / n, gen_sum / n,
                 (long long)violations, tr.mismatch_max, tr.grad_norm, roll_s,
                 double(rs.sampled) / std::max(roll_s, 1e-9), train_s, double(train_tokens) / std::max(train_s, 1e-9),
                 (long long)carried.size());
    bool go_on = record(rec);
    if (go_on && o.eval_tasks > 0 && ((o.eval_every > 0 && iteration % o.eval_every == 0) || iteration == o.iterations))
      go_on = evaluate();
    if (iteration % o.save_every == 0 || iteration == o.iterations) res.last_checkpoint = save();
    if (!go_on) break;
  }
  return res;
}

}  // namespace k3::train
