// Expert parallelism for the CPU model: the routed experts of every MoE layer shared out over the ranks of a
// process group (dist/group.h), tokens dispatched to them and their outputs combined with all-to-all.
//
// Ownership: rank q holds the contiguous block of experts [E·q/R, E·(q+1)/R) (expert_owner), the layout
// expert-parallel checkpoints are cut in. A rank reads only its own experts' weights: the CPU model maps the
// checkpoint and touches a tensor only when it runs it, so the others never become resident.
//
// One layer (every rank runs the same tokens; the trunk, the router and the latent projections are replicated):
//   1. The N tokens are cut into R contiguous blocks; rank r dispatches block r.
//   2. Its (token, expert) pairs go, grouped by expert, to the experts' owners: first each expert's row count,
//      then the rows themselves, in the latent width (routed_expert_hidden_size: 3,584 for K3, half the
//      hidden width, so half the bytes of dispatching x̂).
//   3. Each owner runs each of its experts once on the rows of every rank, concatenated in rank order: the
//      rows, in the order, that one process would give that expert (blocks are contiguous and in rank order).
//   4. The outputs go back the same way; each rank sums its tokens' expert outputs, weighted, in expert order as
//      the single-process loop does, then the ranks all-gather the aggregate rows ([N, latent], fp32).
// Every expert therefore sees the same rows in the same order as in one process and every sum is taken in the
// same order, so the logits equal a single process's bit for bit.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "dist/group.h"
#include "model/config.h"
#include "model/layers.h"
#include "model/weights.h"

namespace k3 {

// The rank that holds expert e of E over R ranks.
int expert_owner(int64_t e, int64_t E, int R);
// The first expert rank q holds (expert_first(R) == E).
int64_t expert_first(int q, int64_t E, int R);

// (token, weight) pairs of every expert, tokens [lo, hi) of an [N, K] routing, in token order.
using ExpertRows = std::vector<std::vector<std::pair<int64_t, float>>>;
ExpertRows rows_by_expert(const int32_t* idx, const float* wt, int64_t lo, int64_t hi, int64_t E, int64_t K);

// dst[0..n) += a · y[0..n): the combine's one operation (the same expression in both paths).
inline void add_scaled_row(float* dst, float a, const float* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] += a * y[j];
}

// u[N, latent] (zeroed by the caller) ← Σ_k wt[n, k] · expert_idx[n,k](z[n]) for every token, the experts run by
// their owners in `g` as above. Collective: every rank calls it with the same N, z and routing.
void routed_experts_parallel(float* u, const float* z, const int32_t* idx, const float* wt, int64_t N,
                             const MoeWeights& w, const K3Config& c, const PathOptions& opt, dist::Group& g);

}  // namespace k3
