// FFN blocks: the dense SiTU-GLU MLP (layers < first_k_dense_replace) and Stable LatentMoE
// (K3-ARCHITECTURE.md §5.5): fp32 sigmoid router on the full-width x̂; latent down-projection;
// routed experts in the latent; fp32 weighted sum; RMSNorm of the AGGREGATE; up-projection;
// plus the fused shared experts on x̂.
#include <cstring>

#include "kernels/ffn/glu.h"
#include "kernels/moe/router.h"
#include "kernels/norm/norm.h"
#include "model/expert_parallel.h"
#include "model/layers.h"

namespace k3 {
namespace {

// out[N, out_dim] = down( act(gate x, up x) ). With bf16 activations: the gate/up GEMM outputs are
// rounded too unless `fused` (the GPU's routed experts apply SiTU to the fp32 accumulators).
void glu_mlp(float* out, const float* x, int64_t N, const WeightRef& gate, const WeightRef& up, const WeightRef& down,
             const GluParams& p, const PathOptions& opt, bool fused = false) {
  std::vector<float> g(size_t(N * gate.rows)), u(size_t(N * up.rows));
  linear_forward(g.data(), x, N, gate);
  linear_forward(u.data(), x, N, up);
  if (!fused) opt.bf16(g), opt.bf16(u);
  glu_forward(g.data(), g.data(), u.data(), int64_t(g.size()), p);
  opt.bf16(g);
  linear_forward(out, g.data(), N, down);
}

}  // namespace

GluParams glu_params(const K3Config& c) {
  return GluParams{c.hidden_act == Activation::SiTU, c.situ_beta, c.situ_linear_beta};
}

moe::RouterParams router_params(const K3Config& c) {
  return moe::RouterParams{c.num_experts,
                           c.num_experts_per_token,
                           c.use_grouped_topk ? c.num_expert_group : 1,
                           c.use_grouped_topk ? c.topk_group : 1,
                           c.moe_renormalize,
                           c.routed_scaling_factor};
}

void routed_expert_forward(float* y, const float* z, int64_t ne, const ExpertWeights& w, const K3Config& c,
                           const PathOptions& opt) {
  glu_mlp(y, z, ne, w.w1, w.w3, w.w2, glu_params(c), opt, /*fused=*/true);
  opt.bf16(y, ne * c.routed_expert_hidden_size);
}

void dense_ffn_forward(float* out, const float* x, int64_t N, const GluFfnWeights& w, const K3Config& c,
                       const PathOptions& opt) {
  glu_mlp(out, x, N, w.gate_proj, w.up_proj, w.down_proj, glu_params(c), opt);
}

void moe_ffn_forward(float* out, const float* x, int64_t N, int64_t layer, const MoeWeights& w, const K3Config& c,
                     const ForwardHooks* hooks, const PathOptions& opt) {
  const int64_t E = c.num_experts, K = c.num_experts_per_token, lat = c.routed_expert_hidden_size;

  std::vector<float> logits(size_t(N * E));
  linear_forward(logits.data(), x, N, w.router);  // [N, E]
  std::vector<int32_t> idx(size_t(N * K));
  std::vector<float> wt(size_t(N * K));
  moe::router_forward(idx.data(), wt.data(), nullptr, logits.data(), w.router_bias.data(), N, router_params(c));
  if (hooks && hooks->topk) hooks->topk(layer, idx.data(), N, K);

  std::vector<float> z(size_t(N * lat));
  linear_forward(z.data(), x, N, w.latent_down);  // [N, latent]
  opt.bf16(z);

  std::vector<float> u(size_t(N * lat), 0.0f);  // fp32 aggregate of the routed experts
  if (opt.expert_group && opt.expert_group->size() > 1) {
    routed_experts_parallel(u.data(), z.data(), idx.data(), wt.data(), N, w, c, opt, *opt.expert_group);
  } else {
    // Group (token, weight) pairs by expert, then run each expert once on its gathered rows.
    const ExpertRows by_expert = rows_by_expert(idx.data(), wt.data(), 0, N, E, K);
    std::vector<float> zin, y;
    for (int64_t e = 0; e < E; ++e) {
      const auto& rows = by_expert[size_t(e)];
      if (rows.empty()) continue;
      const int64_t ne = int64_t(rows.size());
      zin.resize(size_t(ne * lat));
      y.resize(size_t(ne * lat));
      for (int64_t i = 0; i < ne; ++i)
        std::memcpy(&zin[size_t(i * lat)], &z[size_t(rows[size_t(i)].first * lat)], size_t(lat) * 4);
      routed_expert_forward(y.data(), zin.data(), ne, w.experts[size_t(e)], c, opt);
      for (int64_t i = 0; i < ne; ++i)
        add_scaled_row(&u[size_t(rows[size_t(i)].first * lat)], rows[size_t(i)].second, &y[size_t(i * lat)], lat);
    }
  }
  if (c.latent_moe_use_norm) rmsnorm_forward(u.data(), u.data(), w.latent_norm.data(), c.rms_norm_eps, N, lat);
  opt.bf16(u);
  linear_forward(out, u.data(), N, w.latent_up);  // [N, hidden]
  if (!w.shared.empty()) {
    std::vector<float> sh(size_t(N * c.hidden_size));
    glu_mlp(sh.data(), x, N, w.shared.gate_proj, w.shared.up_proj, w.shared.down_proj, glu_params(c), opt);
    for (size_t i = 0; i < sh.size(); ++i) out[i] += sh[i];
  }
}

}  // namespace k3
