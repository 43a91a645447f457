// k3 rl / k3 distill / k3 rl-tasks: on-policy RL of a model in an environment; on-policy distillation from
// teachers; an environment's tasks and reference transcripts (supervised fine-tuning data for `k3 sft`).
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/commands.h"
#include "core/error.h"
#include "eval/plots.h"
#include "io/output_file.h"
#include "model/cuda/cuda_model.h"
#include "train/environment.h"
#include "train/rl_loop.h"

namespace k3::cli {

namespace {

nlohmann::json parse_env_options(const std::string& text) {
  if (text.empty()) return nlohmann::json::object();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail("--env-options: not JSON (", e.what(), ")");
  }
  if (!j.is_object()) fail("--env-options: must be a JSON object, e.g. '{\"digits\": 2}'");
  return j;
}

struct RlFlags {
  std::shared_ptr<train::RlOptions> o = std::make_shared<train::RlOptions>();
  std::shared_ptr<std::string> env_options = std::make_shared<std::string>();
  std::shared_ptr<std::string> device = std::make_shared<std::string>("cpu");
  std::shared_ptr<std::string> rollout_device = std::make_shared<std::string>();
  std::shared_ptr<std::string> precision = std::make_shared<std::string>();
  std::shared_ptr<std::string> rollout_precision = std::make_shared<std::string>();
  std::shared_ptr<bool> no_replay = std::make_shared<bool>(false);
  std::shared_ptr<bool> deterministic = std::make_shared<bool>(false);
  std::shared_ptr<std::vector<double>> tau = std::make_shared<std::vector<double>>();

  void add(CLI::App* sub) {
    train::RlOptions& t = *o;
    sub->add_option("--model", t.model_dir, "the starting policy: a model directory with its tokenizer")->required();
    sub->add_option("--out", t.out_dir, "run directory")->required();
    sub->add_option("--tokenizer", t.tokenizer_dir, "tokenizer directory (default: MODEL's)");
    sub->add_option(
           "--env", t.env,
           "environment: calculator, kb (multi-hop lookups), retrieval (long-context recall), or mcp (your tools over "
           "stdio); --env-options sets its options (README, \"Reinforcement learning\")")
        ->capture_default_str();
    sub->add_option("--env-options", *env_options, "the environment's options as a JSON object");
    sub->add_option("--iterations", t.iterations,
                    "iterations (rollouts, then one update); 0 with --eval-tasks: only evaluate --model")
        ->capture_default_str();
    sub->add_option("--prompts", t.prompts, "N: new tasks per iteration")->capture_default_str();
    sub->add_option("--samples", t.samples, "K: episodes per task (the group advantages compare)")
        ->capture_default_str();
    sub->add_option("--max-tokens", t.episode.max_tokens, "tokens the policy may write per episode, all turns")
        ->capture_default_str();
    sub->add_option("--max-turns", t.episode.max_turns, "assistant messages per episode")->capture_default_str();
    sub->add_option("--partial", t.partial,
                    "λ: an iteration trains once this fraction of its episodes has finished; the rest continue "
                    "in the next iteration under the new policy (partial rollouts; 1: wait for all)")
        ->capture_default_str();
    sub->add_option("--lr", t.lr, "learning rate (constant)")->capture_default_str();
    sub->add_option("--weight-decay", t.weight_decay, "decoupled weight decay (matrices)")->capture_default_str();
    sub->add_option("--clip", t.clip, "gradient clipping: max global norm (0: off)")->capture_default_str();
    sub->add_option("--clip-eps", t.clip_eps, "ε of the clipped importance ratio")->capture_default_str();
    sub->add_option("--kl-coef", t.kl_coef, "β of the per-token regulariser (β/2)(log π − log π_rollout)²")
        ->capture_default_str();
    sub->add_flag("--no-router-replay", *no_replay,
                  "let the trainer route every position itself instead of reusing the rollout's experts "
                  "(with the CPU trainer, metrics.jsonl then says how often the routing differed)");
    sub->add_option("--device", *device, "where the updates run: cpu (float64) or cuda (one Hopper GPU)")
        ->check(CLI::IsMember({"cpu", "cuda"}))
        ->capture_default_str();
    sub->add_option("--precision", *precision, "cuda only: the trainer's bf16 (default) or f32")
        ->check(CLI::IsMember({"bf16", "f32"}));
    sub->add_option("--rollout-device", *rollout_device, "where the rollouts run: cpu or cuda (default: --device)")
        ->check(CLI::IsMember({"cpu", "cuda"}));
    sub->add_option("--rollout-precision", *rollout_precision,
                    "CPU rollouts: f32 (the default; the inference engine) or f64 (the float64 engine, which with "
                    "the CPU trainer samples from the trainer's own parameters: its log-probabilities equal the "
                    "trainer's to rounding; slower rollouts, on the training blocks' plain loops)")
        ->check(CLI::IsMember({"f32", "f64"}));
    sub->add_flag("--deterministic", *deterministic,
                  "the trainer's log-probabilities of the sampled tokens equal the sampler's bit for bit: float64 "
                  "rollouts (implied) and a batch-invariant float64 forward in both, the KDA recurrence token by "
                  "token; the CPU trainer only, and slower still (the trainer's forward on plain loops too)");
    sub->add_option("--seed", t.seed, "the tasks and every episode's draws")->capture_default_str();
    sub->add_option("--save-every", t.save_every, "checkpoint every N iterations (and at the end)")
        ->capture_default_str();
    sub->add_flag("--resume", t.resume, "continue from OUT/latest; the run's options must be repeated");
    sub->add_option("--eval-tasks", t.eval_tasks,
                    "held-out success: greedy episodes of this many tasks of their own stream, before the first "
                    "iteration and after the last (0: none)")
        ->capture_default_str();
    sub->add_option("--eval-every", t.eval_every, "also evaluate every N iterations")->capture_default_str();
  }

  void finish() const {
    train::RlOptions& t = *o;
    t.env_options = parse_env_options(*env_options);
    t.router_replay = !*no_replay;
    t.gpu = *device == "cuda";
    if (!precision->empty()) {
      if (!t.gpu) fail("--precision ", *precision, ": the CPU trains in float64; --precision is for --device cuda");
      t.cuda.precision = parse_gpu_precision(*precision, "--precision");
    }
    t.rollout.device = parse_device(rollout_device->empty() ? *device : *rollout_device, "--rollout-device");
    t.rollout.precision = t.rollout.device == Device::CUDA ? Precision::BF16 : Precision::F32;
    if (t.rollout.device == Device::CUDA && t.gpu && t.cuda.precision == GpuPrecision::F32)
      t.rollout.precision = Precision::F32;
    t.deterministic = *deterministic;
    if (t.deterministic && rollout_precision->empty() && t.rollout.device == Device::CPU)
      t.rollout.precision = Precision::F64;
    if (!rollout_precision->empty()) {
      if (t.rollout.device == Device::CUDA)
        fail("--rollout-precision ", *rollout_precision,
             ": for CPU rollouts; on the GPU the rollouts follow --precision");
      t.rollout.precision = parse_precision(*rollout_precision, "--rollout-precision");
    }
  }
};

void print_result(const train::RlResult& r, const std::string& out_dir) {
  if (!r.last_checkpoint.empty())
    std::printf("%lld iterations (%lld in this run); checkpoint %s\n", (long long)r.iterations,
                (long long)r.iterations_run, r.last_checkpoint.c_str());
  if (r.last_eval_success >= 0)
    std::printf("held-out success %.3f (first evaluation %.3f), %.1f tokens per episode\n", r.last_eval_success,
                r.first_eval_success, r.last_eval_tokens);
  if (r.iterations == 0) return;  // an evaluation only: nothing to plot
  const std::string metrics = (std::filesystem::path(out_dir) / "metrics.jsonl").string();
  for (const eval::PlotResult& p : eval::write_rl_plots(out_dir, metrics, eval::find_gnuplot()))
    if (p.drawn) std::printf("plot %s\n", p.png.c_str());
    else std::printf("plot %s not drawn: %s\n", p.name.c_str(), p.note.c_str());
}

}  // namespace

void register_rl(CLI::App& app) {
  RlFlags f;
  CLI::App* sub = app.add_subcommand(
      "rl",
      "On-policy RL of a K3 model in an environment: each iteration samples K episodes of N tasks on the\n"
      "inference engine (multi-turn: the environment runs the policy's tool calls), scores them (outcome,\n"
      "dense tool rewards, the effort reward), and makes one clipped policy-gradient update with\n"
      "group-normalised advantages and router replay. Partial rollouts (--partial) carry unfinished\n"
      "episodes into the next iteration. Writes OUT/policy (the current policy), OUT/step-N checkpoints\n"
      "(--resume continues exactly) and OUT/metrics.jsonl (reward, success, length, effort-budget\n"
      "violations, KL and log-prob mismatch to the rollout policy, routing differences, MaxVio, timings).");
  f.add(sub);
  sub->add_option("--effort-tau", *f.tau,
                  "effort reward: -1 when an episode's tokens exceed τ times its task's reference solution's; one "
                  "value, or START END annealed linearly over the run (default: off)")
      ->expected(1, 2);
  sub->callback([f] {
    f.finish();
    train::RlOptions& t = *f.o;
    if (!f.tau->empty()) t.effort_tau_start = f.tau->front(), t.effort_tau_end = f.tau->back();
    print_result(train::run_rl(t), t.out_dir);
  });
}

void register_distill(CLI::App& app) {
  RlFlags f;
  CLI::App* sub = app.add_subcommand(
      "distill",
      "Multi-teacher on-policy distillation (MOPD): the student samples episodes of the environment's\n"
      "tasks as in `k3 rl`, and every token it wrote gets the reward clip(log π_teacher − log π_student,\n"
      "−R_max, R_max) from its task's teacher (tasks go to the teachers in turn); one clipped\n"
      "policy-gradient update per iteration. Same run directory, checkpoints and metrics as `k3 rl`.");
  f.add(sub);
  sub->add_option("--teacher", f.o->teachers, "teacher model directory (repeat for several)")->required();
  sub->add_option("--teacher-clip", f.o->teacher_clip, "R_max")->capture_default_str();
  sub->callback([f] {
    f.finish();
    print_result(train::run_rl(*f.o), f.o->out_dir);
  });
}

void register_rl_tasks(CLI::App& app) {
  struct Opts {
    std::string env = "calculator", env_options, out;
    int64_t count = 100;
    uint64_t seed = 0;
    bool transcripts = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "rl-tasks",
      "Write an environment's tasks as JSONL: each line the chat request (messages, tools), \"answer\" and\n"
      "\"reference\" (a reference solution's assistant and tool messages). With --transcripts each line is\n"
      "instead the request with its reference solution appended: conversations for `k3 sft`.");
  sub->add_option("--env", o->env, "environment")->capture_default_str();
  sub->add_option("--env-options", o->env_options, "the environment's options as a JSON object");
  sub->add_option("--count", o->count, "tasks")->capture_default_str();
  sub->add_option("--seed", o->seed, "the task stream (k3 rl draws its tasks from its own --seed)")
      ->capture_default_str();
  sub->add_option("--out", o->out, "output JSONL")->required();
  sub->add_flag("--transcripts", o->transcripts, "write SFT conversations (request + reference solution)");
  sub->callback([o] {
    check_output_path(o->out);
    if (o->count < 1) fail("--count must be at least 1, got ", o->count);
    std::unique_ptr<train::Environment> env = train::make_environment(o->env, parse_env_options(o->env_options));
    std::string out;
    int64_t without_reference = 0;
    for (int64_t i = 0; i < o->count; ++i) {
      const train::Task t = env->task(o->seed, i);
      nlohmann::ordered_json line = t.request;
      if (o->transcripts) {
        if (!t.reference.is_array() || t.reference.empty()) {
          ++without_reference;
          continue;
        }
        for (const auto& m : t.reference) line["messages"].push_back(m);
      } else {
        line["answer"] = t.answer;
        line["reference"] = t.reference;
      }
      out += line.dump() + "\n";
    }
    write_file_atomic(o->out, out);
    std::printf("%lld %s of %s -> %s\n", (long long)(o->count - without_reference),
                o->transcripts ? "transcripts" : "tasks", o->env.c_str(), o->out.c_str());
    if (without_reference) std::printf("%lld tasks have no reference solution\n", (long long)without_reference);
  });
}

}  // namespace k3::cli
