// The on-policy RL loop behind `k3 rl`, and multi-teacher on-policy distillation behind `k3 distill`.
//
// An iteration:
//   1. Rollouts. N new tasks of the environment (train/environment.h), K episodes each (train/episode.h), plus the
//      episodes the last iteration left unfinished, all stepped together on the inference engine holding the
//      current policy. With partial rollouts (λ < 1) the iteration stops sampling once a fraction λ of them is
//      done; the rest are carried into the next iteration, where the new policy continues them (their older
//      tokens keep the log-probabilities of the policy that sampled them).
//   2. Rewards. A finished episode's return is its outcome (the environment's score of the answer), its dense
//      rewards (credited at the tool calls that earned them) and the effort reward: −1 when the policy wrote more
//      than τ·b0(x) tokens, b0(x) the assistant tokens of the task's reference solution, τ annealed linearly from
//      effort_tau_start to effort_tau_end over the run (0: no effort reward).
//   3. Advantages, for the tasks whose K episodes have all finished (a finished episode waits for its group). Each
//      sampled token t gets A_t = (G_t − mean R) / (std R + 1e-6): G_t the return from t on (outcome, effort, and
//      the dense rewards at or after t), R the episodes' whole returns in the task's group; a group whose returns
//      are all equal gets 0 everywhere (train/advantages.h: group_norms). Distillation (MOPD)
//      instead gives each sampled token its own reward clip(log π_teacher(y_t) − log π_old(y_t), −R_max, R_max),
//      the teacher chosen per task (task index mod teacher count), and no group normalisation.
//   4. One policy-gradient update (train/policy_gradient.h: PPO's clipped ratio to the policy that sampled each
//      token, the per-token regulariser toward it) on the trainer (CPU float64 or the GPU, train/train_device.h),
//      with router replay (the trainer routes every position as the rollout did; the CPU trainer) or without.
//      Before the update the trainer's log-probabilities of the tokens the current policy sampled are compared
//      with the sampler's, and without replay how often the trainer's routing differs from the rollout's.
//   5. The updated policy is written to RUN/policy and the rollout engine reloads it (the float64 engine with the
//      CPU trainer reads the trainer's parameters, and needs no reload).
// Metrics go to RUN/metrics.jsonl, one record per iteration (`k3 rl` then plots them: eval/plots.h); checkpoints (the trainer's state, the unfinished and
// waiting episodes, the task counter) resume the run exactly.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/engine.h"
#include "train/episode.h"
#include "train/train_device.h"

namespace k3::train {

struct RlOptions {
  std::string model_dir;      // the starting policy: a model directory
  std::string tokenizer_dir;  // "" : model_dir
  std::string out_dir;
  std::string env = "calculator";
  nlohmann::json env_options = nlohmann::json::object();
  int64_t iterations = 20;  // 0: only the held-out evaluation (eval_tasks > 0)
  int64_t prompts = 8;  // N new tasks per iteration
  int64_t samples = 4;  // K episodes per task
  EpisodeOptions episode;
  double partial = 1.0;  // λ: the fraction of an iteration's episodes that must finish before it trains
  double lr = 1e-4, weight_decay = 0.0, clip = 1.0;
  double clip_eps = 0.2, kl_coef = 0.0;  // PolicyLossOptions
  double effort_tau_start = 0.0, effort_tau_end = 0.0;
  bool router_replay = true;
  // Bitwise: the trainer's log-probabilities of the sampled tokens ARE the sampler's. Needs the CPU trainer and
  // float64 rollouts on the CPU; the float64 forward is then batch invariant (kernels/gemm/linear_f64.h) for the
  // run, which makes the trainer's forward slower (plain loops instead of dgemm and the chunked KDA form).
  bool deterministic = false;
  std::vector<std::string> teachers;  // distillation when given (model directories)
  double teacher_clip = 5.0;          // R_max
  EngineOptions rollout;              // the rollout engine's device and precision (the teachers' engines too)
  bool gpu = false;                   // the trainer on the GPU
  CudaTrainOptions cuda;
  uint64_t seed = 0;
  int64_t save_every = 10;
  bool resume = false;
  // Held-out success: greedy episodes of eval_tasks tasks from a stream of their own, before the first iteration,
  // every eval_every iterations (0: only at the start and the end) and after the last.
  int64_t eval_tasks = 0, eval_every = 0;
  // Called with every metrics record (tests use it to stop early).
  std::function<bool(const std::string& jsonl_line)> on_record;
};

struct RlResult {
  int64_t iterations = 0;      // completed, resumed ones included
  int64_t iterations_run = 0;  // by this call
  double last_eval_success = -1.0, first_eval_success = -1.0;
  double last_eval_tokens = 0.0;  // mean tokens the policy wrote per held-out episode
  std::string last_checkpoint;
};

RlResult run_rl(const RlOptions& options);

// The effort budget b0(x) of a task: the assistant's tokens in its reference solution (0 without one).
int64_t reference_tokens(const Tokenizer& tok, const Task& task);

}  // namespace k3::train
