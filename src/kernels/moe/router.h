// K3's sigmoid router with a selection-only bias (noaux_tc; K3 eq. 13), fp32:
//   s = sigmoid(logits);  selection = top-k of (s + bias)  [group-limited when groups > 1];
//   w_j = s_j / (Σ_selected s + 1e-20) if renormalise, else s_j;  w *= routed_scaling_factor.
// The bias steers which experts are chosen but never enters the mixture weights.
// Ties in (s + bias) are broken toward the lower expert index (deterministic).
#pragma once
#include <cstdint>

namespace k3::moe {

struct RouterParams {
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  int64_t num_groups = 1;   // num_expert_group
  int64_t topk_groups = 1;  // topk_group
  bool renormalize = true;
  float scaling = 1.0f;  // routed_scaling_factor
};

// logits [N, E] -> idx [N, K] (in selection order), weight [N, K]. bias may be null.
// scores_out (optional) [N, E] receives the sigmoid scores.
void router_forward(int32_t* idx, float* weight, float* scores_out, const float* logits, const float* bias, int64_t N,
                    const RouterParams& p);

// Float64, for training: the same routing with the sigmoid scores [N, E] and, per token, the sum of
// the selected scores (sel_sum [N], optional: the renormalisation's denominator, for the backward).
// Scores are computed with a stable sigmoid in double; the selection and tie rules are the fp32 one's.
// forced (optional) [N, K]: the experts to use instead of selecting them (router replay: RL trains on the routing
// its rollouts took); the weights are then those experts' renormalised scores, as if they had been selected.
void router_forward(int32_t* idx, double* weight, double* scores, double* sel_sum, const double* logits,
                    const double* bias, int64_t N, const RouterParams& p, const int32_t* forced = nullptr);

}  // namespace k3::moe
