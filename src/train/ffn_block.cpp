// Float64 forward/backward of the GLU MLP, the dense FFN and Stable LatentMoE (see ffn_block.h).
// Linear layers follow the checkpoint convention W [out, in], y = x Wᵀ, so for a linear layer
//   dW += dyᵀ x   and   dx = dy W.
#include "train/ffn_block.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "model/tensor_table.h"

namespace k3::train {
namespace {

// y[N, out] = x[N, in] Wᵀ  (W [out, in]).
void linear(double* y, const double* x, const double* W, int64_t N, int64_t in, int64_t out) {
  if (N == 0 || out == 0) return;
  if (in == 0) {
    std::fill(y, y + N * out, 0.0);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(N), int(out), int(in), 1.0, x, int(in), W, int(in), 0.0, y,
              int(out));
}

// dW[out, in] += dy[N, out]ᵀ x[N, in].
void linear_dw(double* dW, const double* dy, const double* x, int64_t N, int64_t in, int64_t out) {
  if (N == 0 || out == 0 || in == 0) return;
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(N), 1.0, dy, int(out), x, int(in), 1.0, dW,
              int(in));
}

// dx[N, in] = beta * dx + dy[N, out] W  (W [out, in]).
void linear_dx(double* dx, const double* dy, const double* W, int64_t N, int64_t in, int64_t out, double beta) {
  if (N == 0 || in == 0) return;
  if (out == 0) {
    if (beta == 0.0) std::fill(dx, dx + N * in, 0.0);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(N), int(in), int(out), 1.0, dy, int(out), W, int(in), beta,
              dx, int(in));
}

double sigmoid(double x) {
  // exp of a non-positive number only, so no overflow for large |x|.
  const double e = std::exp(-std::fabs(x));
  return x >= 0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

// Tensor names of one GLU MLP.
struct GluNames {
  std::string gate, up, down;
};

// The GLUs of a layer (its prefix, "...layers.<l>."): the dense FFN, the shared experts, routed expert e.
GluNames glu_at(const std::string& prefix, TensorKind gate, TensorKind up, TensorKind down, int64_t expert) {
  return {tensor_name_at(prefix, gate, expert), tensor_name_at(prefix, up, expert), tensor_name_at(prefix, down, expert)};
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
  linear(g.data(), x, P.p(n.gate), N, D, I);
  linear(u.data(), x, P.p(n.up), N, D, I);
  for (size_t i = 0; i < h.size(); ++i) h[i] = glu_act(g[i], u[i], c);
  linear(y, h.data(), P.p(n.down), N, I, D);
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
  linear_dw(P.g(n.down), dy, t.h.data(), N, I, D);
  std::vector<double> dg(static_cast<size_t>(N * I)), du(static_cast<size_t>(N * I));
  linear_dx(dg.data(), dy, P.p(n.down), N, I, D, 0.0);  // dg holds dh for now
  // h = act(g, u):  dg = dh ∂h/∂g,  du = dh ∂h/∂u.
  for (size_t i = 0; i < dg.size(); ++i) {
    double pg, pu;
    glu_act(t.g[i], t.u[i], c, &pg, &pu);
    du[i] = dg[i] * pu;
    dg[i] *= pg;
  }
  // g = x Wgᵀ, u = x Wuᵀ:  dWg += dgᵀ x,  dWu += duᵀ x,  dx = dg Wg + du Wu.
  linear_dw(P.g(n.gate), dg.data(), t.x.data(), N, D, I);
  linear_dw(P.g(n.up), du.data(), t.x.data(), N, D, I);
  linear_dx(dx, dg.data(), P.p(n.gate), N, D, I, 0.0);
  linear_dx(dx, du.data(), P.p(n.up), N, D, I, 1.0);
}

}  // namespace

double glu_act(double g, double u, const K3Config& c, double* dg, double* du) {
  const double s = sigmoid(g);
  if (c.hidden_act == Activation::SiTU) {
    // h = a(g) b(u), a = b1 tanh(g/b1) σ(g), b = b2 tanh(u/b2).
    // a' = (1 - tanh²(g/b1)) σ(g) + b1 tanh(g/b1) σ(g)(1 - σ(g));  b' = 1 - tanh²(u/b2).
    const double b1 = double(c.situ_beta), b2 = double(c.situ_linear_beta);
    const double tg = std::tanh(g / b1), tu = std::tanh(u / b2);
    const double a = b1 * tg * s, b = b2 * tu;
    if (dg) *dg = ((1.0 - tg * tg) * s + b1 * tg * s * (1.0 - s)) * b;
    if (du) *du = a * (1.0 - tu * tu);
    return a * b;
  }
  // SwiGLU: h = g σ(g) u;  ∂h/∂g = u (σ + g σ (1 - σ));  ∂h/∂u = g σ.
  if (dg) *dg = u * (s + g * s * (1.0 - s));
  if (du) *du = g * s;
  return g * s * u;
}

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
    fail("dense FFN tape for '", prefix + tensor_info(TensorKind::DenseGate).module, "' has width ", tape.D, ", expected ",
         c.hidden_size);
  glu_backward_named(P, dense_glu(prefix), c, tape, dy, dx);
}

void moe_route(const K3Config& c, const double* logits, const double* bias, int64_t N, double* scores, int32_t* idx,
               double* weight, double* sel_sum) {
  const int64_t E = c.num_experts, K = c.num_experts_per_token;
  const int64_t G = c.use_grouped_topk ? c.num_expert_group : 1, TG = c.use_grouped_topk ? c.topk_group : 1;
  if (K < 1 || K > E) fail(c.source, ": num_experts_per_token ", K, " must be in 1..num_experts (", E, ")");
  if (G < 1 || E % G != 0) fail(c.source, ": num_expert_group ", G, " must divide num_experts ", E);
  const int64_t per_group = E / G;
  std::vector<double> sel(static_cast<size_t>(E)), gscore(static_cast<size_t>(G));
  std::vector<int32_t> order(static_cast<size_t>(E)), gorder(static_cast<size_t>(G));
  for (int64_t n = 0; n < N; ++n) {
    double* s = scores + n * E;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = sigmoid(logits[n * E + e]);
      sel[size_t(e)] = s[e] + (bias ? bias[e] : 0.0);  // the bias steers selection only
    }
    if (G > 1 && TG < G) {
      // DeepSeek-V3 group limit (as kernels/moe/router): a group scores the sum of its two best
      // biased scores; experts outside the best TG groups cannot be selected.
      for (int64_t g = 0; g < G; ++g) {
        double b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
          const double v = sel[size_t(e)];
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
      for (int64_t r = TG; r < G; ++r)
        for (int64_t e = gorder[size_t(r)] * per_group; e < (gorder[size_t(r)] + 1) * per_group; ++e)
          sel[size_t(e)] = -INFINITY;
    }
    // Top-K of the biased scores; ties go to the lower expert index (deterministic).
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
      return sel[size_t(a)] > sel[size_t(b)] || (sel[size_t(a)] == sel[size_t(b)] && a < b);
    });
    double sum = 0.0;
    for (int64_t k = 0; k < K; ++k) sum += s[order[size_t(k)]];
    if (sel_sum) sel_sum[n] = sum;
    // Weights from the UNBIASED scores: w = s / (Σ_sel s + 1e-20) when renormalising, times scaling.
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = order[size_t(k)];
      idx[n * K + k] = e;
      const double w = c.moe_renormalize ? s[e] / (sum + 1e-20) : s[e];
      weight[n * K + k] = w * double(c.routed_scaling_factor);
    }
  }
}

void moe_ffn_forward(const ParamStore& P, const std::string& prefix, const K3Config& c, int64_t /*layer*/, const double* x,
                     int64_t N, double* y, MoeTape* tape, const double* router_bias) {
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
  linear(logits.data(), x, P.p(tensor_name_at(prefix, TensorKind::MoeRouter), E * D), N, D, E);
  t.scores.resize(static_cast<size_t>(N * E));
  t.topk.resize(static_cast<size_t>(N * K));
  t.weight.resize(static_cast<size_t>(N * K));
  t.sel_sum.resize(static_cast<size_t>(N));
  moe_route(c, logits.data(), router_bias, N, t.scores.data(), t.topk.data(), t.weight.data(), t.sel_sum.data());

  // 2. Latent down-projection z = W↓ x̂.
  t.z.resize(static_cast<size_t>(N * L));
  linear(t.z.data(), x, P.p(tensor_name_at(prefix, TensorKind::MoeLatentDown), L * D), N, D, L);

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
    for (int64_t i = 0; i < ne; ++i)
      std::copy_n(&t.z[size_t(rows[size_t(i)].first * L)], L, &zin[size_t(i * L)]);
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
  if (c.latent_moe_use_norm) {
    const double* gamma = P.p(tensor_name_at(prefix, TensorKind::MoeLatentNorm), L);
    t.rinv.resize(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) {
      const double* u = &t.agg[size_t(n * L)];
      double ss = 0.0;
      for (int64_t j = 0; j < L; ++j) ss += u[j] * u[j];
      const double r = 1.0 / std::sqrt(ss / double(L) + double(c.rms_norm_eps));
      t.rinv[size_t(n)] = r;
      for (int64_t j = 0; j < L; ++j) t.normed[size_t(n * L + j)] = gamma[j] * u[j] * r;
    }
  }

  // 5. Up-projection r = W↑ normed, plus the shared experts on x̂ (added with no weight).
  linear(y, t.normed.data(), P.p(tensor_name_at(prefix, TensorKind::MoeLatentUp), D * L), N, L, D);
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
  linear_dw(P.g(up, D * L), dy, t.normed.data(), N, L, D);
  std::vector<double> du(static_cast<size_t>(N * L));
  linear_dx(du.data(), dy, P.p(up, D * L), N, L, D, 0.0);

  // RMSNorm: o_j = γ_j u_j r, r = (mean(u²) + eps)^(-1/2).
  //   dγ_j += Σ_n do_j u_j r;   du_j = r γ_j do_j − u_j r³ (1/L) Σ_i γ_i do_i u_i.
  if (c.latent_moe_use_norm) {
    const std::string nn = tensor_name_at(prefix, TensorKind::MoeLatentNorm);
    const double* gamma = P.p(nn, L);
    double* dgamma = P.g(nn, L);
    for (int64_t n = 0; n < N; ++n) {
      const double* u = &t.agg[size_t(n * L)];
      double* d = &du[size_t(n * L)];
      const double r = t.rinv[size_t(n)];
      double dot = 0.0;
      for (int64_t j = 0; j < L; ++j) {
        dgamma[j] += d[j] * u[j] * r;
        dot += gamma[j] * d[j] * u[j];
      }
      const double coef = r * r * r * dot / double(L);
      for (int64_t j = 0; j < L; ++j) d[j] = r * gamma[j] * d[j] - u[j] * coef;
    }
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
  linear_dw(P.g(down, L * D), dz.data(), t.x.data(), N, D, L);
  linear_dx(dx, dz.data(), P.p(down, L * D), N, D, L, 1.0);

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
      const double ds = c.moe_renormalize ? scale * (dw[size_t(n * K + k)] / den - dot / (den * den))
                                          : scale * dw[size_t(n * K + k)];
      dlogits[size_t(n * E + e)] = ds * s[e] * (1.0 - s[e]);
    }
  }
  // logits = x Wrᵀ:  dWr += dlogitsᵀ x,  dx += dlogits Wr.
  const std::string gate = tensor_name_at(prefix, TensorKind::MoeRouter);
  linear_dw(P.g(gate, E * D), dlogits.data(), t.x.data(), N, D, E);
  linear_dx(dx, dlogits.data(), P.p(gate, E * D), N, D, E, 1.0);
}

}  // namespace k3::train
