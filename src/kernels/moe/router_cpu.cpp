#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/ffn/glu.h"
#include "kernels/moe/router.h"

namespace k3::moe {

namespace {

// The selection of one token from its biased scores `sel` [E] (changed: experts the group limit
// excludes become -inf): the DeepSeek-V3 group limit when groups > 1 (a group scores the sum of its
// two best biased scores; experts outside the best topk_groups groups cannot be selected), then the
// top K, ties to the lower expert index (deterministic). order[0..K) receives them, best first.
template <class T>
void select_experts(std::vector<int32_t>& order, std::vector<T>& sel, std::vector<T>& gscore,
                    std::vector<int32_t>& gorder, const RouterParams& p) {
  const int64_t E = p.num_experts, G = p.num_groups, per_group = E / G;
  if (G > 1 && p.topk_groups < G) {
    for (int64_t g = 0; g < G; ++g) {
      T b1 = -INFINITY, b2 = -INFINITY;
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
        const T v = sel[size_t(e)];
        if (v > b1) {
          b2 = b1;
          b1 = v;
        } else if (v > b2) {
          b2 = v;
        }
      }
      gscore[size_t(g)] = per_group >= 2 ? b1 + b2 : b1;
    }
    std::iota(gorder.begin(), gorder.end(), 0);
    std::stable_sort(gorder.begin(), gorder.end(),
                     [&](int32_t a, int32_t b) { return gscore[size_t(a)] > gscore[size_t(b)]; });
    for (int64_t r = p.topk_groups; r < G; ++r)
      for (int64_t e = gorder[size_t(r)] * per_group; e < (gorder[size_t(r)] + 1) * per_group; ++e)
        sel[size_t(e)] = -INFINITY;
  }
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + p.top_k, order.end(), [&](int32_t a, int32_t b) {
    return sel[size_t(a)] > sel[size_t(b)] || (sel[size_t(a)] == sel[size_t(b)] && a < b);
  });
}

}  // namespace

void router_forward(int32_t* idx, float* weight, float* scores_out, const float* logits, const float* bias, int64_t N,
                    const RouterParams& p) {
  const int64_t E = p.num_experts, K = p.top_k, G = p.num_groups;
  K3_ASSERT(K >= 1 && K <= E && G >= 1 && E % G == 0);
  parallel_region(N * E * K, [&] {
    std::vector<float> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::vector<float> gscore(static_cast<size_t>(G));
    std::vector<int32_t> gorder(static_cast<size_t>(G));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t e = 0; e < E; ++e) {
        s[size_t(e)] = sigmoidf_stable(logits[n * E + e]);
        // A NaN selection score (NaN input or weight) is never selected before a number: without
        // this, the selection has no ordering at all, and the GPU's argmax would return no expert.
        const float v = s[size_t(e)] + (bias ? bias[e] : 0.0f);
        sel[size_t(e)] = std::isnan(v) ? -INFINITY : v;
      }
      if (scores_out) std::copy(s.begin(), s.end(), scores_out + n * E);
      select_experts(order, sel, gscore, gorder, p);
      double sum = 0.0;
      for (int64_t k = 0; k < K; ++k) sum += s[size_t(order[size_t(k)])];
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = order[size_t(k)];
        idx[n * K + k] = e;
        const double w = p.renormalize ? double(s[size_t(e)]) / (sum + 1e-20) : double(s[size_t(e)]);
        weight[n * K + k] = float(w * p.scaling);
      }
    }
  });
}

void router_forward(int32_t* idx, double* weight, double* scores, double* sel_sum, const double* logits,
                    const double* bias, int64_t N, const RouterParams& p, const int32_t* forced) {
  const int64_t E = p.num_experts, K = p.top_k, G = p.num_groups;
  K3_CHECK(K >= 1 && K <= E, "router: top-k ", K, " must be in 1..num_experts (", E, ")");
  K3_CHECK(G >= 1 && E % G == 0, "router: num_expert_group ", G, " must divide num_experts ", E);
  std::vector<double> sel(static_cast<size_t>(E)), gscore(static_cast<size_t>(G));
  std::vector<int32_t> order(static_cast<size_t>(E)), gorder(static_cast<size_t>(G));
  for (int64_t n = 0; n < N; ++n) {
    double* s = scores + n * E;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = sigmoid_stable(logits[n * E + e]);
      sel[size_t(e)] = s[e] + (bias ? bias[e] : 0.0);  // the bias steers selection only
    }
    if (forced) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = forced[n * K + k];
        K3_CHECK(e >= 0 && e < E, "router replay: expert ", e, " of row ", n, " is not in 0..", E - 1);
        order[size_t(k)] = e;
      }
    } else {
      select_experts(order, sel, gscore, gorder, p);
    }
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) sum += s[order[size_t(k)]];
    if (sel_sum) sel_sum[n] = sum;
    // Weights from the UNBIASED scores: w = s / (Σ_sel s + 1e-20) when renormalising, times scaling.
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = order[size_t(k)];
      idx[n * K + k] = e;
      const double w = p.renormalize ? s[e] / (sum + 1e-20) : s[e];
      weight[n * K + k] = w * double(p.scaling);
    }
  }
}

}  // namespace k3::moe
