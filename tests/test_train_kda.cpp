// Training KDA block (src/model/training/kda_block.h): the float64 forward against the golden fixture's
// attention outputs (float64 reference), and the backward against central finite differences of
// that forward on a micro model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "core/error.h"
#include "kernels/kda/kda_f64.h"
#include "model/config.h"
#include "model/model.h"
#include "model/params.h"
#include "model/training/kda_block.h"
#include "util/compare.h"
#include "util/finite_diff.h"
#include "util/fixture.h"
#include "util/kda_micro.h"
#include "util/random.h"

using namespace k3;
using namespace k3::train;
using namespace k3::kda;
using k3test::randn;

namespace {

std::string layer_prefix(int64_t l) { return "language_model.model.layers." + std::to_string(l) + "."; }

// ---- micro model ------------------------------------------------------------------------------------
constexpr int64_t kLayer = 1;  // layer 0 is declared MLA so that the layer index is really checked

K3Config micro_config() { return k3test::kda_micro_config(8, 2, 4, {AttnKind::MLA, AttnKind::KDA}); }

const char* kSuffixes[] = {"q_proj.weight",   "k_proj.weight",   "v_proj.weight",   "q_conv1d.weight",
                           "k_conv1d.weight", "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight",
                           "b_proj.weight",   "g_proj.weight",   "o_proj.weight",   "A_log",
                           "dt_bias",         "o_norm.weight"};

// Random micro parameters. A_log is padded to H + 2 entries like the release checkpoint pads it.
ParamStore micro_params(const K3Config& c, uint64_t seed) {
  const int64_t hid = c.hidden_size, H = c.kda_num_heads, D = c.kda_head_dim, HD = H * D, K = c.short_conv_kernel_size;
  const std::string p = layer_prefix(kLayer) + "self_attn.";
  ParamStore P;
  P.add(p + "q_proj.weight", {HD, hid});
  P.add(p + "k_proj.weight", {HD, hid});
  P.add(p + "v_proj.weight", {HD, hid});
  P.add(p + "q_conv1d.weight", {HD, 1, K});
  P.add(p + "k_conv1d.weight", {HD, 1, K});
  P.add(p + "v_conv1d.weight", {HD, 1, K});
  P.add(p + "f_a_proj.weight", {D, hid});
  P.add(p + "f_b_proj.weight", {HD, D});
  P.add(p + "b_proj.weight", {H, hid});
  P.add(p + "g_proj.weight", {HD, hid});
  P.add(p + "o_proj.weight", {hid, HD});
  P.add(p + "A_log", {H + 2});
  P.add(p + "dt_bias", {HD});
  P.add(p + "o_norm.weight", {D});
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const char* s : kSuffixes) {
    const std::string n = p + s;
    double* v = P.p_mut(n);
    const std::string sn = s;
    for (int64_t i = 0; i < P.numel(n); ++i) {
      if (sn == "o_norm.weight") v[i] = 1.0 + 0.3 * nd(rng);
      else if (sn == "A_log") v[i] = i < H ? 0.5 * nd(rng) : 0.0;
      else if (sn == "dt_bias") v[i] = nd(rng);
      else if (sn == "f_b_proj.weight") v[i] = 0.7 * nd(rng);
      else v[i] = 0.5 * nd(rng);  // projections and conv taps: pre-activations of order 1, not saturated
    }
  }
  return P;
}

double loss(const ParamStore& P, const K3Config& c, const std::vector<double>& x, int64_t T,
            const std::vector<double>& R) {
  std::vector<double> y(static_cast<size_t>(T * c.hidden_size));
  kda_block_forward(P, layer_prefix(kLayer), c, kLayer, x.data(), T, y.data(), nullptr);
  double L = 0;
  for (size_t i = 0; i < y.size(); ++i) L += y[i] * R[i];
  return L;
}

// |analytic - numeric| <= 1e-7 + 1e-5 |numeric|: central differences with eps 1e-6 in float64 carry
// ~1e-10 absolute rounding error and ~1e-12 truncation error for these O(1) quantities.
bool close(double a, double b) { return std::isfinite(a) && std::fabs(a - b) <= 1e-7 + 1e-5 * std::fabs(b); }

struct FdCase {
  int64_t T;
  int64_t state_every;
};

}  // namespace

// (a) Every KDA layer of k3-tiny-a: our float64 forward on the inference model's normalised attention input
// against the golden (float64 reference) attention output.
TEST(TrainKda, ForwardMatchesGolden) {
  Model& m = k3test::tiny();
  const K3Config c = load_config(k3test::fixture("k3-tiny-a/config.json"));
  const ParamStore P = ParamStore::from_model_dir(k3test::fixture("k3-tiny-a"));
  std::map<int64_t, std::vector<float>> attn_in, attn_out;
  int64_t T = 0;
  ForwardHooks hooks;
  hooks.tensor = [&](const char* name, int64_t l, const float* p, int64_t rows, int64_t cols) {
    if (std::string(name) == "attn_in") attn_in[l].assign(p, p + rows * cols), T = rows;
    if (std::string(name) == "attn_out") attn_out[l].assign(p, p + rows * cols);
  };
  SequenceCache cache = m.new_cache();
  m.forward({&cache}, k3test::golden_rows("ids_a"), true, &hooks);
  int n_kda = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layer_kind[size_t(l)] != AttnKind::KDA) continue;
    ++n_kda;
    ASSERT_TRUE(attn_in.count(l)) << l;
    const std::vector<double> x(attn_in[l].begin(), attn_in[l].end());
    std::vector<double> y(static_cast<size_t>(T * c.hidden_size)), y2(y.size());
    KdaBlockTape tape;
    kda_block_forward(P, layer_prefix(l), c, l, x.data(), T, y.data(), &tape);
    kda_block_forward(P, layer_prefix(l), c, l, x.data(), T, y2.data(), nullptr);
    EXPECT_EQ(y, y2) << "the tape must not change the result";
    const std::vector<float> ref = k3test::golden().read_f32("attn_out." + std::to_string(l));
    const double err = k3test::rel_l2(y, ref);
    std::printf("attn_out.%lld (KDA, T=%lld) rel L2 %.3e (the fp32 inference block: %.3e)\n", (long long)l,
                (long long)T, err, k3test::rel_l2(attn_out[l], ref));
    EXPECT_LE(err, 1e-5) << "layer " << l;
    // Most of that error is in the input: attn_in comes from the fp32 inference path, whose upstream layers
    // drift ~1e-5 from the reference by layer 4. Against the fp32 inference block on the SAME input, the
    // only difference left is fp32 rounding inside that block, so this bar is much tighter.
    std::vector<float> yf(y.begin(), y.end());
    const double err_inf = k3test::rel_l2(yf, attn_out[l]);
    std::printf("  vs the fp32 inference block on the same input: rel L2 %.3e\n", err_inf);
    EXPECT_LE(err_inf, 1e-6) << "layer " << l;
  }
  EXPECT_EQ(n_kda, 5);
}

// (b) dx and the gradient of every entry of every parameter tensor against central differences of
// loss = sum(y * R). Several T (shorter and longer than the conv kernel) and state checkpoint spacings
// (1: every state saved; 2 and 3: segments recomputed in the backward; 16: one segment).
TEST(TrainKda, BackwardMatchesFiniteDifferences) {
  const K3Config c = micro_config();
  const int64_t hid = c.hidden_size, H = c.kda_num_heads;
  const double eps = 1e-6;
  for (const FdCase fc : {FdCase{1, 16}, FdCase{3, 2}, FdCase{7, 1}, FdCase{7, 3}, FdCase{7, 16}}) {
    const int64_t T = fc.T;
    SCOPED_TRACE("T=" + std::to_string(T) + " state_every=" + std::to_string(fc.state_every));
    ParamStore P = micro_params(c, 1234 + uint64_t(T));
    const std::vector<double> x = randn(T * hid, 77 + uint64_t(T)), R = randn(T * hid, 99 + uint64_t(T));

    KdaBlockTape tape;
    tape.state_every = fc.state_every;
    std::vector<double> y(static_cast<size_t>(T * hid)), dx(y.size(), 123.0);  // dx must be overwritten
    kda_block_forward(P, layer_prefix(kLayer), c, kLayer, x.data(), T, y.data(), &tape);
    P.zero_grads();
    kda_block_backward(P, layer_prefix(kLayer), c, kLayer, tape, R.data(), dx.data());

    double worst = 0;  // max |a-b| / (1e-7 + 1e-5 |b|), <= 1 passes
    auto check = [&](const std::string& what, double a, double b) {
      worst = std::max(worst, std::fabs(a - b) / (1e-7 + 1e-5 * std::fabs(b)));
      EXPECT_TRUE(close(a, b)) << what << ": analytic " << a << " numeric " << b;
    };
    // dx.
    for (int64_t i = 0; i < T * hid; ++i) {
      std::vector<double> xp = x, xm = x;
      xp[size_t(i)] += eps;
      xm[size_t(i)] -= eps;
      check("dx[" + std::to_string(i) + "]", dx[size_t(i)], (loss(P, c, xp, T, R) - loss(P, c, xm, T, R)) / (2 * eps));
    }
    // Every parameter entry (the tensors are small). A_log padding must get exactly zero gradient.
    double max_grad = 0;
    for (const char* s : kSuffixes) {
      const std::string n = layer_prefix(kLayer) + "self_attn." + s;
      double* v = P.p_mut(n);
      const double* g = P.g(n);
      for (int64_t i = 0; i < P.numel(n); ++i) {
        const double num = k3test::central_difference(
            &v[i], [&] { return loss(P, c, x, T, R); }, eps);
        if (std::string(s) == "A_log" && i >= H) {
          EXPECT_EQ(g[i], 0.0) << n << "[" << i << "] is padding";
          EXPECT_EQ(num, 0.0) << n << "[" << i << "] is padding";
        } else {
          check(n + "[" + std::to_string(i) + "]", g[i], num);
        }
        max_grad = std::max(max_grad, std::fabs(g[i]));
      }
    }
    EXPECT_GT(max_grad, 1e-3);  // the check above is not vacuous
    std::printf("T=%lld state_every=%lld: worst |a-b|/(1e-7+1e-5|b|) = %.3e\n", (long long)T, (long long)fc.state_every,
                worst);
  }
}

// Gradients accumulate (+=) across calls; dx is overwritten; the result does not depend on state_every.
TEST(TrainKda, GradientsAccumulateDxOverwritten) {
  const K3Config c = micro_config();
  const int64_t T = 6, hid = c.hidden_size;
  ParamStore P = micro_params(c, 5);
  const std::vector<double> x = randn(T * hid, 6), dy = randn(T * hid, 7);
  std::vector<double> y(static_cast<size_t>(T * hid)), dx1(y.size(), -5.0), dx2(y.size(), 9.0);
  KdaBlockTape t1, t2;
  t2.state_every = 4;
  kda_block_forward(P, layer_prefix(kLayer), c, kLayer, x.data(), T, y.data(), &t1);
  kda_block_forward(P, layer_prefix(kLayer), c, kLayer, x.data(), T, y.data(), &t2);
  P.zero_grads();
  kda_block_backward(P, layer_prefix(kLayer), c, kLayer, t1, dy.data(), dx1.data());
  const std::vector<double> once = P.grads();
  kda_block_backward(P, layer_prefix(kLayer), c, kLayer, t2, dy.data(), dx2.data());
  for (size_t i = 0; i < dx1.size(); ++i) EXPECT_NEAR(dx1[i], dx2[i], 1e-12 * (1 + std::fabs(dx1[i])));
  for (size_t i = 0; i < once.size(); ++i) EXPECT_NEAR(P.grads()[i], 2 * once[i], 1e-12 * (1 + std::fabs(once[i])));
}

// Bad shapes and a non-KDA layer are k3::Errors naming the problem.
TEST(TrainKda, BadInputsThrow) {
  const K3Config c = micro_config();
  const int64_t T = 2;
  const std::vector<double> x = randn(T * c.hidden_size, 1);
  std::vector<double> y(x.size());
  {
    ParamStore P = micro_params(c, 1);
    try {
      kda_block_forward(P, layer_prefix(0), c, 0, x.data(), T, y.data(), nullptr);  // layer 0 is MLA
      FAIL() << "no error";
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a KDA layer"), std::string::npos) << e.what();
    }
  }
  {
    K3Config c2 = c;
    c2.kda_head_dim = 5;  // every tensor now has the wrong size
    ParamStore P = micro_params(c, 1);
    try {
      kda_block_forward(P, layer_prefix(kLayer), c2, kLayer, x.data(), T, y.data(), nullptr);
      FAIL() << "no error";
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("self_attn."), std::string::npos) << e.what();
    }
  }
  {
    K3Config c3 = c;
    c3.kda_num_heads = 5;  // A_log has H + 2 = 4 entries < 5
    c3.kda_head_dim = 4;
    ParamStore P = micro_params(c, 1);
    try {
      kda_block_forward(P, layer_prefix(kLayer), c3, kLayer, x.data(), T, y.data(), nullptr);
      FAIL() << "no error";
    } catch (const k3::Error& e) {
      EXPECT_NE(std::string(e.what()).find("A_log"), std::string::npos) << e.what();
    }
  }
}
