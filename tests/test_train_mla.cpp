// Training forward/backward of the Gated MLA block (src/model/training/mla_block.h).
//  - Forward against the golden fixture: the inference model's normalised block input ("attn_in")
//    through mla_block_forward must reproduce the float64 reference's block output ("attn_out.L")
//    for every MLA layer.
//  - Backward against central finite differences in float64 on random micro configs (gated with
//    q_lora; q_proj without gate; no rot part), for dx and every entry of every parameter tensor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "core/error.h"
#include "model/config.h"
#include "model/model.h"
#include "model/params.h"
#include "model/training/mla_block.h"
#include "util/compare.h"
#include "util/finite_diff.h"
#include "util/fixture.h"

using namespace k3;
using k3::train::MlaBlockTape;
using k3::train::ParamStore;
using k3test::fixture;
using k3test::golden;
using k3test::golden_rows;
using k3test::tiny;

namespace {

TEST(TrainMla, ForwardMatchesGolden) {
  Model& m = tiny();
  const K3Config& c = m.config();
  std::map<int64_t, std::vector<float>> attn_in, attn_out;
  ForwardHooks hooks;
  hooks.tensor = [&](const char* name, int64_t l, const float* p, int64_t rows, int64_t cols) {
    if (std::string(name) == "attn_in") attn_in[l].assign(p, p + rows * cols);
    if (std::string(name) == "attn_out") attn_out[l].assign(p, p + rows * cols);
  };
  SequenceCache cache = m.new_cache();
  const auto ids = golden_rows("ids_a");
  m.forward({&cache}, ids, true, &hooks);
  const int64_t T = int64_t(ids[0].size()), D = c.hidden_size;

  const ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  int checked = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.layer_kind[size_t(l)] != AttnKind::MLA) continue;
    ASSERT_EQ(attn_in[l].size(), size_t(T * D)) << "attn_in." << l;
    std::vector<double> x(attn_in[l].begin(), attn_in[l].end()), y(static_cast<size_t>(T * D));
    MlaBlockTape tape;
    train::mla_block_forward(P, "language_model.model.layers." + std::to_string(l) + ".", c, l, x.data(), T, y.data(),
                             &tape);
    // Two comparisons, because the input is the fp32 inference model's, which has already drifted
    // from the float64 reference by the deeper layers (its own attn_out.7 is ~1.1e-5 from golden):
    //  - against the golden: 1e-5, or, where the inference block's own output is already further
    //    than that from the golden (input-limited), no more than 1e-6 beyond it;
    //  - against the inference block on the SAME input: 1e-6 (fp32 rounding of its output ~1e-7).
    const std::vector<float> ref = golden().read_f32("attn_out." + std::to_string(l));
    const double err = k3test::rel_l2(y, ref);
    const double inf_err = k3test::rel_l2(attn_out[l], ref);
    const double same_in = k3test::rel_l2(y, attn_out[l]);
    std::printf("attn_out.%lld (MLA): ours vs golden %.3e, inference vs golden %.3e, ours vs inference %.3e\n",
                static_cast<long long>(l), err, inf_err, same_in);
    EXPECT_LE(err, std::max(1e-5, inf_err + 1e-6)) << "layer " << l;
    EXPECT_LE(same_in, 1e-6) << "layer " << l;
    // Without a tape the output is the same.
    std::vector<double> y2(y.size());
    train::mla_block_forward(P, "language_model.model.layers." + std::to_string(l) + ".", c, l, x.data(), T, y2.data(),
                             nullptr);
    EXPECT_EQ(y, y2);
    ++checked;
  }
  EXPECT_GT(checked, 0) << "the fixture has no MLA layer";
}

TEST(TrainMla, RejectsNonMlaLayerAndBadShapes) {
  const K3Config& c = tiny().config();
  const ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  const int64_t T = 2;
  std::vector<double> x(static_cast<size_t>(T * c.hidden_size), 0.1), y(x.size());
  int64_t kda = -1;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l)
    if (c.layer_kind[size_t(l)] == AttnKind::KDA) kda = l;
  ASSERT_GE(kda, 0);
  EXPECT_THROW(train::mla_block_forward(P, "language_model.model.layers." + std::to_string(kda) + ".", c, kda, x.data(),
                                        T, y.data(), nullptr),
               k3::Error);
  // Wrong head dims for the stored tensors: the size check names the tensor.
  K3Config bad = c;
  bad.layer_kind.clear();
  bad.v_head_dim += 1;
  try {
    train::mla_block_forward(P, "language_model.model.layers.3.", bad, 3, x.data(), T, y.data(), nullptr);
    FAIL() << "no error";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("self_attn."), std::string::npos) << e.what();
  }
}

struct Micro {
  int64_t D, H, Dn, Dr, Dv, R, Qr;
  bool gated;
};

K3Config micro_config(const Micro& m) {
  K3Config c;
  c.source = "micro";
  c.hidden_size = m.D;
  c.num_attention_heads = m.H;
  c.qk_nope_head_dim = m.Dn;
  c.qk_rope_head_dim = m.Dr;
  c.v_head_dim = m.Dv;
  c.kv_lora_rank = m.R;
  c.q_lora_rank = m.Qr;
  c.mla_use_output_gate = m.gated;
  c.mla_norm_eps = 1e-6f;
  return c;
}

// Central-difference check of dx and of every entry of every parameter of the block.
void fd_check(const Micro& m, int64_t T, uint32_t seed) {
  const K3Config c = micro_config(m);
  const std::string pre = "language_model.model.layers.0.";
  const std::string a = pre + "self_attn.";
  ParamStore P;
  std::vector<std::string> names;
  auto add = [&](const std::string& n, std::vector<int64_t> shape) {
    P.add(a + n, shape);
    names.push_back(a + n);
  };
  if (m.Qr > 0) {
    add("q_a_proj.weight", {m.Qr, m.D});
    add("q_a_layernorm.weight", {m.Qr});
    add("q_b_proj.weight", {m.H * (m.Dn + m.Dr), m.Qr});
  } else {
    add("q_proj.weight", {m.H * (m.Dn + m.Dr), m.D});
  }
  add("kv_a_proj_with_mqa.weight", {m.R + m.Dr, m.D});
  add("kv_a_layernorm.weight", {m.R});
  add("kv_b_proj.weight", {m.H * (m.Dn + m.Dv), m.R});
  if (m.gated) add("g_proj.weight", {m.H * m.Dv, m.D});
  add("o_proj.weight", {m.D, m.H * m.Dv});

  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  for (const std::string& n : names) {
    double* v = P.p_mut(n);
    const bool norm = n.find("layernorm") != std::string::npos;
    const int64_t fan_in = P.shape(n).back();
    // Norm weights near 1 but not 1 (so their gradient matters); projections large enough that the
    // softmax is far from uniform and the gate far from 1/2.
    for (int64_t i = 0; i < P.numel(n); ++i)
      v[i] = norm ? 1.0 + 0.3 * nd(rng) : 1.5 * nd(rng) / std::sqrt(double(fan_in));
  }
  const size_t nx = static_cast<size_t>(T * m.D);
  std::vector<double> x(nx), Rw(nx), y(nx), dx(nx);
  for (double& v : x) v = nd(rng);
  for (double& v : Rw) v = nd(rng);

  auto loss = [&]() {
    train::mla_block_forward(P, pre, c, 0, x.data(), T, y.data(), nullptr);
    double s = 0;
    for (size_t i = 0; i < nx; ++i) s += y[i] * Rw[i];
    return s;
  };

  MlaBlockTape tape;
  train::mla_block_forward(P, pre, c, 0, x.data(), T, y.data(), &tape);
  P.zero_grads();
  std::fill(dx.begin(), dx.end(), 12345.0);  // must be overwritten, not accumulated
  train::mla_block_backward(P, pre, c, 0, tape, Rw.data(), dx.data());

  const double eps = 1e-6;
  auto close = [](double got, double fd) { return std::abs(got - fd) <= 1e-7 + 1e-5 * std::abs(fd); };
  double worst = 0;
  auto note = [&](double got, double fd) {
    worst = std::max(worst, std::abs(got - fd) / (1e-7 + 1e-5 * std::abs(fd)));
  };

  for (size_t i = 0; i < nx; ++i) {
    const double fd = k3test::central_difference(&x[i], loss, eps);
    note(dx[i], fd);
    EXPECT_TRUE(close(dx[i], fd)) << "dx[" << i << "] " << dx[i] << " vs fd " << fd;
  }
  for (const std::string& n : names) {
    double* v = P.p_mut(n);
    const double* g = P.g(n);
    double gnorm = 0;
    for (int64_t i = 0; i < P.numel(n); ++i) {
      const double fd = k3test::central_difference(&v[i], loss, eps);
      gnorm += fd * fd;
      note(g[i], fd);
      EXPECT_TRUE(close(g[i], fd)) << n << "[" << i << "] " << g[i] << " vs fd " << fd;
    }
    EXPECT_GT(gnorm, 1e-6) << n << ": gradient is ~0, the check would be vacuous";
  }
  std::printf("FD check (Qr=%lld, Dr=%lld, gated=%d): worst |err| / (1e-7 + 1e-5|fd|) = %.3f\n",
              static_cast<long long>(m.Qr), static_cast<long long>(m.Dr), int(m.gated), worst);

  // Gradients accumulate: a second backward doubles every parameter gradient.
  std::vector<double> g1 = P.grads();
  train::mla_block_backward(P, pre, c, 0, tape, Rw.data(), dx.data());
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_NEAR(P.grads()[i], 2 * g1[i], 1e-12 * (1 + std::abs(g1[i])));
}

TEST(TrainMla, BackwardFiniteDifferencesGatedQLora) { fd_check({8, 2, 3, 2, 3, 4, 5, true}, 6, 1); }
TEST(TrainMla, BackwardFiniteDifferencesQProjUngated) { fd_check({7, 3, 2, 3, 2, 3, 0, false}, 5, 2); }
TEST(TrainMla, BackwardFiniteDifferencesNoRotPart) { fd_check({6, 2, 3, 0, 2, 3, 4, true}, 7, 3); }

}  // namespace
