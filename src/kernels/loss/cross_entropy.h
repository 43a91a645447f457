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

}  // namespace k3
