// The KDA block's fp32 training ops on the GPU (src/kernels/kda/kda_train_ops_cuda.h) against their float64
// twins (src/kernels/kda/kda_f64.h; the sigmoid against 1/(1 + e^-x) in double, as the block computes beta),
// forward and backward. The GPU tests skip without a Hopper GPU; the argument checks run anywhere.
//
// Sizes: H = 3 heads of D = 32, 64 and 128; rows packed from sequences of lengths {1, 5, 17, 40} (63 rows;
// the conv also gets a batch with an empty sequence), conv taps K = 4 (K3) and 2. The twins see the same
// fp32 inputs (widened), and a backward's saved activations (pre, inv, out, beta) are the twin's forward
// results rounded to fp32 on both sides, so an error measures the kernel. Bound: relative L2 <= 1e-5
// (util/compare.h; a non-finite value fails first). Outputs that are OVERWRITTEN start as NaN (an element
// left unwritten fails); parameter gradients start from a random non-zero buffer and are checked both as
// the accumulated value and as the increment (so "=" instead of "+=" fails).
//
// The bf16 forms (the tensor-core recurrence's side) against the fp32 forms, bitwise: a bf16 output is the bf16
// rounding of the fp32 form's output on the same input (so both forms run the one fp32 formula), and a backward
// fed bf16-representable values, as bf16 bits to the one and as fp32 to the other, gives the fp32 form's bits.
// The fp32 results are also checked against the twins at 1e-5, the bf16 outputs at bf16's rounding (2^-8).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/kda/kda_f64.h"
#include "kernels/kda/kda_train_ops_cuda.h"
#include "util/compare.h"
#include "util/error_of.h"
#include "util/random.h"

namespace {

namespace kc = k3::kda::cuda;
using k3::cuda::DeviceBuffer;
using Vec = std::vector<float>;
using DVec = std::vector<double>;
using Bits = std::vector<uint16_t>;  // bf16 values

constexpr double kTol = 1e-5;
// A bf16 output against the twin: one rounding to nearest is <= 2^-9 relative per element, plus the fp32 error.
constexpr double kBf16Tol = 1.0 / 256;
constexpr int64_t kH = 3;
constexpr int64_t kHeadDims[] = {32, 64, 128};
const std::vector<int> kLens = {1, 5, 17, 40};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

Vec randf(size_t n, uint64_t seed, double sd = 1.0) {
  const DVec d = k3test::randn(int64_t(n), seed);
  Vec v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float(sd * d[i]);
  return v;
}
DVec zeros(int64_t n) { return DVec(static_cast<size_t>(n), 0.0); }
DVec widen(const Vec& v) { return DVec(v.begin(), v.end()); }
Vec narrow(const DVec& v) { return Vec(v.begin(), v.end()); }
DeviceBuffer<float> up(const Vec& v) { return DeviceBuffer<float>(v.data(), v.size()); }
DeviceBuffer<float> nan_buffer(size_t n) { return up(Vec(n, kNaN)); }
Vec down(const DeviceBuffer<float>& d) {
  Vec h(d.size());
  d.download(h.data(), h.size());
  return h;
}
// bf16: the bits of each value (rounded to nearest even), the values of bits, a copy rounded to bf16.
Bits to_bf16(const Vec& v) {
  Bits b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = k3::f32_to_bf16(v[i]);
  return b;
}
Vec from_bf16(const Bits& b) {
  Vec v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = k3::bf16_to_f32(b[i]);
  return v;
}
Vec bf16_values(Vec v) {
  k3::round_to_bf16(v.data(), int64_t(v.size()));
  return v;
}
DeviceBuffer<uint16_t> up(const Bits& b) { return DeviceBuffer<uint16_t>(b.data(), b.size()); }
DeviceBuffer<uint16_t> nan_bits(size_t n) { return up(Bits(n, uint16_t(0xffff))); }  // a bf16 NaN
Bits down(const DeviceBuffer<uint16_t>& d) {
  Bits h(d.size());
  d.download(h.data(), h.size());
  return h;
}
DeviceBuffer<unsigned char> workspace(size_t bytes) { return DeviceBuffer<unsigned char>(bytes > 0 ? bytes : 1); }

// ||got - ref|| / ||ref|| (ref rounded to fp32: 6e-8 relative, far below the bound).
double rel(const Vec& got, const DVec& ref) { return k3test::rel_l2(got, narrow(ref)); }
// Same for the increment of an accumulated gradient: (got - start) against (ref - start), in double.
double rel_increment(const Vec& got, const DVec& ref, const Vec& start) {
  DVec inc_got(got.size());
  Vec inc_ref(ref.size());
  for (size_t i = 0; i < got.size(); ++i) inc_got[i] = double(got[i]) - double(start[i]);
  for (size_t i = 0; i < ref.size(); ++i) inc_ref[i] = float(ref[i] - double(start[i]));
  if (inc_got.size() != inc_ref.size()) return INFINITY;
  return k3test::rel_l2(inc_got.data(), inc_ref.data(), inc_got.size());
}
bool same_bits(const Vec& a, const Vec& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}
#define EXPECT_ACCUMULATED(got, ref, start, what)                       \
  do {                                                                  \
    EXPECT_LE(rel(got, ref), kTol) << what;                             \
    EXPECT_LE(rel_increment(got, ref, start), kTol) << what << " (+=)"; \
  } while (0)

std::vector<int32_t> cu_of(const std::vector<int>& lens) {
  std::vector<int32_t> cu{0};
  for (int L : lens) cu.push_back(cu.back() + L);
  return cu;
}

// ---- conv + SiLU -------------------------------------------------------------------------------------------
struct ConvResult {
  Vec pre, act, d_in, dw;
};

// The twin, one sequence at a time (each starts from zero history); the backward takes the forward's pre
// rounded to fp32 (pre_f, what the GPU backward is given).
struct ConvTwin {
  DVec pre, act, d_in, dw;
  Vec pre_f;
};
ConvTwin conv_twin(const Vec& in, const Vec& w, const Vec& d_act, const Vec& dw0, int64_t C, int K,
                   const std::vector<int32_t>& cu) {
  const int64_t rows = cu.back();
  const DVec in_d = widen(in), w_d = widen(w), d_act_d = widen(d_act);
  ConvTwin t{zeros(rows * C), zeros(rows * C), zeros(rows * C), widen(dw0), {}};
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t off = int64_t(cu[b]) * C, T = cu[b + 1] - cu[b];
    k3::kda::conv_silu_forward(t.pre.data() + off, t.act.data() + off, in_d.data() + off, T, C, w_d.data(), K);
  }
  t.pre_f = narrow(t.pre);
  const DVec pre_fd = widen(t.pre_f);
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t off = int64_t(cu[b]) * C, T = cu[b + 1] - cu[b];
    k3::kda::conv_silu_backward(t.d_in.data() + off, t.dw.data(), d_act_d.data() + off, pre_fd.data() + off,
                                in_d.data() + off, T, C, w_d.data(), K);
  }
  return t;
}
// The GPU forward and backward on one packed batch; d_act and pre_saved are [rows, C].
ConvResult conv_gpu(const Vec& in, const Vec& w, const Vec& d_act, const Vec& pre_saved, const Vec& dw0, int64_t C,
                    int K, const std::vector<int32_t>& cu) {
  const int B = int(cu.size()) - 1;
  const int64_t rows = cu.back();
  DeviceBuffer<int32_t> d_cu(cu.data(), cu.size());
  auto d_in_x = up(in), d_w = up(w), d_dact = up(d_act), d_pre_saved = up(pre_saved), d_dw = up(dw0);
  auto d_pre = nan_buffer(size_t(rows * C)), d_act_out = nan_buffer(size_t(rows * C));
  auto d_din = nan_buffer(size_t(rows * C));
  kc::conv_silu_forward_train(d_pre.data(), d_act_out.data(), d_in_x.data(), d_w.data(), C, K, d_cu.data(), B, rows);
  auto ws = workspace(kc::conv_silu_backward_workspace_bytes(rows, C, K));
  kc::conv_silu_backward_train(d_din.data(), d_dw.data(), d_dact.data(), d_pre_saved.data(), d_in_x.data(), d_w.data(),
                               C, K, d_cu.data(), B, rows, ws.data());
  return {down(d_pre), down(d_act_out), down(d_din), down(d_dw)};
}

// The conv tests' cases: K 4 and 2, every head dim, two packed batches (one with an empty sequence). f(case)
// draws its data from ++seed.
struct ConvCase {
  int K;
  int64_t C, rows;
  std::vector<int> lens;
  std::vector<int32_t> cu;
  std::string what;
};
template <class F>
void for_each_conv_case(F f) {
  const std::vector<std::vector<int>> batches = {kLens, {40, 0, 1, 17}};
  for (int K : {4, 2})
    for (int64_t D : kHeadDims)
      for (const auto& lens : batches) {
        ConvCase c{K, kH * D, 0, lens, cu_of(lens), ""};
        c.rows = c.cu.back();
        c.what = "K " + std::to_string(K) + ", D " + std::to_string(D) + ", batch of " + std::to_string(lens.size()) +
                 " starting with length " + std::to_string(lens[0]);
        f(c);
      }
}

TEST(CudaTrainKdaOps, ConvSiluMatchesF64PerSequence) {
  K3_REQUIRE_GPU();
  uint64_t seed = 100;
  for_each_conv_case([&](const ConvCase& cc) {
    const int K = cc.K;
    const int64_t C = cc.C, rows = cc.rows;
    const std::vector<int>& lens = cc.lens;
    const std::vector<int32_t>& cu = cc.cu;
    const std::string& what = cc.what;
    const Vec in = randf(size_t(rows * C), ++seed), w = randf(size_t(C * K), ++seed, 0.5);
    const Vec d_act = randf(size_t(rows * C), ++seed), dw0 = randf(size_t(C * K), ++seed);
    const ConvTwin t = conv_twin(in, w, d_act, dw0, C, K, cu);
    const Vec& pre_f = t.pre_f;

    const ConvResult g = conv_gpu(in, w, d_act, pre_f, dw0, C, K, cu);
    EXPECT_LE(rel(g.pre, t.pre), kTol) << "pre, " << what;
    EXPECT_LE(rel(g.act, t.act), kTol) << "act, " << what;
    EXPECT_LE(rel(g.d_in, t.d_in), kTol) << "d_in, " << what;
    EXPECT_ACCUMULATED(g.dw, t.dw, dw0, "dw, " + what);

    // Deterministic: a second run gives the same bits.
    const ConvResult g2 = conv_gpu(in, w, d_act, pre_f, dw0, C, K, cu);
    EXPECT_TRUE(same_bits(g.pre, g2.pre) && same_bits(g.act, g2.act) && same_bits(g.d_in, g2.d_in) &&
                same_bits(g.dw, g2.dw))
        << "not bitwise repeatable, " << what;

    // A sequence's activations and input gradient do not depend on the batch around it: the length-17
    // sequence alone gives the bits it had packed.
    size_t b17 = 0;
    while (lens[b17] != 17) ++b17;
    const int64_t off = int64_t(cu[b17]) * C, n = 17 * C;
    auto slice = [&](const Vec& v) { return Vec(v.begin() + off, v.begin() + off + n); };
    const ConvResult alone = conv_gpu(slice(in), w, slice(d_act), slice(pre_f), dw0, C, K, {0, 17});
    EXPECT_TRUE(same_bits(alone.pre, slice(g.pre)) && same_bits(alone.act, slice(g.act)) &&
                same_bits(alone.d_in, slice(g.d_in)))
        << "the length-17 sequence alone differs from it packed, " << what;
  });
}

// The bf16 forms on the same batch: act written as bf16, d_act (bf16-representable values) uploaded as bf16.
struct ConvBf16Result {
  Vec pre;
  Bits act;
  Vec d_in, dw;
};
ConvBf16Result conv_gpu_bf16(const Vec& in, const Vec& w, const Vec& d_act, const Vec& pre_saved, const Vec& dw0,
                             int64_t C, int K, const std::vector<int32_t>& cu) {
  const int B = int(cu.size()) - 1;
  const int64_t rows = cu.back();
  DeviceBuffer<int32_t> d_cu(cu.data(), cu.size());
  auto d_in_x = up(in), d_w = up(w), d_pre_saved = up(pre_saved), d_dw = up(dw0);
  auto d_dact = up(to_bf16(d_act));
  auto d_pre = nan_buffer(size_t(rows * C)), d_din = nan_buffer(size_t(rows * C));
  auto d_act_out = nan_bits(size_t(rows * C));
  kc::conv_silu_forward_train(d_pre.data(), d_act_out.data(), d_in_x.data(), d_w.data(), C, K, d_cu.data(), B, rows);
  auto ws = workspace(kc::conv_silu_backward_workspace_bytes(rows, C, K));
  kc::conv_silu_backward_train(d_din.data(), d_dw.data(), d_dact.data(), d_pre_saved.data(), d_in_x.data(), d_w.data(),
                               C, K, d_cu.data(), B, rows, ws.data());
  return {down(d_pre), down(d_act_out), down(d_din), down(d_dw)};
}

TEST(CudaTrainKdaOps, ConvSiluBf16FormsMatchTheFp32Form) {
  K3_REQUIRE_GPU();
  uint64_t seed = 150;
  for_each_conv_case([&](const ConvCase& cc) {
    const int K = cc.K;
    const int64_t C = cc.C, rows = cc.rows;
    const std::vector<int32_t>& cu = cc.cu;
    const std::string& what = cc.what;
    const Vec in = randf(size_t(rows * C), ++seed), w = randf(size_t(C * K), ++seed, 0.5);
    const Vec d_act = bf16_values(randf(size_t(rows * C), ++seed)), dw0 = randf(size_t(C * K), ++seed);
    const ConvTwin t = conv_twin(in, w, d_act, dw0, C, K, cu);

    const ConvResult f = conv_gpu(in, w, d_act, t.pre_f, dw0, C, K, cu);
    const ConvBf16Result b = conv_gpu_bf16(in, w, d_act, t.pre_f, dw0, C, K, cu);
    EXPECT_TRUE(same_bits(b.pre, f.pre)) << "pre differs from the fp32 form's, " << what;
    EXPECT_EQ(b.act, to_bf16(f.act)) << "act is not the fp32 form's act rounded to bf16, " << what;
    EXPECT_LE(rel(from_bf16(b.act), t.act), kBf16Tol) << "act, " << what;
    EXPECT_TRUE(same_bits(b.d_in, f.d_in)) << "d_in differs from the fp32 form's, " << what;
    EXPECT_TRUE(same_bits(b.dw, f.dw)) << "dw differs from the fp32 form's, " << what;
    EXPECT_LE(rel(b.d_in, t.d_in), kTol) << "d_in, " << what;
    EXPECT_ACCUMULATED(b.dw, t.dw, dw0, "dw, " + what);
  });
}

// ---- gate ----------------------------------------------------------------------------------------------------
struct GateCase {
  Vec z, A_log, dt_bias, dg, dA0, ddt0;
};

void check_gate(const GateCase& c, int64_t rows, int64_t D, float lb, const std::string& what, bool saturated_only) {
  const int64_t H = kH, HD = H * D, n = rows * HD;
  // The twin. A_log carries one padding entry past H (only the first H are parameters).
  DVec g = zeros(n), sg = zeros(n), dz = zeros(n), dA = widen(c.dA0), ddt = widen(c.ddt0);
  const DVec z = widen(c.z), A_log = widen(c.A_log), dt = widen(c.dt_bias), dg = widen(c.dg);
  k3::kda::gate_forward(g.data(), sg.data(), z.data(), A_log.data(), dt.data(), lb, rows, H, D);
  k3::kda::gate_backward(dz.data(), dA.data(), ddt.data(), dg.data(), sg.data(), z.data(), A_log.data(), dt.data(), lb,
                         rows, H, D);

  auto d_z = up(c.z), d_alog = up(c.A_log), d_dt = up(c.dt_bias), d_dg = up(c.dg), d_dA = up(c.dA0), d_ddt = up(c.ddt0);
  auto d_g = nan_buffer(size_t(n)), d_sg = nan_buffer(size_t(n)), d_dz = nan_buffer(size_t(n));
  kc::gate_forward_train(d_g.data(), d_sg.data(), d_z.data(), d_alog.data(), d_dt.data(), lb, rows, H, D);
  auto ws = workspace(kc::gate_backward_workspace_bytes(rows, H, D));
  kc::gate_backward_train(d_dz.data(), d_dA.data(), d_ddt.data(), d_dg.data(), d_sg.data(), d_z.data(), d_alog.data(),
                          d_dt.data(), lb, rows, H, D, ws.data());
  const Vec gg = down(d_g), gsg = down(d_sg), gdz = down(d_dz), gdA = down(d_dA), gddt = down(d_ddt);

  EXPECT_LE(rel(gg, g), kTol) << "g, " << what;
  EXPECT_LE(rel(gsg, sg), kTol) << "sg, " << what;
  // The bounds: where the sigmoid is saturated (m > 30) g is exactly lower_bound; towards 0 (m < -30) it is
  // lower_bound e^m to 1e-4 relative, and below 1e-38 once m < -100.
  int64_t at_lb = 0, at_zero = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t h = (i % HD) / D;
    const double m = std::exp(A_log[size_t(h)]) * (z[size_t(i)] + dt[size_t(i % HD)]);
    if (m > 30.0) {
      EXPECT_EQ(gg[size_t(i)], lb) << "g at element " << i << " (m = " << m << "), " << what;
      ++at_lb;
    }
    if (m < -30.0) {  // the tail keeps its relative accuracy (fp32 m is off by ~1e-7 |m|) down to denormals
      EXPECT_LE(std::fabs(double(gg[size_t(i)]) - g[size_t(i)]), 1e-4 * std::fabs(g[size_t(i)]) + 1e-38)
          << "g at element " << i << " (m = " << m << "), " << what;
      if (m < -100.0) ++at_zero;
    }
  }
  EXPECT_GT(at_lb, 0) << what;
  EXPECT_GT(at_zero, 0) << what;

  if (saturated_only) {
    // Every s(1 - s) is below e^-30 on both sides: dz is finite and ~0 (the relative error of a 0 means
    // nothing), the parameters' increments vanish.
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(gdz[size_t(i)])) << "dz at " << i << ", " << what;
      EXPECT_LE(std::fabs(double(gdz[size_t(i)]) - dz[size_t(i)]), 1e-20) << "dz at " << i << ", " << what;
    }
  } else {
    EXPECT_LE(rel(gdz, dz), kTol) << "dz, " << what;
  }
  if (saturated_only) {
    // The twin's increments are below a double's ulp of the start: the gradients keep their start's bits.
    EXPECT_TRUE(same_bits(gddt, c.ddt0) && same_bits(gdA, c.dA0)) << "ddt_bias / dA_log changed, " << what;
  } else {
    EXPECT_ACCUMULATED(gddt, ddt, c.ddt0, "ddt_bias, " + what);
    EXPECT_ACCUMULATED(gdA, dA, c.dA0, "dA_log, " + what);
  }
  EXPECT_EQ(gdA[size_t(H)], c.dA0[size_t(H)]) << "dA_log's padding entry was written, " << what;
}

TEST(CudaTrainKdaOps, GateMatchesF64IncludingSaturation) {
  K3_REQUIRE_GPU();
  const int64_t rows = cu_of(kLens).back();
  const float lb = -5.0f;
  uint64_t seed = 200;
  for (int64_t D : kHeadDims) {
    const int64_t HD = kH * D, n = rows * HD;
    GateCase c;
    c.A_log = {-1.5f, 0.3f, 2.0f, 7.0f};  // both signs; the 4th is padding
    c.dt_bias = randf(size_t(HD), ++seed);
    c.z = randf(size_t(n), ++seed, 2.0);
    // Per element one of: the sigmoid's body (most), deep saturation at either end (|z| = 1e4), and the
    // tails where fp32's 1 - s has no digits left (m around +-25).
    for (int64_t i = 0; i < n; ++i) {
      const float A = std::exp(c.A_log[size_t((i % HD) / D)]);
      switch (i % 13) {
        case 0: c.z[size_t(i)] = 1e4f; break;
        case 1: c.z[size_t(i)] = -1e4f; break;
        case 2: c.z[size_t(i)] = 25.0f / A; break;
        case 3: c.z[size_t(i)] = -25.0f / A; break;
        default: break;
      }
    }
    c.dg = randf(size_t(n), ++seed);
    c.dA0 = randf(size_t(kH + 1), ++seed, 10.0);
    c.ddt0 = randf(size_t(HD), ++seed);
    check_gate(c, rows, D, lb, "mixed, D " + std::to_string(D), false);

    // Everything saturated, |z| = 1e4, A_log of both signs.
    GateCase s = c;
    s.A_log = {-3.0f, 0.0f, 3.0f, -7.0f};
    for (int64_t i = 0; i < n; ++i) s.z[size_t(i)] = (i / 3) % 2 ? 1e4f : -1e4f;
    check_gate(s, rows, D, lb, "saturated, D " + std::to_string(D), true);
  }
}

// ---- gated RMSNorm -------------------------------------------------------------------------------------------
// Rows of o scaled by 10^(r % 5 - 2), so mean(o^2) ranges from 1e-4 (eps matters) to 1e4.
Vec scaled_rows(Vec v, int64_t D) {
  for (size_t i = 0; i < v.size(); ++i) v[i] *= float(std::pow(10.0, double(int64_t(i) / D % 5) - 2.0));
  return v;
}

TEST(CudaTrainKdaOps, GatedRmsNormMatchesF64) {
  K3_REQUIRE_GPU();
  const int64_t head_rows = cu_of(kLens).back() * kH;
  const float eps = 1e-5f;
  uint64_t seed = 300;
  for (int64_t D : kHeadDims) {
    const int64_t n = head_rows * D;
    const std::string what = "D " + std::to_string(D);
    const Vec o = scaled_rows(randf(size_t(n), ++seed), D);
    Vec gp = randf(size_t(n), ++seed, 2.0);
    for (int64_t i = 0; i < n; i += 17) gp[size_t(i)] = (i / 17) % 2 ? 30.0f : -30.0f;  // saturated gates
    const Vec w = randf(size_t(D), ++seed, 0.2);
    Vec wv(w);
    for (float& x : wv) x += 1.0f;
    const Vec don = randf(size_t(n), ++seed), dw0 = randf(size_t(D), ++seed, 5.0);

    DVec on = zeros(n), inv = zeros(head_rows), d_o = zeros(n), dgp = zeros(n), dw = widen(dw0);
    const DVec o_d = widen(o), gp_d = widen(gp), w_d = widen(wv), don_d = widen(don);
    k3::kda::gated_rmsnorm_forward(on.data(), inv.data(), o_d.data(), gp_d.data(), w_d.data(), eps, head_rows, D);
    const Vec inv_f = narrow(inv);
    const DVec inv_fd = widen(inv_f);
    k3::kda::gated_rmsnorm_backward(d_o.data(), dgp.data(), dw.data(), don_d.data(), o_d.data(), inv_fd.data(),
                                    gp_d.data(), w_d.data(), head_rows, D);

    auto d_o_in = up(o), d_gp = up(gp), d_w = up(wv), d_don = up(don), d_inv_saved = up(inv_f), d_dw = up(dw0);
    auto g_on = nan_buffer(size_t(n)), g_inv = nan_buffer(size_t(head_rows)), g_do = nan_buffer(size_t(n)),
         g_dgp = nan_buffer(size_t(n));
    kc::gated_rmsnorm_forward_train(g_on.data(), g_inv.data(), d_o_in.data(), d_gp.data(), d_w.data(), eps, head_rows,
                                    D);
    auto ws = workspace(kc::gated_rmsnorm_backward_workspace_bytes(head_rows, D));
    kc::gated_rmsnorm_backward_train(g_do.data(), g_dgp.data(), d_dw.data(), d_don.data(), d_o_in.data(),
                                     d_inv_saved.data(), d_gp.data(), d_w.data(), head_rows, D, ws.data());
    EXPECT_LE(rel(down(g_on), on), kTol) << "on, " << what;
    EXPECT_LE(rel(down(g_inv), inv), kTol) << "inv, " << what;
    EXPECT_LE(rel(down(g_do), d_o), kTol) << "d_o, " << what;
    EXPECT_LE(rel(down(g_dgp), dgp), kTol) << "dgp, " << what;
    EXPECT_ACCUMULATED(down(d_dw), dw, dw0, "dw, " + what);
  }
}

// The bf16 form (d_o written as bf16) beside the fp32 form on the same inputs.
TEST(CudaTrainKdaOps, GatedRmsNormBf16FormMatchesTheFp32Form) {
  K3_REQUIRE_GPU();
  const int64_t head_rows = cu_of(kLens).back() * kH;
  uint64_t seed = 350;
  for (int64_t D : kHeadDims) {
    const int64_t n = head_rows * D;
    const std::string what = "D " + std::to_string(D);
    const Vec o = scaled_rows(randf(size_t(n), ++seed), D);
    Vec gp = randf(size_t(n), ++seed, 2.0);
    for (int64_t i = 0; i < n; i += 17) gp[size_t(i)] = (i / 17) % 2 ? 30.0f : -30.0f;
    Vec w = randf(size_t(D), ++seed, 0.2);
    for (float& x : w) x += 1.0f;
    const Vec don = randf(size_t(n), ++seed), dw0 = randf(size_t(D), ++seed, 5.0);

    DVec on = zeros(n), inv = zeros(head_rows), d_o = zeros(n), dgp = zeros(n), dw = widen(dw0);
    const DVec o_d = widen(o), gp_d = widen(gp), w_d = widen(w), don_d = widen(don);
    k3::kda::gated_rmsnorm_forward(on.data(), inv.data(), o_d.data(), gp_d.data(), w_d.data(), 1e-5f, head_rows, D);
    const Vec inv_f = narrow(inv);
    const DVec inv_fd = widen(inv_f);
    k3::kda::gated_rmsnorm_backward(d_o.data(), dgp.data(), dw.data(), don_d.data(), o_d.data(), inv_fd.data(),
                                    gp_d.data(), w_d.data(), head_rows, D);

    auto g_o = up(o), g_gp = up(gp), g_w = up(w), g_don = up(don), g_inv = up(inv_f);
    auto ws = workspace(kc::gated_rmsnorm_backward_workspace_bytes(head_rows, D));
    auto f_do = nan_buffer(size_t(n)), f_dgp = nan_buffer(size_t(n)), f_dw = up(dw0);
    kc::gated_rmsnorm_backward_train(f_do.data(), f_dgp.data(), f_dw.data(), g_don.data(), g_o.data(), g_inv.data(),
                                     g_gp.data(), g_w.data(), head_rows, D, ws.data());
    auto b_do = nan_bits(size_t(n));
    auto b_dgp = nan_buffer(size_t(n)), b_dw = up(dw0);
    kc::gated_rmsnorm_backward_train(b_do.data(), b_dgp.data(), b_dw.data(), g_don.data(), g_o.data(), g_inv.data(),
                                     g_gp.data(), g_w.data(), head_rows, D, ws.data());
    const Bits bdo = down(b_do);
    const Vec bdgp = down(b_dgp), bdw = down(b_dw);
    EXPECT_EQ(bdo, to_bf16(down(f_do))) << "d_o is not the fp32 form's d_o rounded to bf16, " << what;
    EXPECT_TRUE(same_bits(bdgp, down(f_dgp))) << "dgp differs from the fp32 form's, " << what;
    EXPECT_TRUE(same_bits(bdw, down(f_dw))) << "dw differs from the fp32 form's, " << what;
    EXPECT_LE(rel(from_bf16(bdo), d_o), kBf16Tol) << "d_o, " << what;
    EXPECT_LE(rel(bdgp, dgp), kTol) << "dgp, " << what;
    EXPECT_ACCUMULATED(bdw, dw, dw0, "dw, " + what);
  }
}

// ---- L2 norm -------------------------------------------------------------------------------------------------
TEST(CudaTrainKdaOps, L2NormMatchesF64) {
  K3_REQUIRE_GPU();
  const int64_t head_rows = cu_of(kLens).back() * kH;
  const float eps = 1e-6f;  // the block's q/k L2-norm epsilon
  uint64_t seed = 400;
  for (int64_t D : kHeadDims) {
    const int64_t n = head_rows * D;
    const std::string what = "D " + std::to_string(D);
    const Vec in = scaled_rows(randf(size_t(n), ++seed), D);  // sum in^2 down to ~1e-4 D: eps still small
    const Vec d_out = randf(size_t(n), ++seed);

    DVec out = zeros(n), inv = zeros(head_rows), d_in = zeros(n);
    const DVec in_d = widen(in), d_out_d = widen(d_out);
    k3::kda::l2norm_forward(out.data(), inv.data(), in_d.data(), head_rows, D, eps);
    const Vec out_f = narrow(out), inv_f = narrow(inv);
    const DVec out_fd = widen(out_f), inv_fd = widen(inv_f);
    k3::kda::l2norm_backward(d_in.data(), d_out_d.data(), out_fd.data(), inv_fd.data(), head_rows, D);

    auto g_in = up(in), g_out = nan_buffer(size_t(n)), g_inv = nan_buffer(size_t(head_rows));
    kc::l2norm_forward_train(g_out.data(), g_inv.data(), g_in.data(), head_rows, D, eps);
    EXPECT_LE(rel(down(g_out), out), kTol) << "out, " << what;
    EXPECT_LE(rel(down(g_inv), inv), kTol) << "inv, " << what;

    auto g_dout = up(d_out), g_out_saved = up(out_f), g_inv_saved = up(inv_f), g_din = nan_buffer(size_t(n));
    kc::l2norm_backward_train(g_din.data(), g_dout.data(), g_out_saved.data(), g_inv_saved.data(), head_rows, D);
    const Vec din = down(g_din);
    EXPECT_LE(rel(din, d_in), kTol) << "d_in, " << what;
    // In place (d_in aliases d_out): the same bits.
    kc::l2norm_backward_train(g_dout.data(), g_dout.data(), g_out_saved.data(), g_inv_saved.data(), head_rows, D);
    EXPECT_TRUE(same_bits(down(g_dout), din)) << "in-place d_in differs, " << what;
  }
}

// The bf16 forms: the forward's bf16 out is the fp32 form's out rounded; the backward takes that bf16 out and a
// bf16 d_out and gives the fp32 form's bits on the same values.
TEST(CudaTrainKdaOps, L2NormBf16FormsMatchTheFp32Form) {
  K3_REQUIRE_GPU();
  const int64_t head_rows = cu_of(kLens).back() * kH;
  const float eps = 1e-6f;
  uint64_t seed = 450;
  for (int64_t D : kHeadDims) {
    const int64_t n = head_rows * D;
    const std::string what = "D " + std::to_string(D);
    const Vec in = scaled_rows(randf(size_t(n), ++seed), D);
    const Vec d_out = bf16_values(randf(size_t(n), ++seed));

    DVec out = zeros(n), inv = zeros(head_rows);
    const DVec in_d = widen(in);
    k3::kda::l2norm_forward(out.data(), inv.data(), in_d.data(), head_rows, D, eps);

    auto g_in = up(in), f_out = nan_buffer(size_t(n)), f_inv = nan_buffer(size_t(head_rows));
    kc::l2norm_forward_train(f_out.data(), f_inv.data(), g_in.data(), head_rows, D, eps);
    auto b_out = nan_bits(size_t(n));
    auto b_inv = nan_buffer(size_t(head_rows));
    kc::l2norm_forward_train(b_out.data(), b_inv.data(), g_in.data(), head_rows, D, eps);
    const Bits out_bits = down(b_out);
    const Vec inv_f = down(b_inv);
    EXPECT_EQ(out_bits, to_bf16(down(f_out))) << "out is not the fp32 form's out rounded to bf16, " << what;
    EXPECT_TRUE(same_bits(inv_f, down(f_inv))) << "inv differs from the fp32 form's, " << what;
    EXPECT_LE(rel(from_bf16(out_bits), out), kBf16Tol) << "out, " << what;
    EXPECT_LE(rel(inv_f, inv), kTol) << "inv, " << what;

    // The backward on the bf16 forward's out (saved) and inv, and a bf16 d_out; the twin and the fp32 form see
    // the same values.
    const Vec out_saved = from_bf16(out_bits);
    DVec d_in = zeros(n);
    const DVec d_out_d = widen(d_out), out_sd = widen(out_saved), inv_fd = widen(inv_f);
    k3::kda::l2norm_backward(d_in.data(), d_out_d.data(), out_sd.data(), inv_fd.data(), head_rows, D);
    auto g_inv = up(inv_f);
    auto f_dout = up(d_out), f_out_saved = up(out_saved), f_din = nan_buffer(size_t(n));
    kc::l2norm_backward_train(f_din.data(), f_dout.data(), f_out_saved.data(), g_inv.data(), head_rows, D);
    auto b_dout = up(to_bf16(d_out));
    auto b_din = nan_buffer(size_t(n));
    kc::l2norm_backward_train(b_din.data(), b_dout.data(), b_out.data(), g_inv.data(), head_rows, D);
    const Vec bdin = down(b_din);
    EXPECT_TRUE(same_bits(bdin, down(f_din))) << "d_in differs from the fp32 form's, " << what;
    EXPECT_LE(rel(bdin, d_in), kTol) << "d_in, " << what;
  }
}

// ---- sigmoid -------------------------------------------------------------------------------------------------
TEST(CudaTrainKdaOps, SigmoidMatchesF64) {
  K3_REQUIRE_GPU();
  const int64_t n = cu_of(kLens).back() * kH;
  Vec x = randf(size_t(n), 500, 3.0);
  const float extremes[] = {1e4f, -1e4f, 100.0f, -100.0f, 20.0f, -20.0f};
  for (size_t i = 0; i < 6; ++i) x[i * 7] = extremes[i];
  const Vec dbeta = randf(size_t(n), 501);
  DVec beta = zeros(n), dx = zeros(n);
  for (int64_t i = 0; i < n; ++i) beta[size_t(i)] = 1.0 / (1.0 + std::exp(-double(x[size_t(i)])));
  const Vec beta_f = narrow(beta);
  for (int64_t i = 0; i < n; ++i) {
    const double b = double(beta_f[size_t(i)]);
    dx[size_t(i)] = double(dbeta[size_t(i)]) * (b * (1.0 - b));
  }

  auto g_x = up(x), g_beta = nan_buffer(size_t(n));
  kc::sigmoid_forward_train(g_beta.data(), g_x.data(), n);
  const Vec gb = down(g_beta);
  EXPECT_LE(rel(gb, beta), kTol);
  EXPECT_EQ(gb[0], 1.0f);                                     // x = 1e4
  EXPECT_EQ(gb[7], 0.0f);                                     // x = -1e4
  EXPECT_TRUE(gb[21] >= 0.0f && gb[21] <= 1e-40f) << gb[21];  // x = -100: e^-100 = 3.7e-44, or 0

  auto g_dbeta = up(dbeta), g_beta_saved = up(beta_f), g_dx = nan_buffer(size_t(n));
  kc::sigmoid_backward_train(g_dx.data(), g_dbeta.data(), g_beta_saved.data(), n);
  const Vec gdx = down(g_dx);
  EXPECT_LE(rel(gdx, dx), kTol);
  kc::sigmoid_backward_train(g_dbeta.data(), g_dbeta.data(), g_beta_saved.data(), n);  // in place
  EXPECT_TRUE(same_bits(down(g_dbeta), gdx));
}

// ---- argument checks (no GPU needed: they throw before any CUDA call) ---------------------------------------
TEST(CudaTrainKdaOps, BadArgumentsThrowNamedErrors) {
  using k3test::error_of;
  // Never dereferenced: every call below fails its checks first.
  float* p = reinterpret_cast<float*>(uintptr_t(256));
  const int32_t* cu = reinterpret_cast<const int32_t*>(uintptr_t(512));
  void* ws = reinterpret_cast<void*>(uintptr_t(1024));
  std::string e = error_of([&] { kc::conv_silu_forward_train(p, p, p, p, 96, 9, cu, 2, 10); });
  EXPECT_NE(e.find("conv_silu_forward_train"), std::string::npos) << e;
  EXPECT_NE(e.find("K must be in [1, 8]"), std::string::npos) << e;
  e = error_of([&] { kc::conv_silu_forward_train(p, p, p, p, 96, 4, cu, 0, 10); });
  EXPECT_NE(e.find("B >= 1"), std::string::npos) << e;
  e = error_of([&] { kc::conv_silu_backward_train(p, p + 64, p + 128, p, p, p, 96, 4, cu, 2, 10, nullptr); });
  EXPECT_NE(e.find("conv_silu_backward_train: workspace is null"), std::string::npos) << e;
  e = error_of([&] { kc::conv_silu_backward_train(p, p + 64, p, p, p, p, 96, 4, cu, 2, 10, ws); });
  EXPECT_NE(e.find("d_in must not alias d_act"), std::string::npos) << e;
  e = error_of([&] { kc::gate_forward_train(p, p, p, p, p, 1.0f, 10, 3, 32); });
  EXPECT_NE(e.find("gate_forward_train: lower_bound"), std::string::npos) << e;
  e = error_of([&] { kc::gate_backward_train(p, p, p, p, p, p, p, p, -5.0f, 10, 0, 32, ws); });
  EXPECT_NE(e.find("gate_backward_train"), std::string::npos) << e;
  e = error_of([&] { kc::gated_rmsnorm_forward_train(p, p, p, p, p, 1e-5f, 10, 0); });
  EXPECT_NE(e.find("gated_rmsnorm_forward_train"), std::string::npos) << e;
  e = error_of([&] { kc::gated_rmsnorm_backward_train(p, p, p, p, p, p, p, p, 10, 32, nullptr); });
  EXPECT_NE(e.find("workspace is null"), std::string::npos) << e;
  e = error_of([&] { kc::l2norm_backward_train(p, p, nullptr, p, 10, 32); });
  EXPECT_NE(e.find("l2norm_backward_train: out is null"), std::string::npos) << e;
  e = error_of([&] { kc::sigmoid_forward_train(p, p, -1); });
  EXPECT_NE(e.find("sigmoid_forward_train"), std::string::npos) << e;
  // The bf16 forms share the checks and name the same functions.
  uint16_t* h = reinterpret_cast<uint16_t*>(uintptr_t(2048));
  e = error_of([&] { kc::conv_silu_forward_train(p, h, p, p, 96, 9, cu, 2, 10); });
  EXPECT_NE(e.find("conv_silu_forward_train: K must be in [1, 8]"), std::string::npos) << e;
  e = error_of([&] { kc::conv_silu_backward_train(p, p + 64, h, p, p, p, 96, 4, cu, 2, 10, nullptr); });
  EXPECT_NE(e.find("conv_silu_backward_train: workspace is null"), std::string::npos) << e;
  e = error_of([&] {
    kc::conv_silu_backward_train(p, p + 64, reinterpret_cast<const uint16_t*>(p), p, p, p, 96, 4, cu, 2, 10, ws);
  });
  EXPECT_NE(e.find("d_in must not alias d_act"), std::string::npos) << e;
  e = error_of([&] { kc::gated_rmsnorm_backward_train(h, p, p, p, p, p, p, p, 10, 32, nullptr); });
  EXPECT_NE(e.find("gated_rmsnorm_backward_train: workspace is null"), std::string::npos) << e;
  e = error_of([&] { kc::l2norm_forward_train(h, p, p, 10, 0, 1e-6f); });
  EXPECT_NE(e.find("l2norm_forward_train: need head_rows >= 0 and D >= 1"), std::string::npos) << e;
  e = error_of([&] { kc::l2norm_backward_train(p, h, nullptr, p, 10, 32); });
  EXPECT_NE(e.find("l2norm_backward_train: out is null"), std::string::npos) << e;
  // Empty inputs are no-ops (nothing is launched, no pointer is needed).
  kc::conv_silu_forward_train(nullptr, static_cast<float*>(nullptr), nullptr, nullptr, 96, 4, nullptr, 0, 0);
  kc::conv_silu_forward_train(nullptr, static_cast<uint16_t*>(nullptr), nullptr, nullptr, 96, 4, nullptr, 0, 0);
  kc::l2norm_backward_train(nullptr, static_cast<const uint16_t*>(nullptr), nullptr, nullptr, 0, 32);
  kc::gate_backward_train(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, -5.0f, 0, 3, 32,
                          nullptr);
  EXPECT_EQ(kc::gate_backward_workspace_bytes(0, 3, 32), 0u);
}

}  // namespace

#endif  // K3_HAVE_CUDA
