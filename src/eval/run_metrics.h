// A training run's RUN/metrics.jsonl (written by `k3 train`), read back for `k3 eval`: the loss
// curve, MaxVio per MoE layer over steps, the held-out evaluations, and the sequence lengths the
// curriculum used.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace k3::eval {

struct StepRecord {
  int64_t step = 0;
  double loss = 0.0;   // NaN when the record has none (null / skipped step)
  int64_t tokens = 0;  // cumulative training tokens
  int64_t seq_len = 0;
  int64_t stage = 0;
  std::vector<double> max_vio;  // per MoE layer
};

struct EvalRecord {
  int64_t step = 0;
  double eval_loss = 0.0;
  double unigram_entropy = 0.0;
  int64_t predictions = 0;
};

struct RunMetrics {
  std::string path;
  std::vector<StepRecord> steps;  // in file order
  std::vector<EvalRecord> evals;

  // The longest seq_len of the step records with step <= max_step (all of them when max_step < 0);
  // 0 when there is none.
  int64_t trained_length(int64_t max_step = -1) const;
  // seq_len of the last step record (the curriculum's last stage once the run has finished); 0 if none.
  int64_t last_seq_len() const { return steps.empty() ? 0 : steps.back().seq_len; }
  // The cumulative tokens at a step (from the step record; -1 when absent).
  int64_t tokens_at(int64_t step) const;
};

// Reads RUN/metrics.jsonl (RUN: the run directory, or the metrics file itself). A bad line throws
// k3::Error naming the file and line number; an empty trailing line is ignored. When a run was
// resumed, a step that appears twice keeps its last record.
RunMetrics read_run_metrics(const std::string& run_or_file);

// The step number of a checkpoint directory named step-00000050 (-1 when the name is not of that form).
int64_t checkpoint_step(const std::string& dir);

}  // namespace k3::eval
