// PNG plots of an evaluation, drawn by gnuplot (Debian package gnuplot-nox, pngcairo terminal).
//
// Each plot is written as a plain-text data file and a gnuplot script under OUTDIR/plot-data/
// (so a plot can be redrawn or restyled by hand: `cd OUTDIR/plot-data && gnuplot loss.gp`), then
// gnuplot is run on the script and writes OUTDIR/<name>.png. Without gnuplot the data and scripts
// are still written and the PNGs are skipped.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "eval/eval.h"
#include "eval/run_metrics.h"

namespace k3::eval {

struct PlotResult {
  std::string name;    // "loss"
  std::string png;     // OUTDIR/loss.png ("" when not drawn)
  std::string script;  // OUTDIR/plot-data/loss.gp ("" when there was nothing to plot)
  bool drawn = false;
  std::string note;  // why it was skipped, or gnuplot's complaint
};

// The gnuplot executable (env K3_GNUPLOT, else "gnuplot" on PATH); "" when there is none.
std::string find_gnuplot();

// Writes the data + scripts for every plot that has data and draws them when gnuplot is available.
//   loss:        train loss per step (+ held-out loss points of the run, + this eval's held-out loss)
//   maxvio:      MaxVio per MoE layer over steps, one line per layer
//   retrieval:   accuracy against prompt length (log2 axis), a vertical marker at train_length
//   expert_load: per (MoE layer, expert) load relative to the mean (1 = balanced), a heatmap
// run may be null (loss and maxvio are then skipped with a note).
std::vector<PlotResult> write_plots(const std::string& out_dir, const RunMetrics* run, const HeldoutResult* heldout,
                                    int64_t eval_step, const std::vector<RetrievalPoint>& retrieval,
                                    int64_t train_length, const std::vector<ExpertLoad::LayerStats>& load,
                                    const std::string& gnuplot);

// The plots of an RL run (`k3 rl`, `k3 distill`) from its metrics.jsonl, per iteration:
//   rl_reward:   the episodes' mean reward and success, and the held-out greedy success
//   rl_length:   tokens per episode (and held-out), and episodes over the effort budget
//   rl_mismatch: the trainer's log-probabilities against the sampler's (largest and mean |Δ|) and the KL term to the
//                rollout policy, on a log scale
// Written to OUT_DIR as write_plots does (data and scripts under OUT_DIR/plot-data/).
std::vector<PlotResult> write_rl_plots(const std::string& out_dir, const std::string& metrics_path,
                                       const std::string& gnuplot);

}  // namespace k3::eval
