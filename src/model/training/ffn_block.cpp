// Float64 forward/backward of the GLU MLP, the dense FFN and Stable LatentMoE (see ffn_block.h).
// Linear layers follow the checkpoint convention W [out, in], y = x Wᵀ, so for a linear layer
//   dW += dyᵀ x   and   dx = dy W.
#include "model/training/ffn_block.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "kernels/ffn/glu.h"
#include "kernels/gemm/linear_f64.h"
#include "kernels/moe/router.h"
#include "kernels/norm/norm.h"
#include "model/layers.h"
#include "model/tensor_table.h"

namespace k3::train {
namespace {

// Tensor names of one GLU MLP.
struct GluNames {
  std::string gate, up, down;
};

// The GLUs of a layer (its prefix, "...layers.<l>."): the dense FFN, the shared experts, routed expert e.
GluNames glu_at(const std::string& prefix, TensorKind gate, TensorKind up, TensorKind down, int64_t expert) {
  return {tensor_name_at(prefix, gate, expert), tensor_name_at(prefix, up, expert),
          tensor_name_at(prefix, down, expert)};
}
GluNames dense_glu(const std::string& prefix) {
  return glu_at(prefix, TensorKind::DenseGate, TensorKind::DenseUp, TensorKind::DenseDown, -1);
}
GluNames shared_glu(const std::string& prefix) {
  return glu_at(prefix, TensorKind::SharedGate, TensorKind::SharedUp, TensorKind::SharedDown, -1);
}
GluNames expert_glu(const std::string& prefix, int64_t e) {
  return glu_at(prefix, TensorKind::ExpertGate, TensorKind::ExpertUp, TensorKind::ExpertDown, e);
}

// A GLU MLP named by its own prefix: the leaves of the dense/shared form (`gate_proj.weight`) or of
// the routed experts' form (`w1.weight`), the first when both exist.
GluNames glu_names(const ParamStore& P, const std::string& pre) {
  auto leaves = [&](TensorKind gate, TensorKind up, TensorKind down) -> GluNames {
    return {pre + tensor_info(gate).leaf, pre + tensor_info(up).leaf, pre + tensor_info(down).leaf};
  };
  const GluNames dense = leaves(TensorKind::DenseGate, TensorKind::DenseUp, TensorKind::DenseDown);
  const GluNames expert = leaves(TensorKind::ExpertGate, TensorKind::ExpertUp, TensorKind::ExpertDown);
  return P.has(dense.gate) || !P.has(expert.gate) ? dense : expert;
}

// Checks gate/up [I, D] and down [D, I] and returns I.
int64_t glu_inter(const ParamStore& P, const GluNames& n, int64_t D) {
  const std::vector<int64_t>& gs = P.shape(n.gate);
  if (gs.size() != 2 || gs[1] != D) fail("tensor '", n.gate, "' must be [I, ", D, "]");
  const int64_t I = gs[0];
  const std::vector<int64_t>& us = P.shape(n.up);
  if (us.size() != 2 || us[0] != I || us[1] != D) fail("tensor '", n.up, "' must be [", I, ", ", D, "]");
  const std::vector<int64_t>& ds = P.shape(n.down);
  if (ds.size() != 2 || ds[0] != D || ds[1] != I) fail("tensor '", n.down, "' must be [", D, ", ", I, "]");
  return I;
}

void glu_forward_named(const ParamStore& P, const GluNames& n, const K3Config& c, const double* x, int64_t N, int64_t D,
                       double* y, GluTape* tape) {
  const int64_t I = glu_inter(P, n, D);
  std::vector<double> g(static_cast<size_t>(N * I)), u(static_cast<size_t>(N * I)), h(static_cast<size_t>(N * I));
  linear_forward(g.data(), x, P.p(n.gate), N, D, I);
  linear_forward(u.data(), x, P.p(n.up), N, D, I);
  glu_forward(h.data(), g.data(), u.data(), int64_t(h.size()), glu_params(c));
  linear_forward(y, h.data(), P.p(n.down), N, I, D);
  if (tape) {
    tape->N = N;
    tape->D = D;
    tape->I = I;
    tape->x.assign(x, x + N * D);
    tape->g = std::move(g);
    tape->u = std::move(u);
    tape->h = std::move(h);
  }
}

void glu_backward_named(ParamStore& P, const GluNames& n, const K3Config& c, const GluTape& t, const double* dy,
                        double* dx) {
  const int64_t N = t.N, D = t.D, I = t.I;
  if (glu_inter(P, n, D) != I) fail("tensor '", n.gate, "' does not match the tape (intermediate ", I, ")");
  // y = h Wdᵀ:  dWd += dyᵀ h,  dh = dy Wd.
  linear_backward(nullptr, P.g(n.down), dy, t.h.data(), nullptr, N, I, D);
  std::vector<double> dg(static_cast<size_t>(N * I)), du(static_cast<size_t>(N * I));
  linear_backward(dg.data(), nullptr, dy, nullptr, P.p(n.down), N, I, D);  // dg holds dh for now
  // h = act(g, u):  dg = dh ∂h/∂g,  du = dh ∂h/∂u.
  glu_backward(dg.data(), du.data(), dg.data(), t.g.data(), t.u.data(), int64_t(dg.size()), glu_params(c));
  // g = x Wgᵀ, u = x Wuᵀ:  dWg += dgᵀ x,  dWu += duᵀ x,  dx = dg Wg + du Wu.
  linear_backward(nullptr, P.g(n.gate), dg.data(), t.x.data(), nullptr, N, D, I);
  linear_backward(nullptr, P.g(n.up), du.data(), t.x.data(), nullptr, N, D, I);
  linear_backward(dx, nullptr, dg.data(), nullptr, P.p(n.gate), N, D, I);
  linear_backward(dx, nullptr, du.data(), nullptr, P.p(n.up), N, D, I, true);
}

}  // namespace

void glu_mlp_forward(const ParamStore& P, const std::string& mlp_prefix, const K3Config& c, const double* x, int64_t N,
                     int64_t D, double* y, GluTape* tape) {
  glu_forward_named(P, glu_names(P, mlp_prefix), c, x, N, D, y, tape);
}

void glu_mlp_backward(ParamStore& P, const std::string& mlp_prefix, const K3Config& c, const GluTape& tape,
                      const double* dy, double* dx) {
  glu_backward_named(P, glu_names(P, mlp_prefix), c, tape, dy, dx);
}

void dense_ffn_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t /*layer*/,
                       const double* x, int64_t T, double* y, GluTape* tape) {
  glu_forward_named(P, dense_glu(prefix), c, x, T, c.hidden_size, y, tape);
}

void dense_ffn_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t /*layer*/,
                        const GluTape& tape, const double* dy, double* dx) {
  if (tape.D != c.hidden_size)
    fail("dense FFN tape for '", prefix + tensor_info(TensorKind::DenseGate).module, "' has width ", tape.D,
         ", expected ", c.hidden_size);
  glu_backward_named(P, dense_glu(prefix), c, tape, dy, dx);
}

void moe_ffn_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t /*layer*/,
                     const double* x, int64_t N, double* y, MoeTape* tape, const double* router_bias,
                     const int32_t* forced_topk) {
  const int64_t D = c.hidden_size, E = c.num_experts, K = c.num_experts_per_token, L = c.routed_expert_hidden_size;
  if (E <= 0) fail(c.source, ": moe_ffn_forward needs num_experts > 0");

  MoeTape local;
  MoeTape& t = tape ? *tape : local;
  t = MoeTape{};
  t.N = N;
  t.E = E;
  t.K = K;
  t.D = D;
  t.L = L;
  t.x.assign(x, x + N * D);

  // 1. Router on the full-width x̂.
  std::vector<double> logits(static_cast<size_t>(N * E));
  linear_forward(logits.data(), x, P.p(tensor_name_at(prefix, TensorKind::MoeRouter), E * D), N, D, E);
  t.scores.resize(static_cast<size_t>(N * E));
  t.topk.resize(static_cast<size_t>(N * K));
  t.weight.resize(static_cast<size_t>(N * K));
  t.sel_sum.resize(static_cast<size_t>(N));
  moe::router_forward(t.topk.data(), t.weight.data(), t.scores.data(), t.sel_sum.data(), logits.data(), router_bias, N,
                      router_params(c), forced_topk);

  // 2. Latent down-projection z = W↓ x̂.
  t.z.resize(static_cast<size_t>(N * L));
  linear_forward(t.z.data(), x, P.p(tensor_name_at(prefix, TensorKind::MoeLatentDown), L * D), N, D, L);

  // 3-4. Each expert once on its gathered latent rows; u = Σ_k w_k y_{e_k}.
  t.rows.assign(static_cast<size_t>(E), {});
  for (int64_t n = 0; n < N; ++n)
    for (int32_t k = 0; k < K; ++k) t.rows[size_t(t.topk[size_t(n * K + k)])].push_back({n, k});
  t.expert_tape.assign(static_cast<size_t>(E), GluTape{});
  t.expert_out.assign(static_cast<size_t>(E), {});
  t.agg.assign(static_cast<size_t>(N * L), 0.0);
  std::vector<double> zin;
  for (int64_t e = 0; e < E; ++e) {
    const auto& rows = t.rows[size_t(e)];
    if (rows.empty()) continue;
    const int64_t ne = int64_t(rows.size());
    zin.resize(static_cast<size_t>(ne * L));
    for (int64_t i = 0; i < ne; ++i) std::copy_n(&t.z[size_t(rows[size_t(i)].first * L)], L, &zin[size_t(i * L)]);
    std::vector<double>& ye = t.expert_out[size_t(e)];
    ye.resize(static_cast<size_t>(ne * L));
    const GluNames names = expert_glu(prefix, e);
    glu_forward_named(P, names, c, zin.data(), ne, L, ye.data(), &t.expert_tape[size_t(e)]);
    for (int64_t i = 0; i < ne; ++i) {
      const auto [n, k] = rows[size_t(i)];
      const double w = t.weight[size_t(n * K + k)];
      double* dst = &t.agg[size_t(n * L)];
      for (int64_t j = 0; j < L; ++j) dst[j] += w * ye[size_t(i * L + j)];
    }
  }

  // RMSNorm of the aggregate (not per expert): normed = γ ⊙ u / sqrt(mean(u²) + eps).
  t.normed = t.agg;
  if (c.latent_moe_use_norm)
    rmsnorm_forward(t.normed.data(), t.agg.data(), P.p(tensor_name_at(prefix, TensorKind::MoeLatentNorm), L),
                    c.rms_norm_eps, N, L);

  // 5. Up-projection r = W↑ normed, plus the shared experts on x̂ (added with no weight).
  linear_forward(y, t.normed.data(), P.p(tensor_name_at(prefix, TensorKind::MoeLatentUp), D * L), N, L, D);
  t.has_shared = c.num_shared_experts > 0;
  if (t.has_shared) {
    std::vector<double> sh(static_cast<size_t>(N * D));
    const GluNames names = shared_glu(prefix);
    glu_forward_named(P, names, c, x, N, D, sh.data(), &t.shared);
    for (size_t i = 0; i < sh.size(); ++i) y[i] += sh[i];
  }
}

void moe_ffn_backward(ParamStore& P, const std::string& prefix, const K3Config& c, int64_t /*layer*/, const MoeTape& t,
                      const double* dy, double* dx) {
  const int64_t N = t.N, D = t.D, E = t.E, K = t.K, L = t.L;
  if (D != c.hidden_size || E != c.num_experts || K != c.num_experts_per_token || L != c.routed_expert_hidden_size)
    fail("MoE tape for '", prefix + tensor_info(TensorKind::MoeRouter).module, "' does not match the config");

  // Shared experts: y += shared(x)  ->  dx = d shared/dx.
  if (t.has_shared) {
    const GluNames names = shared_glu(prefix);
    glu_backward_named(P, names, c, t.shared, dy, dx);
  } else {
    std::fill(dx, dx + N * D, 0.0);
  }

  // y = normed W↑ᵀ:  dW↑ += dyᵀ normed,  dnormed = dy W↑.
  const std::string up = tensor_name_at(prefix, TensorKind::MoeLatentUp);
  linear_backward(nullptr, P.g(up, D * L), dy, t.normed.data(), nullptr, N, L, D);
  std::vector<double> du(static_cast<size_t>(N * L));
  linear_backward(du.data(), nullptr, dy, nullptr, P.p(up, D * L), N, L, D);

  // RMSNorm (kernels/norm): du holds the gradient of its output, then of its input.
  if (c.latent_moe_use_norm) {
    const std::string nn = tensor_name_at(prefix, TensorKind::MoeLatentNorm);
    const std::vector<double> dnormed = du;
    rmsnorm_backward(du.data(), P.g(nn, L), dnormed.data(), t.agg.data(), P.p(nn, L), c.rms_norm_eps, N, L);
  }

  // u = Σ_k w_k y_{e_k}:  dy_e (row of slot k) = w_k du,  dw_k = <du, y_{e_k}>.
  // Expert backward gives dz for its gathered rows, scattered back to dz [N, L].
  std::vector<double> dz(static_cast<size_t>(N * L), 0.0), dw(static_cast<size_t>(N * K), 0.0);
  std::vector<double> dye, dzin;
  for (int64_t e = 0; e < E; ++e) {
    const auto& rows = t.rows[size_t(e)];
    if (rows.empty()) continue;
    const int64_t ne = int64_t(rows.size());
    const std::vector<double>& ye = t.expert_out[size_t(e)];
    dye.resize(static_cast<size_t>(ne * L));
    dzin.resize(static_cast<size_t>(ne * L));
    for (int64_t i = 0; i < ne; ++i) {
      const auto [n, k] = rows[size_t(i)];
      const double w = t.weight[size_t(n * K + k)];
      const double* g = &du[size_t(n * L)];
      double acc = 0.0;
      for (int64_t j = 0; j < L; ++j) {
        dye[size_t(i * L + j)] = w * g[j];
        acc += g[j] * ye[size_t(i * L + j)];
      }
      dw[size_t(n * K + k)] = acc;
    }
    const GluNames names = expert_glu(prefix, e);
    glu_backward_named(P, names, c, t.expert_tape[size_t(e)], dye.data(), dzin.data());
    for (int64_t i = 0; i < ne; ++i) {
      double* dst = &dz[size_t(rows[size_t(i)].first * L)];
      for (int64_t j = 0; j < L; ++j) dst[j] += dzin[size_t(i * L + j)];
    }
  }

  // z = x W↓ᵀ:  dW↓ += dzᵀ x,  dx += dz W↓.
  const std::string down = tensor_name_at(prefix, TensorKind::MoeLatentDown);
  linear_backward(nullptr, P.g(down, L * D), dz.data(), t.x.data(), nullptr, N, D, L);
  linear_backward(dx, nullptr, dz.data(), nullptr, P.p(down, L * D), N, D, L, true);

  // Router. w_k = c s_k / (S + 1e-20) with S = Σ_sel s (c = routed_scaling_factor), so for a
  // selected j:  ∂L/∂s_j = c [dw_j / (S + 1e-20) − Σ_k dw_k s_k / (S + 1e-20)²]  (renormalised) or
  // c dw_j (not). s = σ(logit) gives dlogit_j = ∂L/∂s_j s_j (1 − s_j). Unselected experts: 0.
  const double scale = double(c.routed_scaling_factor);
  std::vector<double> dlogits(static_cast<size_t>(N * E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const double* s = &t.scores[size_t(n * E)];
    const double den = t.sel_sum[size_t(n)] + 1e-20;
    double dot = 0.0;
    for (int64_t k = 0; k < K; ++k) dot += dw[size_t(n * K + k)] * s[t.topk[size_t(n * K + k)]];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = t.topk[size_t(n * K + k)];
      const double ds =
          c.moe_renormalize ? scale * (dw[size_t(n * K + k)] / den - dot / (den * den)) : scale * dw[size_t(n * K + k)];
      dlogits[size_t(n * E + e)] = ds * s[e] * (1.0 - s[e]);
    }
  }
  // logits = x Wrᵀ:  dWr += dlogitsᵀ x,  dx += dlogits Wr.
  const std::string gate = tensor_name_at(prefix, TensorKind::MoeRouter);
  linear_backward(nullptr, P.g(gate, E * D), dlogits.data(), t.x.data(), nullptr, N, D, E);
  linear_backward(dx, nullptr, dlogits.data(), nullptr, P.p(gate, E * D), N, D, E, true);
}

}  // namespace k3::train
