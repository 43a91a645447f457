// The policy-gradient objective of on-policy RL (issue 21: `k3 rl`), in float64 on the CPU: the reference the
// GPU step and the RL loop are checked against.
//
// A sample is a sequence the policy generated tokens in (a prompt, the policy's tokens, and in multi-turn episodes
// the tool results between them). Only the tokens the policy sampled are trained. For each such token t, with
// r_t = π_θ(y_t) / π_old(y_t) (π_old: the policy that sampled it, whose log-probability the rollout recorded) and
// the token's advantage A_t, the objective is PPO's clipped surrogate plus a per-token regulariser that pulls
// log π_θ(y_t) toward a reference log-probability (the rollout policy's):
//
//   L = (1/N) Σ_t [ −min(r_t A_t, clip(r_t, 1 − ε, 1 + ε) A_t) + (β/2) (log π_θ(y_t) − ref_t)² ]
//
// over the N sampled tokens of the batch (a token mean). Its gradient, with ∇(−log π_θ(y_t)) the cross-entropy's:
//
//   ∇L = (1/N) Σ_t [ A_t r_t [t not clipped] − β (log π_θ(y_t) − ref_t) ] ∇(−log π_θ(y_t))
//
// where a token is clipped when the min picks the clipped term with r_t outside [1 − ε, 1 + ε] (A_t > 0 and
// r_t > 1 + ε, or A_t < 0 and r_t < 1 − ε): the objective is flat there. So one step is a forward for log π_θ,
// the per-token coefficients on the host, and the weighted cross-entropy's backward (sequence_loss's weights).
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/params.h"
#include "model/training/model_train.h"

namespace k3::train {

struct PolicySample {
  std::vector<int32_t> ids;
  TokenMask sampled;                   // [T]: the tokens the policy sampled (trained)
  std::vector<double> behaviour_logp;  // [T]: log π_old(ids[t]) at sampled tokens (others not read)
  std::vector<double> advantage;       // [T]: A_t at sampled tokens (a sample's advantage, or dense rewards')
  std::vector<double> reference_logp;  // [T] or empty: ref_t for the regulariser (needs one when β > 0)
};

struct PolicyLossOptions {
  double clip_eps = 0.2;  // ε
  double kl_coef = 0.0;   // β
};

struct PolicyLoss {
  double loss = 0.0;               // L
  int64_t tokens = 0;              // N
  int64_t clipped = 0;             // sampled tokens whose surrogate was clipped
  double mean_ratio = 0.0;         // mean r_t
  double max_abs_log_ratio = 0.0;  // max |log π_θ − log π_old|: the trainer against the sampler
};

// One sampled token's share of L and of its gradient's coefficient, before the 1/N: its loss term, the weight of
// its cross-entropy's gradient (∇L's coefficient above), whether it is clipped, and r_t.
struct PolicyTokenTerm {
  double loss = 0.0, weight = 0.0, ratio = 1.0;
  bool clipped = false;
};
PolicyTokenTerm policy_token_term(double logp, double behaviour_logp, double reference_logp, double advantage,
                                  const PolicyLossOptions& options);

// log π_θ(ids[t]) of every token after the first (position t − 1 predicting token t); [T], entry 0 is 0. `hooks`
// (optional) as sequence_loss takes them (router biases, router replay, the MoE tapes).
std::vector<double> token_logprobs(ParamStore& P, const K3Config& c, const std::vector<int32_t>& ids,
                                   const TrainHooks* hooks = nullptr);

// L over the batch; with `backward`, ∇L is ADDED to P's gradient. Errors name the sample and field when a size is
// not the sequence's, a sample has no sampled token after its first, or β > 0 without reference log-probabilities.
PolicyLoss policy_loss(ParamStore& P, const K3Config& c, const std::vector<PolicySample>& batch,
                       const PolicyLossOptions& options, bool backward);

}  // namespace k3::train
