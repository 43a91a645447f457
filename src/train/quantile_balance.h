// Router-bias balancing for one MoE layer during training: Quantile Balancing (K3 §2.3.3, Eq. 14;
// App. D for the histogram estimator; ../shared/docs/K3-TECHNIQUES.md (a)) and, for comparison,
// DeepSeek's loss-free sign rule and no balancing.
//
// Routing (K3 Eq. 13): token i picks T_i = top-k of (s_i + b); s are the unbiased sigmoid scores.
// The bias only steers selection. One training step may be several forward passes (sequences,
// micro-batches); the balancer sees every one of them through accumulate() with the bias that was
// in effect, and finish_step() turns the pooled step into the next step's bias. Nothing that a step
// routes is ever routed with a bias derived from itself (K3: "a batch is never routed with a bias
// derived from itself").
//
// Quantile Balancing, one step over m tokens, n experts, top-k, q = m·k/n:
//   α_i = (k+1)-th largest of (s_i + b)            (old bias: the token's cutoff)
//   r_ij = α_i − s_ij = −M_ij                       (token i joins j's top-k iff b_j > r_ij, α fixed)
//   b̂_j = the bias that leaves q of the r_{:,j} below it = −((q+1)-th largest of M_{:,j})
//   b ← b̂ − mean(b̂)                                (replaces b; a uniform shift changes no top-k)
//
// With the exact b̂_j, the (q+1)-th token sits exactly ON its cutoff (s_ij + b̂_j = α_i), so it is
// in or out by tie-breaking, and ties among margins are structural: every token whose (k+1)-th
// choice is j has M_ij = −b_j exactly. "q tokens above −b̂_j" therefore holds as the order-statistic
// statement (at most q strictly above, at least q+1 at or above). The M-criterion "token i would
// select j with bias b̂_j" is exact for tokens already routed to j, but optimistic for the others
// (they must beat their k-th score, not α_i), so the load a lone change of b_j gives is <= q(+1 tie).
//
// Non-integer q (m·k not a multiple of n): b̂_j is the rank-(q+1) order statistic of r_{:,j}
// (ascending) with LINEAR INTERPOLATION in the rank: with q = f + t (f = ⌊q⌋, 0 ≤ t < 1),
//   b̂_j = (1 − t)·r_(f+1) + t·r_(f+2)      (r_(m+1) := r_(m)).
// Why: it is the integer rule when t = 0, continuous in q, and every expert then sits between the
// f and f+1 token loads a fractional target allows; it is also what the histogram estimator's
// in-bin interpolation approximates. q is kept as the exact fraction (m·k)/n, never rounded.
//
// Histogram estimator (App. D): per expert B bins over [b_min − 1, b_max + 1] (b = the bias in
// effect; every r lies inside since s ∈ (0,1)), width w = (b_max − b_min + 2)/B, integer counts of
// r_ij scatter-added per micro-batch (so it streams: memory n·B, independent of m). β_j = first bin
// whose cumulative count reaches ⌈q⌉, c_j = count before it, h_j = count in it:
//   b̂_j = b_min − 1 + (β_j + clip((q − c_j)/h_j, 0, 1))·w.
// Sign convention: the histogram is of r = −M (the *required bias*), so b̂_j is read off directly,
// with no negation; the exact estimator's −(order statistic of M) is the same number. The histogram
// places b̂_j where the in-bin-uniform CDF of r equals q, i.e. between r_(q) and r_(q+1): it agrees
// with the exact b̂_j to within one bin width plus half a gap between neighbouring order statistics.
//
// Sign rule (DeepSeek loss-free balancing, arXiv 2408.15664): b_j ← b_j + u·sign(mean load − load_j),
// loads of the step just routed; as published, with no centring.
//
// MaxVio of a step = (max_j load_j − mean load)/mean load, load_j = tokens of the step that selected j
// with the bias in effect during the step (mean load = m·k/n).
//
// Selection ties go to the lower expert index, as in the float64 router (kernels/moe/router.h). Group-limited
// routing (num_expert_group > 1 with topk_group < groups) is not modelled: QB assumes plain top-k.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dist/group.h"

namespace k3::train {

enum class BalanceMethod { None, QuantileExact, QuantileHistogram, Sign };

const char* balance_method_name(BalanceMethod m);          // "none", "qb-exact", "qb-histogram", "sign"
BalanceMethod parse_balance_method(const std::string& s);  // inverse; throws k3::Error

struct BalanceOptions {
  BalanceMethod method = BalanceMethod::QuantileExact;
  int64_t num_bins = 1000;  // histogram: B (K3 App. D error bound; Megatron moe_qb_num_bins)
  double sign_rate = 1e-3;  // sign rule: u (DeepSeek's chosen value)
  // QB only: b ← centre((1 − d)·b̂ + d·b_old), the optional EMA of App. D (0 = K3/Megatron default).
  double ema_decay = 0.0;
};

struct BalanceStepStats {
  int64_t tokens = 0;          // m
  std::vector<int64_t> loads;  // [E] tokens that selected each expert during the step
  double max_vio = 0.0;        // (max load − mean)/mean; 0 for an empty step
};

class QuantileBalancer {
 public:
  // initial_bias: [E] or empty (zeros). Needs 1 <= top_k < num_experts (α is the (k+1)-th score).
  QuantileBalancer(int64_t num_experts, int64_t top_k, BalanceOptions opt = {}, std::vector<double> initial_bias = {});

  int64_t num_experts() const { return E_; }
  int64_t top_k() const { return K_; }
  const BalanceOptions& options() const { return opt_; }
  int64_t steps() const { return steps_; }  // finish_step() calls so far

  // The bias in effect for the current step ([E]). Route the forward with exactly this (e.g. from
  // TrainHooks::router_bias) so the step's loads and cutoffs are the ones the model saw.
  const std::vector<double>& bias() const { return bias_; }
  // Replaces the bias (between steps only: throws while a step has accumulated tokens).
  void set_bias(const std::vector<double>& b);

  // One forward pass of the current step: scores [N, E], unbiased sigmoid router scores.
  void accumulate(const double* scores, int64_t N);
  int64_t pending_tokens() const { return tokens_; }
  // Data parallelism: pools the pending step of every rank of `g` (each accumulated its own sequences with
  // the same bias), so that every rank's finish_step() computes the same next bias. The token count, the
  // loads and the histogram counts are summed; the exact estimator's margins are gathered (its order
  // statistics do not depend on the order of the tokens, so the bias equals a single process's bit for
  // bit). A no-op for a group of one.
  void merge_ranks(dist::Group& g);

  // Ends the step: records its loads/MaxVio, computes the next bias by the chosen method and clears
  // the accumulators. An empty step (no tokens) leaves the bias unchanged.
  const BalanceStepStats& finish_step();
  const BalanceStepStats& last_step() const { return last_; }

  // The QB target b̂ (before centring) of the pending step, by the exact or histogram estimator,
  // without finishing the step (tests and diagnostics). Needs pending tokens.
  std::vector<double> estimate_exact() const;
  std::vector<double> estimate_histogram() const;

  // Checkpoint state (method, options, step count, bias). Between steps only: a half-accumulated
  // step is not part of a checkpoint (throws). Doubles round-trip exactly through nlohmann::json.
  nlohmann::json to_json() const;
  static QuantileBalancer from_json(const nlohmann::json& j);

 private:
  int64_t E_, K_;
  BalanceOptions opt_;
  std::vector<double> bias_;
  int64_t steps_ = 0;
  // Pending step.
  int64_t tokens_ = 0;
  std::vector<int64_t> loads_;  // [E]
  std::vector<double> r_;       // exact: [m, E] required biases r_ij = α_i − s_ij
  std::vector<int64_t> hist_;   // histogram: [E, B] counts
  double hist_lo_ = 0, hist_w_ = 0;
  BalanceStepStats last_;
  void start_histogram();  // the step's bin grid, from the bias in effect
};

// Shared helpers (also used by the tests).
// Loads of top-k(s + bias) over N tokens (bias null = zeros), ties to the lower index.
std::vector<int64_t> biased_topk_loads(const double* scores, int64_t N, int64_t E, int64_t k, const double* bias);
// (max − mean)/mean of loads; 0 when all are zero.
double max_violation(const std::vector<int64_t>& loads);

}  // namespace k3::train
