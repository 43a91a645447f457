// AdamW, Muon / Per-Head Muon, the parameter-group rule, clipping, the LR schedule and exact
// resume (src/train/optimizer.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "model/config.h"
#include "train/optimizer.h"

using namespace k3::train;

namespace {

const std::string kFixture = std::string(K3_SOURCE_DIR) + "/tests/fixtures/k3-tiny-a";

void fill_randn(double* x, int64_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  for (int64_t i = 0; i < n; ++i) x[i] = d(rng);
}

// Eigenvalues of a symmetric n×n matrix by cyclic Jacobi rotations (independent of the library).
std::vector<double> jacobi_eigenvalues(std::vector<double> a, int64_t n) {
  for (int sweep = 0; sweep < 100; ++sweep) {
    double off = 0;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) off += a[size_t(p * n + q)] * a[size_t(p * n + q)];
    if (off < 1e-26) break;
    for (int64_t p = 0; p < n; ++p)
      for (int64_t q = p + 1; q < n; ++q) {
        const double apq = a[size_t(p * n + q)];
        if (std::abs(apq) < 1e-300) continue;
        const double theta = (a[size_t(q * n + q)] - a[size_t(p * n + p)]) / (2 * apq);
        const double t = (theta >= 0 ? 1.0 : -1.0) / (std::abs(theta) + std::sqrt(theta * theta + 1));
        const double c = 1 / std::sqrt(t * t + 1), s = t * c;
        for (int64_t k = 0; k < n; ++k) {  // A ← JᵀAJ: columns then rows
          const double akp = a[size_t(k * n + p)], akq = a[size_t(k * n + q)];
          a[size_t(k * n + p)] = c * akp - s * akq;
          a[size_t(k * n + q)] = s * akp + c * akq;
        }
        for (int64_t k = 0; k < n; ++k) {
          const double apk = a[size_t(p * n + k)], aqk = a[size_t(q * n + k)];
          a[size_t(p * n + k)] = c * apk - s * aqk;
          a[size_t(q * n + k)] = s * apk + c * aqk;
        }
      }
  }
  std::vector<double> ev(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ev[size_t(i)] = a[size_t(i * n + i)];
  return ev;
}

// Singular values of a rows×cols matrix: sqrt of the eigenvalues of the smaller Gram matrix.
std::vector<double> singular_values(const std::vector<double>& x, int64_t rows, int64_t cols) {
  const bool small_rows = rows <= cols;
  const int64_t n = small_rows ? rows : cols;
  std::vector<double> g(static_cast<size_t>(n * n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      if (small_rows)
        for (int64_t k = 0; k < cols; ++k) s += x[size_t(i * cols + k)] * x[size_t(j * cols + k)];
      else
        for (int64_t k = 0; k < rows; ++k) s += x[size_t(k * cols + i)] * x[size_t(k * cols + j)];
      g[size_t(i * n + j)] = s;
    }
  std::vector<double> ev = jacobi_eigenvalues(g, n);
  for (double& e : ev) e = std::sqrt(std::max(e, 0.0));
  return ev;
}

}  // namespace

TEST(Optimizer, AdamWMatchesHandReference) {
  ParamStore P;
  P.add("model.embed_tokens.weight", {2, 3});  // matrix on AdamW: decayed (flat offsets 0..5)
  P.add("v.weight", {3});                      // vector: AdamW, no decay (offsets 6..8)
  const std::vector<double> w0 = {1.0, -2.0, 0.5, 0.3, -0.7, 1.1, 2.0, 0.0, -1.5};
  P.values() = w0;
  OptimizerConfig cfg;  // beta 0.9/0.95, eps 1e-8, wd 0.1
  Optimizer opt(P, cfg);
  EXPECT_EQ(opt.plan_of("v.weight").group, ParamGroup::AdamW);
  EXPECT_FALSE(opt.plan_of("v.weight").decay);
  EXPECT_TRUE(opt.plan_of("model.embed_tokens.weight").decay);
  const std::vector<std::vector<double>> grads = {{0.5, -1.0, 0.0, 2.0, 0.1, -0.3, 0.5, 1e-3, -4.0},
                                                  {0.2, 0.3, -0.1, -1.0, 0.0, 0.4, 0.5, -1e-3, 3.0},
                                                  {-0.4, 0.0, 0.7, 0.5, 0.2, -0.2, 0.1, 0.0, 1.0}};
  const std::vector<double> lrs = {0.1, 0.05, 0.02};
  std::vector<double> w = w0, m(9, 0.0), v(9, 0.0);
  for (int t = 1; t <= 3; ++t) {
    P.grads() = grads[size_t(t - 1)];
    opt.step(P, lrs[size_t(t - 1)]);
    const double lr = lrs[size_t(t - 1)];
    for (int i = 0; i < 9; ++i) {
      const double g = grads[size_t(t - 1)][size_t(i)];
      m[size_t(i)] = 0.9 * m[size_t(i)] + 0.1 * g;
      v[size_t(i)] = 0.95 * v[size_t(i)] + 0.05 * g * g;
      const double mh = m[size_t(i)] / (1 - std::pow(0.9, t)), vh = v[size_t(i)] / (1 - std::pow(0.95, t));
      const bool decay = i < 6;
      w[size_t(i)] = w[size_t(i)] * (decay ? 1 - lr * 0.1 : 1.0) - lr * mh / (std::sqrt(vh) + 1e-8);
      EXPECT_NEAR(P.values()[size_t(i)], w[size_t(i)], 1e-14 * (1 + std::abs(w[size_t(i)]))) << "t " << t << " i " << i;
    }
    if (t == 1) {
      // By hand: at t = 1 the bias-corrected step is lr·g/(|g| + eps).
      EXPECT_NEAR(P.values()[0], 1.0 * (1 - 0.01) - 0.1 * 0.5 / (0.5 + 1e-8), 1e-15);  // 0.890000002
      EXPECT_NEAR(P.values()[2], 0.5 * 0.99, 1e-15);                                   // g = 0: decay only
      EXPECT_NEAR(P.values()[6], 2.0 - 0.1 * 0.5 / (0.5 + 1e-8), 1e-15);               // vector: no decay
    }
  }
  EXPECT_EQ(opt.steps_taken(), 3);
}

TEST(Optimizer, NewtonSchulzSingularValuesNearOne) {
  std::mt19937 rng(1);
  for (auto [r, c] : {std::pair<int64_t, int64_t>{24, 40}, {40, 24}, {8, 64}, {32, 33}}) {
    std::vector<double> g(static_cast<size_t>(r * c)), o(static_cast<size_t>(r * c));
    fill_randn(g.data(), r * c, rng, 3.0);
    newton_schulz(g.data(), o.data(), r, c, 5);
    const std::vector<double> sv = singular_values(o, r, c);
    double lo = 1e9, hi = 0;
    for (double s : sv) lo = std::min(lo, s), hi = std::max(hi, s);
    std::printf("%ldx%ld: NS singular values in [%.3f, %.3f]\n", long(r), long(c), lo, hi);
    // The quintic p(x) = 3.4445x − 4.775x³ + 2.0315x⁵ peaks at 1.2024 on [0, 1]; five steps take
    // every normalised singular value above ~0.004 into [0.682, 1.2024] (computed by iterating p).
    for (double s : sv) {
      EXPECT_GE(s, 0.6) << r << "x" << c;
      EXPECT_LE(s, 1.2025) << r << "x" << c;
    }
    // Same singular vectors as G (out ≈ U S' Vᵀ for G = U S Vᵀ): out·Gᵀ = U S'S Uᵀ is symmetric.
    double asym = 0, mag = 0;
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double a = 0, b = 0;
        for (int64_t k = 0; k < c; ++k) {
          a += o[size_t(i * c + k)] * g[size_t(j * c + k)];
          b += o[size_t(j * c + k)] * g[size_t(i * c + k)];
        }
        asym = std::max(asym, std::abs(a - b));
        mag = std::max(mag, std::abs(a));
      }
    EXPECT_LT(asym, 1e-10 * mag);
  }
  // The quintic's result does not depend on G's scale (it normalises by the Frobenius norm).
  std::vector<double> g(6 * 10), o1(60), o2(60);
  fill_randn(g.data(), 60, rng);
  newton_schulz(g.data(), o1.data(), 6, 10);
  for (double& x : g) x *= 1e-6;
  newton_schulz(g.data(), o2.data(), 6, 10);
  for (int i = 0; i < 60; ++i) EXPECT_NEAR(o1[size_t(i)], o2[size_t(i)], 1e-12);
  std::vector<double> z(60, 0.0);
  newton_schulz(z.data(), o1.data(), 6, 10);
  for (double x : o1) EXPECT_EQ(x, 0.0);
}

TEST(Optimizer, MuonUpdateRmsMatchesAdam) {
  ParamStore P;
  P.add("w.weight", {48, 96});
  std::mt19937 rng(3);
  fill_randn(P.grads().data(), 48 * 96, rng);
  OptimizerConfig cfg;
  cfg.weight_decay = 0;
  Optimizer opt(P, cfg);
  opt.step(P, 1.0);
  double ss = 0;
  for (double x : P.values()) ss += x * x;
  const double rms = std::sqrt(ss / (48 * 96));
  std::printf("Muon update RMS at lr 1: %.4f (target 0.2)\n", rms);
  EXPECT_GT(rms, 0.15);
  EXPECT_LT(rms, 0.25);
}

// router_lr_scale: the router matrix takes exactly the update (decay included) of a run at lr·scale;
// every other tensor the update at lr.
TEST(Optimizer, RouterLrScaleAppliesToRouterOnly) {
  const std::string router = "model.layers.1.block_sparse_moe.gate.weight";
  const std::string other = "model.layers.1.block_sparse_moe.experts.0.w1.weight";
  auto make = [&] {
    ParamStore P;
    P.add(router, {8, 12});
    P.add(other, {8, 12});
    std::mt19937 rng(4);
    fill_randn(P.values().data(), 2 * 8 * 12, rng, 0.1);
    fill_randn(P.grads().data(), 2 * 8 * 12, rng);
    return P;
  };
  OptimizerConfig scaled, plain;
  scaled.router_lr_scale = 0.25;
  ParamStore A = make(), B = make(), C = make();
  Optimizer oa(A, scaled), ob(B, plain), oc(C, plain);
  EXPECT_TRUE(is_router_weight(router));
  EXPECT_FALSE(is_router_weight(other));
  EXPECT_FALSE(is_router_weight("model.layers.1.block_sparse_moe.gate.e_score_correction_bias"));
  EXPECT_EQ(oa.plan_of(router).lr_scale, 0.25);
  EXPECT_EQ(oa.plan_of(other).lr_scale, 1.0);
  oa.step(A, 0.0625);    // powers of two: lr·scale is exact
  ob.step(B, 0.0625);    // B: the other tensor's truth
  oc.step(C, 0.015625);  // C: the router's truth (lr·scale)
  const double* ar = A.p(router);
  const double* cr = C.p(router);
  const double* ao = A.p(other);
  const double* bo = B.p(other);
  for (int i = 0; i < 8 * 12; ++i) {
    EXPECT_EQ(ar[i], cr[i]) << i;
    EXPECT_EQ(ao[i], bo[i]) << i;
  }
  EXPECT_EQ(oa.save_state().header.at("config").at("router_lr_scale").get<double>(), 0.25);
}

TEST(Optimizer, PerHeadMuonEqualsSeparateMuonPerHead) {
  const int64_t H = 4, D = 8, IN = 20;
  const std::string qn = "model.layers.0.self_attn.q_proj.weight";
  ParamStore A, B, C;
  A.add(qn, {H * D, IN});
  C.add(qn, {H * D, IN});
  for (int64_t h = 0; h < H; ++h) B.add("head" + std::to_string(h) + ".weight", {D, IN});
  std::mt19937 rng(9);
  fill_randn(A.values().data(), H * D * IN, rng, 0.1);
  B.values() = A.values();  // head h = rows [h·D, (h+1)·D) = B's h-th tensor (added in order)
  C.values() = A.values();
  OptimizerConfig cfg;
  Optimizer oa(A, cfg, {{qn, H}}), ob(B, cfg), oc(C, cfg);
  EXPECT_EQ(oa.plan_of(qn).heads, H);
  for (int step = 0; step < 3; ++step) {
    fill_randn(A.grads().data(), H * D * IN, rng);
    // One head with a 50x larger gradient: a whole-matrix orthogonalisation would be dominated by it.
    for (int64_t i = 0; i < D * IN; ++i) A.grads()[size_t(i)] *= 50;
    B.grads() = A.grads();
    C.grads() = A.grads();
    oa.step(A, 0.02);
    ob.step(B, 0.02);
    oc.step(C, 0.02);
  }
  double diff_whole = 0;
  for (size_t i = 0; i < A.values().size(); ++i) {
    EXPECT_NEAR(A.values()[i], B.values()[i], 1e-13) << i;
    diff_whole = std::max(diff_whole, std::abs(A.values()[i] - C.values()[i]));
  }
  EXPECT_GT(diff_whole, 1e-3);  // the split matters
}

// The expected group of every tensor of the K3 fixture, from an explicit list of name endings.
TEST(Optimizer, GroupRuleOnFixtureModel) {
  ParamStore P = ParamStore::from_model_dir(kFixture);
  const k3::K3Config cfg = k3::load_config(kFixture + "/config.json");
  const std::vector<std::string> muon = {"self_attn.q_proj.weight",
                                         "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight",
                                         "self_attn.o_proj.weight",
                                         "self_attn.g_proj.weight",
                                         "self_attn.f_a_proj.weight",
                                         "self_attn.f_b_proj.weight",
                                         "self_attn.b_proj.weight",
                                         "self_attn.q_a_proj.weight",
                                         "self_attn.q_b_proj.weight",
                                         "self_attn.kv_a_proj_with_mqa.weight",
                                         "self_attn.kv_b_proj.weight",
                                         "mlp.gate_proj.weight",
                                         "mlp.up_proj.weight",
                                         "mlp.down_proj.weight",
                                         "gate.weight",
                                         "w1.weight",
                                         "w2.weight",
                                         "w3.weight",
                                         "routed_expert_down_proj.weight",
                                         "routed_expert_up_proj.weight",
                                         "shared_experts.gate_proj.weight",
                                         "shared_experts.up_proj.weight",
                                         "shared_experts.down_proj.weight"};
  const std::vector<std::string> adamw = {"embed_tokens.weight", "lm_head.weight", "norm.weight",
                                          "layernorm.weight",    "A_log",          "dt_bias",
                                          "conv1d.weight",       "res_proj.weight"};
  auto ends_with = [](const std::string& s, const std::string& t) {
    return s.size() >= t.size() && s.compare(s.size() - t.size(), t.size(), t) == 0;
  };
  const std::map<std::string, int64_t> splits = k3_head_splits(P, cfg);
  Optimizer opt(P, OptimizerConfig{}, splits);
  int n_muon = 0, n_adam = 0, n_frozen = 0;
  for (const std::string& n : P.names()) {
    ParamGroup want;
    if (ends_with(n, "e_score_correction_bias")) {
      want = ParamGroup::Frozen;
    } else if (std::any_of(adamw.begin(), adamw.end(), [&](const std::string& t) { return ends_with(n, t); })) {
      want = ParamGroup::AdamW;
    } else if (std::any_of(muon.begin(), muon.end(), [&](const std::string& t) { return ends_with(n, t); })) {
      want = ParamGroup::Muon;
    } else {
      ADD_FAILURE() << "tensor not in the test's lists: " << n;
      continue;
    }
    EXPECT_EQ(default_param_group(n, P.shape(n)), want) << n;
    EXPECT_EQ(opt.plan_of(n).group, want) << n;
    n_muon += want == ParamGroup::Muon;
    n_adam += want == ParamGroup::AdamW;
    n_frozen += want == ParamGroup::Frozen;
  }
  EXPECT_EQ(n_frozen, 7);  // one router bias per MoE layer (layers 1..7)
  EXPECT_GT(n_muon, 0);
  EXPECT_GT(n_adam, 0);
  // Per-head splits: q/k/v of the 5 KDA layers and q_b/kv_b of the 3 MLA layers, 4 heads each.
  EXPECT_EQ(splits.size(), 5u * 3 + 3u * 2);
  for (const auto& [n, h] : splits) {
    EXPECT_EQ(h, 4) << n;
    EXPECT_EQ(opt.plan_of(n).heads, 4) << n;
  }
  EXPECT_EQ(splits.count("language_model.model.layers.3.self_attn.kv_b_proj.weight"), 1u);
  EXPECT_EQ(splits.count("language_model.model.layers.0.self_attn.v_proj.weight"), 1u);
  // One step over the whole model: frozen tensors do not move, everything with a gradient does.
  std::mt19937 rng(2);
  fill_randn(P.grads().data(), int64_t(P.grads().size()), rng, 1e-2);
  const std::vector<double> before = P.values();
  opt.step(P, 1e-3);
  for (const std::string& n : P.names()) {
    const double* a = P.p(n);
    const double* b = before.data() + (a - P.values().data());
    double moved = 0;
    for (int64_t i = 0; i < P.numel(n); ++i) moved = std::max(moved, std::abs(a[i] - b[i]));
    if (opt.plan_of(n).group == ParamGroup::Frozen) EXPECT_EQ(moved, 0.0) << n;
    else EXPECT_GT(moved, 0.0) << n;
  }
  // A split that does not divide the rows, or names a non-matrix, is refused.
  EXPECT_THROW(Optimizer(P, OptimizerConfig{}, {{"language_model.model.layers.0.self_attn.q_proj.weight", 3}}),
               k3::Error);
  EXPECT_THROW(Optimizer(P, OptimizerConfig{}, {{"language_model.model.norm.weight", 1}}), k3::Error);
  EXPECT_THROW(Optimizer(P, OptimizerConfig{}, {{"no.such.weight", 1}}), k3::Error);
}

TEST(Optimizer, ClipGradNorm) {
  ParamStore P;
  P.add("a", {2});
  P.add("b", {2});
  P.grads() = {3.0, 0.0, 0.0, 4.0};  // norm 5
  EXPECT_DOUBLE_EQ(clip_grad_norm(P, 10.0), 5.0);
  EXPECT_EQ(P.grads(), (std::vector<double>{3.0, 0.0, 0.0, 4.0}));  // under the limit: untouched
  EXPECT_DOUBLE_EQ(clip_grad_norm(P, 1.0), 5.0);                    // returns the pre-clip norm
  EXPECT_NEAR(P.grads()[0], 0.6, 1e-15);
  EXPECT_NEAR(P.grads()[3], 0.8, 1e-15);
  EXPECT_NEAR(clip_grad_norm(P, 0.0), 1.0, 1e-15);  // max_norm 0: measure only
  const std::vector<std::string> only_b = {"b"};
  P.grads() = {3.0, 0.0, 0.0, 4.0};
  EXPECT_DOUBLE_EQ(clip_grad_norm(P, 2.0, &only_b), 4.0);
  EXPECT_EQ(P.grads(), (std::vector<double>{3.0, 0.0, 0.0, 2.0}));
}

TEST(Optimizer, CosineScheduleWithWarmup) {
  const double peak = 1e-3, lo = 1e-4;
  EXPECT_DOUBLE_EQ(cosine_lr(0, 10, 110, peak, lo), 1e-4);  // first update: peak/warmup
  EXPECT_DOUBLE_EQ(cosine_lr(4, 10, 110, peak, lo), 5e-4);
  EXPECT_DOUBLE_EQ(cosine_lr(9, 10, 110, peak, lo), peak);                  // end of warmup
  EXPECT_DOUBLE_EQ(cosine_lr(10, 10, 110, peak, lo), peak);                 // cosine starts at the peak
  EXPECT_NEAR(cosine_lr(60, 10, 110, peak, lo), 0.5 * (peak + lo), 1e-18);  // halfway
  EXPECT_NEAR(cosine_lr(110, 10, 110, peak, lo), lo, 1e-18);
  EXPECT_EQ(cosine_lr(500, 10, 110, peak, lo), lo);
  for (int64_t s = 10; s < 110; ++s) EXPECT_GE(cosine_lr(s, 10, 110, peak, lo), cosine_lr(s + 1, 10, 110, peak, lo));
  EXPECT_DOUBLE_EQ(cosine_lr(0, 0, 100, peak, lo), peak);  // no warmup
  EXPECT_THROW(cosine_lr(0, 10, 10, peak, lo), k3::Error);
  EXPECT_THROW(cosine_lr(-1, 1, 10, peak, lo), k3::Error);
}

TEST(Optimizer, StateRoundTripResumesExactly) {
  auto make = [] {
    ParamStore P;
    P.add("model.layers.0.self_attn.k_proj.weight", {16, 12});
    P.add("model.layers.0.input_layernorm.weight", {12});
    P.add("model.embed_tokens.weight", {10, 12});
    P.add("model.layers.1.mlp.up_proj.weight", {7, 12});
    P.add("model.layers.1.block_sparse_moe.gate.e_score_correction_bias", {4});
    std::mt19937 rng(4);
    fill_randn(P.values().data(), int64_t(P.values().size()), rng, 0.1);
    return P;
  };
  auto grads_at = [](ParamStore& P, int step) {
    std::mt19937 rng(100 + step);
    fill_randn(P.grads().data(), int64_t(P.grads().size()), rng);
  };
  const std::map<std::string, int64_t> split = {{"model.layers.0.self_attn.k_proj.weight", 4}};
  const int total = 6, cut = 3;
  ParamStore A = make();
  Optimizer oa(A, OptimizerConfig{}, split);
  for (int s = 0; s < total; ++s) {
    grads_at(A, s);
    oa.step(A, cosine_lr(s, 2, total, 0.01, 0.001));
  }
  ParamStore B = make();
  std::string header_text;
  std::vector<double> data, values;
  {
    Optimizer ob(B, OptimizerConfig{}, split);
    for (int s = 0; s < cut; ++s) {
      grads_at(B, s);
      ob.step(B, cosine_lr(s, 2, total, 0.01, 0.001));
    }
    const OptimizerState st = ob.save_state();
    header_text = st.header.dump();
    data = st.data;
    values = B.values();
  }
  // "Restart": fresh parameters from the checkpointed values, fresh optimizer from the state.
  ParamStore R = make();
  R.values() = values;
  Optimizer orr(R, OptimizerConfig{}, split);
  orr.load_state(OptimizerState{nlohmann::json::parse(header_text), data});
  EXPECT_EQ(orr.steps_taken(), cut);
  for (int s = cut; s < total; ++s) {
    grads_at(R, s);
    orr.step(R, cosine_lr(s, 2, total, 0.01, 0.001));
  }
  EXPECT_EQ(R.values(), A.values());  // bit-identical
  // A state of a different plan is refused.
  Optimizer other(R, OptimizerConfig{});  // no per-head split
  EXPECT_THROW(other.load_state(OptimizerState{nlohmann::json::parse(header_text), data}), k3::Error);
  OptimizerState bad{nlohmann::json::parse(header_text), data};
  bad.data.pop_back();
  EXPECT_THROW(orr.load_state(bad), k3::Error);
}
