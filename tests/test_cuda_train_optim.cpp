// The GPU optimizers, gradient clipping and router-bias balancing (train/optimizer_cuda.h,
// train/quantile_balance_cuda.h) against their float64 CPU twins (train/optimizer.h,
// train/quantile_balance.h) on the same fp32-representable inputs. Every test skips without a Hopper GPU.
//
// Tolerances:
//   - Parameters after 3 steps, relative L2: 1e-5 with fp32 Newton–Schulz (the brief's bound; the GPU
//     rounds weights and state to fp32 each step, 2^-24, and its fp32 GEMMs differ from float64 at
//     ~1e-7·sqrt(K), amplified by at most a few hundred through five quintic steps), 1e-2 with bf16
//     Newton–Schulz operands. Because weights dominate that norm, the updates (W_t − W_0) are checked
//     too: AdamW tensors 1e-5 (elementwise double math, fp32 storage only: ~2e-6), Muon tensors 1e-4
//     with fp32 Newton–Schulz (a host emulation of fp32 NS on these shapes is ~1e-6 off float64; the
//     fp32 weights add ~6e-6 relative to these small updates) and 0.15 with bf16 operands (2^-9 per
//     operand, amplified by the quintic: 0.02–0.05 in the same emulation); a wrong formula is O(1) off.
//   - Optimizer state after GPU steps vs the CPU's: 1e-6 (fp32 storage of sums of fp32 gradients).
//   - Clipping: the norm 1e-6 relative (a double sum of exact squares: ~1e-15 in fact); clipped grads
//     1e-6 relative L2 (one fp32 rounding of the double product).
//   - Balancer: loads and MaxVio exactly equal (same double ranking); bias within 1e-9 absolute: the
//     GPU does the CPU's double arithmetic except the centring's sum (compensated double vs long
//     double) and FMA contraction, ~1e-17; a wrong rank or bin would be off by a gap between order
//     statistics or a bin width (>= 1e-4 here). The sign rule is compared bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "core/cuda.h"
#include "core/error.h"
#include "kernels/gemm/linear_cuda.h"
#include "train/optimizer.h"
#include "train/optimizer_cuda.h"
#include "train/quantile_balance.h"
#include "train/quantile_balance_cuda.h"
#include "util/compare.h"
#include "util/random.h"

namespace {

namespace kc = k3::cuda;
using namespace k3::train;

// ---------------------------------------------------------------------------------------------------
// Optimizer

const std::string kQ = "model.layers.0.self_attn.q_proj.weight";
const std::string kK = "model.layers.0.self_attn.k_proj.weight";
const std::string kV = "model.layers.0.self_attn.v_proj.weight";
const std::string kRouter = "model.layers.1.block_sparse_moe.gate.weight";
const std::string kZeroAtFirst = "model.layers.2.mlp.down_proj.weight";  // zero gradient at step 0

// Tensors that exercise every path: AdamW with and without decay, a frozen tensor, Per-Head Muon with
// wide (5x12) and tall (8x7) head blocks, two same-shape tensors batched together (q and v; two
// experts), tall and wide whole matrices, the router's lr scale, a larger matrix, and a Muon tensor
// whose first gradient (hence momentum) is exactly zero.
ParamStore make_store() {
  ParamStore P;
  P.add("model.embed_tokens.weight", {11, 12});
  P.add("model.layers.0.input_layernorm.weight", {12});
  P.add(kQ, {20, 12});
  P.add(kK, {24, 7});
  P.add(kV, {20, 12});
  P.add(kRouter, {8, 12});
  P.add("model.layers.1.block_sparse_moe.gate.e_score_correction_bias", {8});
  P.add("model.layers.1.block_sparse_moe.experts.0.w1.weight", {16, 12});
  P.add("model.layers.1.block_sparse_moe.experts.1.w1.weight", {16, 12});
  P.add("model.layers.1.block_sparse_moe.experts.0.w2.weight", {12, 16});
  P.add("model.layers.1.mlp.up_proj.weight", {33, 20});
  P.add("model.layers.2.self_attn.o_proj.weight", {96, 64});
  P.add(kZeroAtFirst, {6, 9});
  const std::vector<double> r = k3test::randn(int64_t(P.values().size()), 11);
  for (size_t i = 0; i < r.size(); ++i) P.values()[i] = double(float(0.5 * r[i]));  // fp32-representable
  return P;
}

const std::map<std::string, int64_t> kSplits = {{kQ, 4}, {kK, 3}, {kV, 4}};
const double kLr[3] = {0.02, 0.015, 0.01};

// Step s's gradients (fp32-representable), the same on both sides.
std::vector<double> grads_at(const ParamStore& P, int s) {
  std::vector<double> g = k3test::randn(int64_t(P.grads().size()), 100 + uint64_t(s));
  for (double& x : g) x = double(float(x));
  if (s == 0) {
    const int64_t o = P.offset(kZeroAtFirst);
    std::fill(g.begin() + o, g.begin() + o + P.numel(kZeroAtFirst), 0.0);
  }
  return g;
}

std::vector<float> to_f(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
std::vector<double> to_d(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// ‖a − b‖/‖b‖ over the elements where mask is true (+inf on a non-finite value).
double rel_l2_masked(const std::vector<double>& a, const std::vector<double>& b, const std::vector<bool>& mask) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!mask[i]) continue;
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}
double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  return rel_l2_masked(a, b, std::vector<bool>(a.size(), true));
}

// Element masks of P's AdamW and Muon tensors under `opt`'s plan.
std::vector<bool> group_mask(const ParamStore& P, const Optimizer& opt, ParamGroup g) {
  std::vector<bool> m(P.values().size(), false);
  for (const ParamPlan& pl : opt.plan())
    if (pl.group == g)
      for (int64_t i = 0; i < pl.numel; ++i) m[size_t(P.offset(pl.name) + i)] = true;
  return m;
}

// The GPU side of a run: device mirrors of P's values and gradients.
struct DeviceParams {
  kc::DeviceBuffer<float> w, g;
  explicit DeviceParams(const ParamStore& P) : w(to_f(P.values()).data(), P.values().size()), g(P.grads().size()) {}
  void set_grads(const std::vector<double>& gr) { g.upload(to_f(gr).data(), gr.size()); }
  std::vector<double> values() const {
    std::vector<float> f(w.size());
    w.download(f.data(), f.size());
    return to_d(f);
  }
};

// CPU steps [from, to) on P with opt.
void cpu_steps(ParamStore& P, Optimizer& opt, int from, int to) {
  for (int s = from; s < to; ++s) {
    P.grads() = grads_at(P, s);
    opt.step(P, kLr[s]);
  }
}
void gpu_steps(DeviceParams& D, const ParamStore& P, CudaOptimizer& opt, int from, int to) {
  for (int s = from; s < to; ++s) {
    D.set_grads(grads_at(P, s));
    opt.step(kLr[s]);
  }
}

struct OptCase {
  const char* name;
  OptimizerConfig cfg;
};
std::vector<OptCase> opt_cases() {
  OptimizerConfig a;  // K3's defaults: decay 0.1, Nesterov, Moonlight's RMS matching
  a.router_lr_scale = 0.5;
  OptimizerConfig b;  // no decay, plain momentum, shape-ratio scale
  b.weight_decay = 0.0;
  b.nesterov = false;
  b.muon_scale = MuonScale::ShapeRatio;
  b.beta2 = 0.99;
  OptimizerConfig c;  // vectors decayed too, another router scale, 4 NS steps
  c.weight_decay = 0.05;
  c.decay_vectors = true;
  c.router_lr_scale = 0.25;
  c.ns_steps = 4;
  return {{"defaults+router0.5", a}, {"nodecay+plain+shape", b}, {"decayvectors+router0.25+ns4", c}};
}

TEST(CudaTrainOptim, StepsMatchCpuOptimizer) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  for (const OptCase& oc : opt_cases()) {
    ParamStore P = make_store();
    const std::vector<double> w0 = P.values();
    Optimizer cpu(P, oc.cfg, kSplits);
    ASSERT_EQ(cpu.plan_of(kQ).heads, 4);
    ASSERT_EQ(cpu.plan_of(kK).group, ParamGroup::Muon);
    ASSERT_EQ(cpu.plan_of("model.layers.0.input_layernorm.weight").group, ParamGroup::AdamW);
    ASSERT_EQ(cpu.plan_of("model.layers.1.block_sparse_moe.gate.e_score_correction_bias").group, ParamGroup::Frozen);
    ASSERT_EQ(cpu.plan_of(kZeroAtFirst).group, ParamGroup::Muon);
    const std::vector<bool> adam = group_mask(P, cpu, ParamGroup::AdamW), muon = group_mask(P, cpu, ParamGroup::Muon);
    cpu_steps(P, cpu, 0, 3);
    const std::vector<double>& want = P.values();
    std::vector<double> dw(want.size());
    for (size_t i = 0; i < want.size(); ++i) dw[i] = want[i] - w0[i];

    for (bool bf16 : {false, true}) {
      ParamStore Q = make_store();
      const Optimizer plan(Q, oc.cfg, kSplits);
      DeviceParams D(Q);
      CudaOptimizer gpu(plan, Q, D.w.data(), D.g.data(), ctx, bf16);
      gpu_steps(D, Q, gpu, 0, 3);
      EXPECT_EQ(gpu.steps_taken(), 3);
      const std::vector<double> got = D.values();
      std::vector<double> gw(got.size());
      for (size_t i = 0; i < got.size(); ++i) gw[i] = got[i] - w0[i];
      const double e_all = rel_l2(got, want), e_adam = rel_l2_masked(gw, dw, adam),
                   e_muon = rel_l2_masked(gw, dw, muon);
      std::printf("%s, NS %s: params %.3g, AdamW updates %.3g, Muon updates %.3g\n", oc.name, bf16 ? "bf16" : "fp32",
                  e_all, e_adam, e_muon);
      EXPECT_LE(e_all, bf16 ? 1e-2 : 1e-5) << oc.name;
      EXPECT_LE(e_adam, 1e-5) << oc.name;
      EXPECT_LE(e_muon, bf16 ? 0.15 : 1e-4) << oc.name;
      // Frozen tensors do not move.
      const int64_t fo = P.offset("model.layers.1.block_sparse_moe.gate.e_score_correction_bias");
      for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(got[size_t(fo + i)], w0[size_t(fo + i)]);
    }
  }
}

TEST(CudaTrainOptim, StepsAreDeterministic) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  for (bool bf16 : {false, true}) {
    std::vector<double> runs[2];
    for (auto& r : runs) {
      ParamStore P = make_store();
      const Optimizer plan(P, OptimizerConfig{}, kSplits);
      DeviceParams D(P);
      CudaOptimizer gpu(plan, P, D.w.data(), D.g.data(), ctx, bf16);
      gpu_steps(D, P, gpu, 0, 3);
      r = D.values();
    }
    EXPECT_EQ(0, std::memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(double))) << "bf16 " << bf16;
  }
}

// GPU steps -> save -> CPU resumes, and CPU steps -> save -> GPU resumes: both end where an all-CPU run does.
TEST(CudaTrainOptim, StateMovesBetweenCpuAndGpu) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  OptimizerConfig cfg;
  cfg.router_lr_scale = 0.5;
  ParamStore A = make_store();
  Optimizer all_cpu(A, cfg, kSplits);
  cpu_steps(A, all_cpu, 0, 2);
  const OptimizerState cpu_state = all_cpu.save_state();
  const std::vector<double> cpu_values_2 = A.values();
  cpu_steps(A, all_cpu, 2, 3);
  const std::vector<double>& want = A.values();

  // GPU 2 steps, then the CPU.
  {
    ParamStore P = make_store();
    const Optimizer plan(P, cfg, kSplits);
    DeviceParams D(P);
    CudaOptimizer gpu(plan, P, D.w.data(), D.g.data(), ctx, false);
    gpu_steps(D, P, gpu, 0, 2);
    const OptimizerState st = gpu.save_state();
    // The header is the CPU's, word for word; the data its layout, to fp32 storage.
    EXPECT_EQ(st.header.dump(), cpu_state.header.dump());
    ASSERT_EQ(st.data.size(), cpu_state.data.size());
    EXPECT_LE(rel_l2(st.data, cpu_state.data), 1e-6);
    // Through the JSON text, as a checkpoint does.
    ParamStore R = make_store();
    R.values() = D.values();
    Optimizer resumed(R, cfg, kSplits);
    resumed.load_state(OptimizerState{nlohmann::json::parse(st.header.dump()), st.data});
    EXPECT_EQ(resumed.steps_taken(), 2);
    cpu_steps(R, resumed, 2, 3);
    EXPECT_LE(rel_l2(R.values(), want), 1e-5);

    // GPU save -> GPU load round-trips exactly (fp32 values widened and narrowed back).
    DeviceParams D2(P);
    CudaOptimizer again(plan, P, D2.w.data(), D2.g.data(), ctx, false);
    again.load_state(st);
    EXPECT_EQ(again.steps_taken(), 2);
    EXPECT_EQ(again.save_state().data, st.data);

    // Refused: a wrong data size, another plan's state.
    OptimizerState bad = st;
    bad.data.pop_back();
    EXPECT_THROW(again.load_state(bad), k3::Error);
    const Optimizer no_split(P, cfg);
    EXPECT_THROW(again.load_state(no_split.save_state()), k3::Error);
    OptimizerState wrong_format = st;
    wrong_format.header["format"] = "k3-optimizer-v0";
    EXPECT_THROW(again.load_state(wrong_format), k3::Error);
  }
  // CPU 2 steps, then the GPU.
  {
    ParamStore P = make_store();
    P.values() = cpu_values_2;
    const Optimizer plan(P, cfg, kSplits);
    DeviceParams D(P);
    CudaOptimizer gpu(plan, P, D.w.data(), D.g.data(), ctx, false);
    gpu.load_state(OptimizerState{nlohmann::json::parse(cpu_state.header.dump()), cpu_state.data});
    EXPECT_EQ(gpu.steps_taken(), 2);
    gpu_steps(D, P, gpu, 2, 3);
    EXPECT_LE(rel_l2(D.values(), want), 1e-5);
  }
}

TEST(CudaTrainOptim, RejectsAPlanOfAnotherStore) {
  K3_REQUIRE_GPU();
  k3::gemm::cuda::GemmContext ctx;
  ParamStore P = make_store();
  const Optimizer plan(P, OptimizerConfig{}, kSplits);
  ParamStore other;
  other.add("model.embed_tokens.weight", {11, 12});
  DeviceParams D(P);
  EXPECT_THROW(CudaOptimizer(plan, other, D.w.data(), D.g.data(), ctx, false), k3::Error);
  ParamStore resized;
  for (const std::string& n : P.names()) resized.add(n, n == kRouter ? std::vector<int64_t>{4, 12} : P.shape(n));
  EXPECT_THROW(CudaOptimizer(plan, resized, D.w.data(), D.g.data(), ctx, false), k3::Error);
}

// ---------------------------------------------------------------------------------------------------
// Gradient clipping

struct ClipResult {
  double norm = 0;
  int64_t nonfinite = -1;
  std::vector<float> g;
};

ClipResult clip_on_gpu(const std::vector<float>& g, double max_norm) {
  const int64_t n = int64_t(g.size());
  kc::DeviceBuffer<float> dg(n > 0 ? g.data() : nullptr, g.size());
  kc::DeviceBuffer<double> dn(1);
  kc::DeviceBuffer<int64_t> db(1);
  kc::DeviceBuffer<uint8_t> ws(clip_grad_norm_workspace_bytes(n));
  clip_grad_norm_cuda(dg.data(), n, max_norm, dn.data(), db.data(), ws.data());
  ClipResult r;
  r.g.resize(g.size());
  if (n > 0) dg.download(r.g.data(), r.g.size());
  dn.download(&r.norm, 1);
  db.download(&r.nonfinite, 1);
  return r;
}

// The CPU's clip_grad_norm on the same values (as doubles): the norm and the clipped gradients.
double clip_on_cpu(const std::vector<float>& g, double max_norm, std::vector<double>* out) {
  ParamStore P;
  P.add("g", {int64_t(g.size())});
  P.grads().assign(g.begin(), g.end());
  const double norm = clip_grad_norm(P, max_norm);
  *out = P.grads();
  return norm;
}

std::vector<float> rand_grads(int64_t n, uint64_t seed) {
  const std::vector<double> d = k3test::randn(n, seed);
  return std::vector<float>(d.begin(), d.end());
}

TEST(CudaTrainOptim, ClipMatchesCpu) {
  K3_REQUIRE_GPU();
  // Sizes: one element, a partial chunk, several chunks with a ragged end, many chunks.
  for (int64_t n : {int64_t(1), int64_t(5), int64_t(3 * 8192 + 17), int64_t(1000003)}) {
    const std::vector<float> g = rand_grads(n, 7 + uint64_t(n));
    std::vector<double> ref;
    const double norm = clip_on_cpu(g, 0.0, &ref);
    for (double max_norm : {0.0, 0.5 * norm, 2.0 * norm}) {
      const double cpu_norm = clip_on_cpu(g, max_norm, &ref);
      const ClipResult r = clip_on_gpu(g, max_norm);
      EXPECT_NEAR(r.norm, cpu_norm, 1e-6 * cpu_norm) << "n " << n << " max " << max_norm;
      EXPECT_EQ(r.nonfinite, 0);
      EXPECT_LE(k3test::rel_l2(ref.data(), r.g.data(), ref.size()), 1e-6) << "n " << n << " max " << max_norm;
      if (!(max_norm > 0 && norm > max_norm)) {
        EXPECT_EQ(r.g, g) << "not clipped: untouched";
      }
      // Deterministic: the same bits again.
      const ClipResult r2 = clip_on_gpu(g, max_norm);
      EXPECT_EQ(std::memcmp(&r.norm, &r2.norm, sizeof(double)), 0);
      EXPECT_EQ(r.g, r2.g);
    }
  }
  const ClipResult empty = clip_on_gpu({}, 1.0);
  EXPECT_EQ(empty.norm, 0.0);
  EXPECT_EQ(empty.nonfinite, 0);
}

TEST(CudaTrainOptim, ClipCountsNonFinite) {
  K3_REQUIRE_GPU();
  const int64_t n = 100003;
  std::vector<float> g = rand_grads(n, 3);
  // ±Inf only: the norm is Inf, every gradient is scaled by 0 (Inf·0 = NaN), as on the CPU.
  g[1000] = INFINITY;
  g[size_t(n - 1)] = -INFINITY;
  {
    std::vector<double> ref;
    const double cpu_norm = clip_on_cpu(g, 1.0, &ref);
    const ClipResult r = clip_on_gpu(g, 1.0);
    EXPECT_TRUE(std::isinf(cpu_norm));
    EXPECT_TRUE(std::isinf(r.norm));
    EXPECT_EQ(r.nonfinite, 2);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::isnan(r.g[size_t(i)]), std::isnan(ref[size_t(i)])) << i;
      if (!std::isnan(ref[size_t(i)])) {
        ASSERT_EQ(double(r.g[size_t(i)]), ref[size_t(i)]) << i;
      }
    }
  }
  // A NaN too: the norm is NaN, nothing is scaled.
  g[7] = NAN;
  const ClipResult r = clip_on_gpu(g, 1.0);
  EXPECT_TRUE(std::isnan(r.norm));
  EXPECT_EQ(r.nonfinite, 3);
  for (int64_t i = 0; i < n; ++i) {
    if (i != 7) {
      ASSERT_EQ(r.g[size_t(i)], g[size_t(i)]) << i;
    }
  }
  EXPECT_TRUE(std::isnan(r.g[7]));
}

// ---------------------------------------------------------------------------------------------------
// Quantile Balancing

// Sigmoid scores with a per-expert popularity skew, rounded to float: [steps·N, E].
std::vector<float> skewed_scores(int64_t N, int64_t E, uint64_t seed) {
  const std::vector<double> z = k3test::randn(N * E + E, seed);
  std::vector<float> s(size_t(N * E));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t e = 0; e < E; ++e)
      s[size_t(i * E + e)] = float(1.0 / (1.0 + std::exp(-(z[size_t(E + i * E + e)] + 0.6 * z[size_t(e)]))));
  return s;
}

std::vector<double> initial_bias(int64_t E) {
  std::vector<double> b(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) b[size_t(e)] = 0.05 * std::sin(double(e));
  return b;
}

// Runs CPU and GPU balancers over `steps`, each step the forwards `chunks` (token counts), and compares
// loads, MaxVio and the bias after every step.
void compare_balancers(QuantileBalancer& cpu, CudaQuantileBalancer& gpu, const std::vector<std::vector<int64_t>>& steps,
                       uint64_t seed, const std::string& what) {
  const int64_t E = cpu.num_experts();
  int64_t total = 0;
  for (const auto& st : steps)
    for (int64_t c : st) total += c;
  const std::vector<float> s = skewed_scores(total, E, seed);
  const std::vector<double> sd(s.begin(), s.end());
  kc::DeviceBuffer<float> ds(s.data(), s.size());
  int64_t at = 0;
  for (size_t step = 0; step < steps.size(); ++step) {
    for (int64_t c : steps[step]) {
      cpu.accumulate(sd.data() + at * E, c);
      gpu.accumulate(ds.data() + at * E, c);
      at += c;
    }
    EXPECT_EQ(gpu.pending_tokens(), cpu.pending_tokens());
    const BalanceStepStats& st = cpu.finish_step();
    gpu.finish_step();
    EXPECT_EQ(gpu.last_loads(), st.loads) << what << " step " << step;
    EXPECT_EQ(gpu.last_max_vio(), st.max_vio) << what << " step " << step;
    const std::vector<double> gb = gpu.bias();
    std::vector<float> gf(static_cast<size_t>(E));
    kc::copy_to_host(gf.data(), gpu.bias_device(), size_t(E) * sizeof(float));
    double worst = 0;
    for (int64_t e = 0; e < E; ++e) {
      worst = std::max(worst, std::abs(gb[size_t(e)] - cpu.bias()[size_t(e)]));
      if (cpu.options().method == BalanceMethod::Sign || cpu.options().method == BalanceMethod::None) {
        EXPECT_EQ(gb[size_t(e)], cpu.bias()[size_t(e)]) << what << " step " << step << " expert " << e;
      }
      EXPECT_EQ(gf[size_t(e)], float(gb[size_t(e)])) << "the routing copy";
    }
    EXPECT_LE(worst, 1e-9) << what << " step " << step;
    EXPECT_EQ(gpu.steps(), cpu.steps());
  }
}

TEST(CudaTrainOptim, BalancerMatchesCpu) {
  K3_REQUIRE_GPU();
  struct Case {
    const char* name;
    int64_t E, K;
    BalanceOptions opt;
    std::vector<std::vector<int64_t>> steps;
  };
  BalanceOptions exact, ema, hist, fine_hist, sign, none;
  exact.method = BalanceMethod::QuantileExact;
  ema.method = BalanceMethod::QuantileExact;
  ema.ema_decay = 0.3;
  hist.method = BalanceMethod::QuantileHistogram;
  hist.num_bins = 1000;
  fine_hist.method = BalanceMethod::QuantileHistogram;
  fine_hist.num_bins = 100000;
  sign.method = BalanceMethod::Sign;
  sign.sign_rate = 0.01;
  none.method = BalanceMethod::None;
  // m·k/n integer: 64·3/16 = 12 and 96·3/16 = 18; fractional: 88·3/16 = 16.5, 1501·6/64 = 140.72.
  const std::vector<Case> cases = {
      {"exact, integer q", 16, 3, exact, {{40, 24}, {1, 63}, {96}}},
      {"exact, fractional q", 16, 3, exact, {{37, 1, 50}, {88}, {20, 20, 20, 28}}},
      {"exact, 64 experts", 64, 6, exact, {{500, 1, 1000}, {1501}, {700, 801}}},
      {"exact + EMA", 16, 2, ema, {{37, 1, 50}, {64}, {90}}},
      {"histogram", 64, 6, hist, {{500, 1, 1000}, {1501}, {700, 801}}},
      {"histogram, fine bins", 16, 3, fine_hist, {{37, 1, 50}, {64}, {90}}},
      {"sign", 16, 3, sign, {{37, 1, 50}, {64}, {90}}},
      {"none", 16, 3, none, {{37, 1, 50}, {64}}},
  };
  uint64_t seed = 40;
  for (const Case& c : cases) {
    QuantileBalancer cpu(c.E, c.K, c.opt, initial_bias(c.E));
    CudaQuantileBalancer gpu(c.E, c.K, c.opt, initial_bias(c.E));
    compare_balancers(cpu, gpu, c.steps, seed++, c.name);
  }
  // An empty step keeps the bias, MaxVio 0.
  CudaQuantileBalancer e(8, 2, exact, initial_bias(8));
  e.finish_step();
  EXPECT_EQ(e.bias(), initial_bias(8));
  EXPECT_EQ(e.last_max_vio(), 0.0);
  EXPECT_EQ(e.steps(), 1);
}

TEST(CudaTrainOptim, BalancerStateMovesBetweenCpuAndGpu) {
  K3_REQUIRE_GPU();
  for (BalanceMethod m : {BalanceMethod::QuantileExact, BalanceMethod::QuantileHistogram, BalanceMethod::Sign}) {
    BalanceOptions o;
    o.method = m;
    o.num_bins = 333;
    o.sign_rate = 0.003;
    const int64_t E = 32, K = 4;
    // GPU two steps -> JSON -> CPU, then one more step on both.
    QuantileBalancer cpu(E, K, o);
    CudaQuantileBalancer gpu(E, K, o, {});
    compare_balancers(cpu, gpu, {{300, 200}, {500}}, 90, balance_method_name(m));
    const std::string text = gpu.to_json().dump();
    QuantileBalancer from_gpu = QuantileBalancer::from_json(nlohmann::json::parse(text));
    EXPECT_EQ(from_gpu.bias(), gpu.bias());  // bit-exact through the JSON text
    EXPECT_EQ(from_gpu.steps(), 2);
    EXPECT_EQ(from_gpu.to_json().dump(), text);
    CudaQuantileBalancer gpu2 = CudaQuantileBalancer::from_json(nlohmann::json::parse(text));
    compare_balancers(from_gpu, gpu2, {{400}}, 91, std::string(balance_method_name(m)) + " after GPU->CPU");
    // CPU -> JSON -> GPU.
    const std::string ctext = cpu.to_json().dump();
    CudaQuantileBalancer from_cpu = CudaQuantileBalancer::from_json(nlohmann::json::parse(ctext));
    EXPECT_EQ(from_cpu.bias(), cpu.bias());
    EXPECT_EQ(from_cpu.steps(), cpu.steps());
    EXPECT_EQ(from_cpu.options().method, m);
    EXPECT_EQ(from_cpu.options().num_bins, 333);
    EXPECT_EQ(from_cpu.to_json().dump(), ctext);
    compare_balancers(cpu, from_cpu, {{123, 277}}, 92, std::string(balance_method_name(m)) + " after CPU->GPU");
    // Mid-step checkpoints are refused.
    kc::DeviceBuffer<float> s(skewed_scores(10, E, 5).data(), size_t(10 * E));
    from_cpu.accumulate(s.data(), 10);
    EXPECT_THROW(from_cpu.to_json(), k3::Error);
  }
  EXPECT_THROW(CudaQuantileBalancer::from_json(nlohmann::json{{"format", "k3-quantile-balancer-v1"}}), k3::Error);
}

TEST(CudaTrainOptim, BalancerRejectsBadArguments) {
  K3_REQUIRE_GPU();
  EXPECT_THROW(CudaQuantileBalancer(4, 4, {}, {}), k3::Error);
  EXPECT_THROW(CudaQuantileBalancer(4, 0, {}, {}), k3::Error);
  EXPECT_THROW(CudaQuantileBalancer(4, 1, {}, {0.0, 0.0}), k3::Error);
  EXPECT_THROW(CudaQuantileBalancer(200, 100, {}, {}), k3::Error);  // above kMaxTopK
  CudaQuantileBalancer ok(4, 1, {}, {});
  EXPECT_THROW(ok.accumulate(nullptr, 3), k3::Error);
  EXPECT_THROW(ok.accumulate(nullptr, -1), k3::Error);
}

}  // namespace

#else  // no CUDA backend in this build: nothing to link against

TEST(CudaTrainOptim, NeedsTheCudaBackend) { GTEST_SKIP() << "this build has no CUDA backend"; }

#endif
