// Softmax cross-entropy over logits rows (float64, the training model's head loss).
#pragma once
#include <cstdint>

namespace k3 {

// Sum over rows of -log softmax(logits[r])[target[r]] (rows with target < 0 are skipped); when
// dlogits is given it receives (softmax - onehot) * scale for every row (0 for skipped rows).
// row_weight (optional, [N]): row r's term and its dlogits are multiplied by row_weight[r] (a policy-gradient
// step's per-token coefficients, train/policy_gradient.h).
double cross_entropy(const double* logits, const int32_t* target, int64_t N, int64_t V, double* dlogits, double scale,
                     const double* row_weight = nullptr);

// log Σ_v exp(logits[v] / temperature), in double as max + log Σ exp(x − max) (a −inf logit contributes 0; at
// least one must be finite). The one log-sum-exp of a logits row on the host: the training loss, the sampler's
// log-probabilities (train/episode.h), the server's logprobs.
double log_sum_exp(const float* logits, int64_t V, double temperature = 1.0);
double log_sum_exp(const double* logits, int64_t V, double temperature = 1.0);

// log softmax(logits / temperature)[id], in double.
double log_softmax_at(const float* logits, int64_t V, int32_t id, double temperature = 1.0);
double log_softmax_at(const double* logits, int64_t V, int32_t id, double temperature = 1.0);

}  // namespace k3
