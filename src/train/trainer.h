// The training loop behind `k3 train`: curriculum stages, packed windows from a token shard,
// float64 forward/backward, Quantile Balancing per MoE layer, clipping, AdamW + Per-Head Muon on a
// cosine schedule, metrics, checkpoints and exact resume.
//
// One step = tokens_per_step tokens, cut into windows of the stage's sequence length (so the
// number of tokens per step stays constant while sequences grow, as in K3's 8K -> 64K -> 256K -> 1M
// curriculum). Windows are consecutive in the shard; each window is cut at document boundaries
// (train/data.h). The loss of a step is the mean next-token cross-entropy over all its predictions.
// Balancer biases change only between steps (a step is never routed with a bias derived from
// itself) and are written into the checkpoint's e_score_correction_bias.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/cuda/cuda_model.h"
#include "train/quantile_balance.h"
#include "train/train_device.h"

namespace k3::train {

struct Stage {
  int64_t seq_len = 0;  // tokens per window
  int64_t tokens = 0;   // token budget of the stage
};

// "256:200000,1024:100000" -> stages; errors name the item.
std::vector<Stage> parse_stages(const std::string& text);

struct TrainOptions {
  std::string config_path, data_path, out_dir;
  std::vector<Stage> stages;  // empty: one stage of seq_len 256 (capped by the config) and `tokens`
  int64_t tokens = 200000;    // total when stages are not given
  int64_t tokens_per_step = 2048;
  double lr = 3e-3, min_lr_ratio = 0.1, warmup_fraction = 0.01, weight_decay = 0.1, clip = 1.0;
  double router_lr_scale = 1.0;  // OptimizerConfig::router_lr_scale
  BalanceOptions balance;        // method none / qb-exact / qb-histogram / sign
  uint64_t seed = 0;
  // Window order: shuffled (each window starts at a position drawn from (seed, window number), so a
  // resumed run draws the same windows), or sequential through the shard.
  bool shuffle = true;
  bool resume = false;
  // On resume, the run's identity (config, seed, tokens per step, window order) must be repeated;
  // its plan (stages, lr schedule, clipping, balancing) too, unless change_plan is set.
  bool change_plan = false;
  // Gradient lanes (train/grad_lanes.h): sequences of a step run side by side on this many gradient
  // buffers. 0: the OpenMP thread count for a new run, the saved count for a resumed one (so that it
  // sums in the same order and resumes exactly).
  int64_t grad_lanes = 0;
  // Where the steps run: the CPU in float64 (default), or one GPU (train/train_device.h) with
  // `cuda`'s precision (BF16: bf16 GEMM operands, fp32 everything else; F32: the parity mode),
  // recomputation and micro-batches.
  bool gpu = false;
  CudaTrainOptions cuda;
  bool skip_nonfinite = false;  // skip a step with a NaN/Inf loss or gradient (default: stop)
  int64_t save_every = 50;      // steps; a checkpoint is also written at the end
  int64_t log_every = 1;
  // Held-out evaluation after the last step (and every eval_every steps when > 0): mean next-token
  // loss over the first eval_tokens of this shard, in windows of the last stage's length, beside the
  // shard's unigram entropy (the loss of a model that knows only token frequencies).
  std::string eval_path;
  int64_t eval_tokens = 16384;
  int64_t eval_every = 0;
  // Called after every step with the JSONL record (tests use it to stop early).
  std::function<bool(const std::string& jsonl_line)> on_step;

  // Supervised fine-tuning (`k3 sft`): with sft_data set, the steps come from chat conversations
  // (train/sft_data.h) instead of a token shard: `epochs` passes, each conversation one sequence cut to
  // max_seq_len (0: the config's max_position_embeddings), whole conversations packed into steps of at most
  // tokens_per_step tokens, the loss the mean over the assistant's tokens. stages and tokens are not used;
  // eval_path is a conversation file too (its whole assistant-token loss; no unigram entropy).
  std::string sft_data;
  std::string tokenizer_dir;  // SFT: the tokenizer the conversations are encoded with
  int64_t epochs = 1;
  int64_t max_seq_len = 0;
  // A new run starts from this model directory's weights (its config.json is config_path) instead of a
  // random initialisation.
  std::string init_model;
};

struct EvalResult {
  double loss = 0.0;             // nats per predicted token
  double unigram_entropy = 0.0;  // nats per token, of the evaluated tokens' own frequencies (NaN for SFT)
  int64_t predictions = 0;
};

struct TrainResult {
  int64_t steps = 0;      // the run's step count at the end (resumed steps included)
  int64_t steps_run = 0;  // steps taken by this call (0: a resumed run that was already complete)
  double last_loss = 0.0;
  EvalResult eval;  // when eval_path was given
  std::string last_checkpoint;
};

TrainResult train(const TrainOptions& opt);

}  // namespace k3::train
