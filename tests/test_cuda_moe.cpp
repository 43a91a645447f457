// The LatentMoE CUDA kernels (kernels/moe/moe_cuda.h) against their CPU twins: the sigmoid router
// (moe/router.h), the dispatch (a plain CPU histogram), and the routed experts (gemm/linear.h over
// BF16 / MXFP4 weights + ffn/glu.h SiTU-GLU + the fp32 weighted sum, as model/ffn_layer.cpp runs them).
// Inputs are fresh random data of awkward sizes (experts with 0, 1 and many rows, row counts that are
// not multiples of the 128-row tile, widths with a K tail of 32, output widths not multiples of 128).
//
// Tolerances:
//   - routed experts: relative L2 <= 1e-2 (bf16 operands: z, the weights and h are bf16, each a
//     relative rounding of 2^-9; fp32 accumulation);
//   - router: selections equal wherever the biased scores are not within 1e-6 of a tie (the GPU's
//     expf may differ from glibc's by an ulp); weights to 1e-5 relative (fp32 sigmoid, fp64 sum);
//   - MXFP4: bit-for-bit equal to the same kernel on the bf16 dequantisation (decoding is exact).
// Outputs are poisoned with NaN before each run, so an unwritten element fails the finite check.
// Skips without a Hopper GPU (K3_REQUIRE_GPU).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ffn/glu.h"
#include "kernels/gemm/linear.h"
#include "kernels/gemm/mxfp4.h"
#include "kernels/moe/expert_rows_cuda.h"
#include "kernels/moe/moe_cuda.h"
#include "kernels/moe/router.h"
#include "util/cuda_test.h"
#include "util/error_of.h"

namespace {

namespace mc = k3::moe::cuda;
using k3::WeightRef;
using k3::cuda::DeviceBuffer;
using bf16 = uint16_t;
using ::testing::HasSubstr;

constexpr double kRelL2 = 1e-2;
constexpr uint16_t kBf16NaN = 0x7fc0;

std::vector<bf16> random_bf16(size_t n, float stddev, std::mt19937_64& r) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<bf16> v(n);
  for (auto& x : v) x = k3::f32_to_bf16(d(r));
  return v;
}

std::vector<float> widen(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = k3::bf16_to_f32(v[i]);
  return f;
}

template <class T>
std::vector<T> download(const DeviceBuffer<T>& d, size_t n) {
  std::vector<T> h(n);
  d.download(h.data(), n);
  return h;
}

// ||a - ref|| / ||ref||, after checking that every element of a is finite.
double rel_l2(const std::vector<float>& a, const std::vector<float>& ref, const std::string& what) {
  EXPECT_EQ(a.size(), ref.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) {
      ADD_FAILURE() << what << ": non-finite output " << a[i] << " at " << i << " (unwritten or overflow)";
      return INFINITY;
    }
    const double d = double(a[i]) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// ---- MXFP4 host data ------------------------------------------------------------------------------

struct Mx {
  std::vector<uint8_t> packed, scales;  // all experts stacked
};

Mx random_mxfp4(int64_t E, int64_t rows, int64_t cols, int smin, int smax, std::mt19937_64& r) {
  Mx m;
  m.packed.resize(static_cast<size_t>(E * rows * cols / 2));
  m.scales.resize(static_cast<size_t>(E * rows * cols / 32));
  for (auto& b : m.packed) b = uint8_t(r() & 0xff);
  std::uniform_int_distribution<int> sd(smin, smax);
  for (auto& s : m.scales) s = uint8_t(sd(r));
  return m;
}

// The exact bf16 dequantisation (every MXFP4 value with a normal result is a bf16).
std::vector<bf16> dequant_bf16(const Mx& m, int64_t E, int64_t rows, int64_t cols) {
  std::vector<bf16> out(static_cast<size_t>(E * rows * cols));
  std::vector<float> row(static_cast<size_t>(cols));
  for (int64_t r = 0; r < E * rows; ++r) {
    k3::mxfp4_decode_row(row.data(), &m.packed[static_cast<size_t>(r * cols / 2)],
                         &m.scales[static_cast<size_t>(r * cols / 32)], cols);
    for (int64_t c = 0; c < cols; ++c) {
      out[static_cast<size_t>(r * cols + c)] = k3::f32_to_bf16(row[static_cast<size_t>(c)]);
      EXPECT_EQ(k3::bf16_to_f32(out[static_cast<size_t>(r * cols + c)]), row[static_cast<size_t>(c)])
          << "dequantised value not exact in bf16";
    }
  }
  return out;
}

// ---- routing with chosen expert sizes -------------------------------------------------------------

// idx [T, K] with distinct experts per token: expert 0 in every token (T rows: several 128-row tiles
// when T > 128), expert 1 only in token 0 (1 row), expert 2 never (0 rows), the rest random from 3..E-1.
std::vector<int32_t> skewed_idx(int64_t T, int64_t E, int64_t K, std::mt19937_64& r) {
  EXPECT_GE(E - 3, K - 1);
  std::vector<int32_t> idx(static_cast<size_t>(T * K));
  std::vector<int32_t> pool(static_cast<size_t>(E - 3));
  std::iota(pool.begin(), pool.end(), 3);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(pool.begin(), pool.end(), r);
    idx[static_cast<size_t>(t * K)] = 0;
    for (int64_t k = 1; k < K; ++k) idx[static_cast<size_t>(t * K + k)] = pool[static_cast<size_t>(k - 1)];
    if (t == 0 && K > 1) idx[static_cast<size_t>(1)] = 1;
  }
  return idx;
}

std::vector<float> random_weights(int64_t n, std::mt19937_64& r) {
  std::uniform_real_distribution<float> d(0.05f, 1.0f);
  std::vector<float> w(static_cast<size_t>(n));
  for (auto& x : w) x = d(r);
  return w;
}

// ---- CPU twin of the routed experts (model/ffn_layer.cpp's loop) ---------------------------------

struct HostExperts {
  bool mx = false;
  int64_t E = 0, L = 0, I = 0;
  std::vector<bf16> w1, w3, w2;  // BF16 (or the dequantisation of the MXFP4 ones)
  Mx m1, m3, m2;

  WeightRef ref(int which, int64_t e) const {  // 1 = gate, 3 = up, 2 = down
    const int64_t rows = which == 2 ? L : I, cols = which == 2 ? I : L;
    WeightRef w;
    w.rows = rows;
    w.cols = cols;
    if (mx) {
      const Mx& m = which == 1 ? m1 : which == 3 ? m3 : m2;
      w.format = WeightRef::Format::MXFP4;
      w.data = &m.packed[static_cast<size_t>(e * rows * cols / 2)];
      w.scales = &m.scales[static_cast<size_t>(e * rows * cols / 32)];
    } else {
      const std::vector<bf16>& b = which == 1 ? w1 : which == 3 ? w3 : w2;
      w.format = WeightRef::Format::BF16;
      w.data = &b[static_cast<size_t>(e * rows * cols)];
    }
    return w;
  }
};

HostExperts make_experts(bool mx, int64_t E, int64_t L, int64_t I, std::mt19937_64& r) {
  HostExperts h;
  h.mx = mx;
  h.E = E;
  h.L = L;
  h.I = I;
  if (mx) {
    // E8M0 scales around 2^-5: weights of order 1/sqrt(cols) for the sizes below.
    h.m1 = random_mxfp4(E, I, L, 119, 123, r);
    h.m3 = random_mxfp4(E, I, L, 119, 123, r);
    h.m2 = random_mxfp4(E, L, I, 119, 123, r);
    h.w1 = dequant_bf16(h.m1, E, I, L);
    h.w3 = dequant_bf16(h.m3, E, I, L);
    h.w2 = dequant_bf16(h.m2, E, L, I);
  } else {
    h.w1 = random_bf16(static_cast<size_t>(E * I * L), 1.0f / std::sqrt(float(L)), r);
    h.w3 = random_bf16(static_cast<size_t>(E * I * L), 1.0f / std::sqrt(float(L)), r);
    h.w2 = random_bf16(static_cast<size_t>(E * L * I), 1.0f / std::sqrt(float(I)), r);
  }
  return h;
}

// u [T, L] fp32 = Σ_k w[t,k] · down(SiTU-GLU(gate z_t, up z_t)) of expert idx[t,k].
std::vector<float> cpu_experts(const HostExperts& x, const std::vector<float>& z, const std::vector<int32_t>& idx,
                               const std::vector<float>& wt, int64_t T, int64_t K, const k3::GluParams& gp) {
  const int64_t L = x.L, I = x.I;
  std::vector<float> u(static_cast<size_t>(T * L), 0.0f);
  for (int64_t e = 0; e < x.E; ++e) {
    std::vector<std::pair<int64_t, float>> rows;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (idx[static_cast<size_t>(t * K + k)] == e) rows.push_back({t, wt[static_cast<size_t>(t * K + k)]});
    if (rows.empty()) continue;
    const int64_t ne = int64_t(rows.size());
    std::vector<float> zin(static_cast<size_t>(ne * L)), g(static_cast<size_t>(ne * I)),
        up(static_cast<size_t>(ne * I)), y(static_cast<size_t>(ne * L));
    for (int64_t i = 0; i < ne; ++i)
      std::copy_n(&z[static_cast<size_t>(rows[static_cast<size_t>(i)].first * L)], L, &zin[static_cast<size_t>(i * L)]);
    k3::linear_forward(g.data(), zin.data(), ne, x.ref(1, e));
    k3::linear_forward(up.data(), zin.data(), ne, x.ref(3, e));
    k3::glu_forward(g.data(), g.data(), up.data(), ne * I, gp);
    k3::linear_forward(y.data(), g.data(), ne, x.ref(2, e));
    for (int64_t i = 0; i < ne; ++i)
      for (int64_t j = 0; j < L; ++j)
        u[static_cast<size_t>(rows[static_cast<size_t>(i)].first * L + j)] +=
            rows[static_cast<size_t>(i)].second * y[static_cast<size_t>(i * L + j)];
  }
  return u;
}

// Device copies of the experts in one format.
struct DevExperts {
  DeviceBuffer<bf16> b1, b3, b2;
  DeviceBuffer<uint8_t> p1, p3, p2, s1, s3, s2;
  mc::ExpertLinear w1, w3, w2;
};

void upload(DevExperts& d, const HostExperts& h, bool use_mx) {
  const int64_t L = h.L, I = h.I;
  if (use_mx) {
    d.p1 = DeviceBuffer<uint8_t>(h.m1.packed.data(), h.m1.packed.size());
    d.p3 = DeviceBuffer<uint8_t>(h.m3.packed.data(), h.m3.packed.size());
    d.p2 = DeviceBuffer<uint8_t>(h.m2.packed.data(), h.m2.packed.size());
    d.s1 = DeviceBuffer<uint8_t>(h.m1.scales.data(), h.m1.scales.size());
    d.s3 = DeviceBuffer<uint8_t>(h.m3.scales.data(), h.m3.scales.size());
    d.s2 = DeviceBuffer<uint8_t>(h.m2.scales.data(), h.m2.scales.size());
    d.w1 = mc::ExpertLinear::mxfp4_stacked(d.p1.data(), d.s1.data(), I, L);
    d.w3 = mc::ExpertLinear::mxfp4_stacked(d.p3.data(), d.s3.data(), I, L);
    d.w2 = mc::ExpertLinear::mxfp4_stacked(d.p2.data(), d.s2.data(), L, I);
  } else {
    d.b1 = DeviceBuffer<bf16>(h.w1.data(), h.w1.size());
    d.b3 = DeviceBuffer<bf16>(h.w3.data(), h.w3.size());
    d.b2 = DeviceBuffer<bf16>(h.w2.data(), h.w2.size());
    d.w1 = mc::ExpertLinear::bf16_stacked(d.b1.data(), I, L);
    d.w3 = mc::ExpertLinear::bf16_stacked(d.b3.data(), I, L);
    d.w2 = mc::ExpertLinear::bf16_stacked(d.b2.data(), L, I);
  }
}

struct GpuOut {
  std::vector<bf16> h;   // [S, I], sorted rows
  std::vector<float> u;  // [T, L]
};

GpuOut gpu_experts(const DevExperts& dx, const std::vector<bf16>& z, const std::vector<int32_t>& idx,
                   const std::vector<float>& wt, int64_t T, int64_t E, int64_t K, int64_t L, int64_t I,
                   const k3::GluParams& gp, int tile_m, const mc::GemmConfig& cfg = {}) {
  DeviceBuffer<bf16> dz(z.data(), z.size());
  DeviceBuffer<int32_t> didx(idx.data(), idx.size());
  DeviceBuffer<float> dw(wt.data(), wt.size());
  const int64_t S = T * K;
  const std::vector<bf16> hpoison(static_cast<size_t>(S * I), kBf16NaN), ypoison(static_cast<size_t>(S * L), kBf16NaN);
  const std::vector<float> upoison(static_cast<size_t>(T * L), NAN);
  DeviceBuffer<bf16> h(hpoison.data(), hpoison.size()), y(ypoison.data(), ypoison.size());
  DeviceBuffer<float> u(upoison.data(), upoison.size());
  mc::Dispatch d(T + 3, E, K);  // capacity above T on purpose
  d.build(didx.data(), T, tile_m);
  EXPECT_EQ(d.tile_m(), tile_m);
  mc::experts_forward(u.data(), h.data(), y.data(), dz.data(), dw.data(), d, dx.w1, dx.w3, dx.w2, gp, cfg);
  k3::cuda::synchronize();
  return GpuOut{download(h, static_cast<size_t>(S * I)), download(u, static_cast<size_t>(T * L))};
}

struct Case {
  const char* name;
  int64_t T, E, K, L, I;
};

// k3-tiny (L = I = 64), a K tail and non-tile widths (L = 96, I = 160), k3-small-like, and a wider one
// with expert 0 spanning three 128-row tiles.
const Case kCases[] = {
    {"k3-tiny", 37, 16, 4, 64, 64},
    {"tails", 129, 8, 3, 96, 160},
    {"k3-small", 200, 32, 4, 128, 128},
    {"wide", 300, 40, 6, 512, 384},
};

void run_experts_case(const Case& c, bool mx, int tile_m, uint64_t seed) {
  std::mt19937_64 r(seed);
  const k3::GluParams gp{true, 4.0f, 25.0f};
  const HostExperts hx = make_experts(mx, c.E, c.L, c.I, r);
  const std::vector<bf16> z = random_bf16(static_cast<size_t>(c.T * c.L), 1.0f, r);
  const std::vector<int32_t> idx = skewed_idx(c.T, c.E, c.K, r);
  const std::vector<float> wt = random_weights(c.T * c.K, r);
  DevExperts dx;
  upload(dx, hx, mx);
  const GpuOut g = gpu_experts(dx, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, tile_m);
  const std::vector<float> ref = cpu_experts(hx, widen(z), idx, wt, c.T, c.K, gp);
  const std::string what = std::string(c.name) + (mx ? " MXFP4" : " BF16") + " T=" + std::to_string(c.T) +
                           " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) + " L=" + std::to_string(c.L) +
                           " I=" + std::to_string(c.I) + " TM=" + std::to_string(tile_m);
  const double err = rel_l2(g.u, ref, what);
  std::printf("[experts] %-48s rel L2 %.3e (tol %.0e)\n", what.c_str(), err, kRelL2);
  EXPECT_LE(err, kRelL2) << what;
}

}  // namespace

// NaN scores select last on both twins (kernels/moe/router_cpu.cpp): the GPU must return the CPU's
// experts, all in range and distinct. (Before, a NaN row left the argmax with no expert, and the
// index it wrote took the dispatch out of range: cudaErrorIllegalInstruction, fatal to the context.)
TEST(CudaMoeRouter, NanScoresGiveTheCpusExperts) {
  K3_REQUIRE_GPU();
  const int64_t T = 3, E = 64, K = 6;
  k3::moe::RouterParams p{E, K, 8, 3, true, 1.0f};
  std::vector<float> logits(static_cast<size_t>(T * E));
  for (int64_t i = 0; i < T * E; ++i) logits[size_t(i)] = float((i * 37) % 11) - 5.0f;
  for (int64_t e = 0; e < E; ++e) logits[size_t(e)] = NAN;         // token 0: all NaN
  for (int64_t e = 0; e < E; e += 3) logits[size_t(E + e)] = NAN;  // token 1: some NaN
  std::vector<int32_t> idx_c(static_cast<size_t>(T * K));
  std::vector<float> w_c(idx_c.size());
  k3::moe::router_forward(idx_c.data(), w_c.data(), nullptr, logits.data(), nullptr, T, p);
  DeviceBuffer<float> dl(logits.data(), logits.size());
  const std::vector<int32_t> ipoison(idx_c.size(), -1);
  DeviceBuffer<int32_t> di(ipoison.data(), ipoison.size());
  DeviceBuffer<float> dw(w_c.data(), w_c.size());
  mc::router_forward(di.data(), dw.data(), dl.data(), nullptr, T, p);
  k3::cuda::synchronize();
  EXPECT_EQ(download(di, idx_c.size()), idx_c);
}

TEST(CudaMoeRouter, MatchesCpuAwayFromTies) {
  K3_REQUIRE_GPU();
  struct RC {
    int64_t T, E, K, G, TG;
    bool renorm;
    float scaling;
    bool bias;
  };
  const RC cases[] = {
      {77, 896, 16, 1, 1, true, 1.0f, true},   // K3
      {33, 16, 4, 1, 1, true, 1.0f, true},     // k3-tiny
      {129, 192, 4, 1, 1, true, 1.0f, false},  // k3-1b, no bias
      {50, 64, 6, 8, 3, true, 2.5f, true},     // group-limited (DeepSeek-V3 style)
      {41, 256, 8, 1, 1, false, 2.5f, true},   // no renormalisation
  };
  std::mt19937_64 r(1234);
  for (const RC& c : cases) {
    k3::moe::RouterParams p{c.E, c.K, c.G, c.TG, c.renorm, c.scaling};
    ASSERT_EQ(mc::router_can_run(p), "");
    std::normal_distribution<float> ld(0.0f, 2.0f), bd(0.0f, 0.1f);
    std::vector<float> logits(static_cast<size_t>(c.T * c.E)), bias(static_cast<size_t>(c.E));
    for (auto& x : logits) x = ld(r);
    for (auto& x : bias) x = bd(r);
    const float* hb = c.bias ? bias.data() : nullptr;
    std::vector<int32_t> idx_c(static_cast<size_t>(c.T * c.K));
    std::vector<float> w_c(static_cast<size_t>(c.T * c.K)), s_c(static_cast<size_t>(c.T * c.E));
    k3::moe::router_forward(idx_c.data(), w_c.data(), s_c.data(), logits.data(), hb, c.T, p);

    DeviceBuffer<float> dl(logits.data(), logits.size()), db(bias.data(), bias.size());
    const std::vector<int32_t> ipoison(idx_c.size(), -1);
    const std::vector<float> wpoison(w_c.size(), NAN);
    DeviceBuffer<int32_t> di(ipoison.data(), ipoison.size());
    DeviceBuffer<float> dw(wpoison.data(), wpoison.size());
    mc::router_forward(di.data(), dw.data(), dl.data(), c.bias ? db.data() : nullptr, c.T, p);
    k3::cuda::synchronize();
    const auto idx_g = download(di, idx_c.size());
    const auto w_g = download(dw, w_c.size());

    int64_t compared = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      // biased scores in descending order; a token is near a tie when two of its K+1 best (or, with
      // groups, two group scores) are within 1e-6.
      std::vector<float> sel(static_cast<size_t>(c.E));
      for (int64_t e = 0; e < c.E; ++e)
        sel[static_cast<size_t>(e)] = s_c[static_cast<size_t>(t * c.E + e)] + (hb ? hb[e] : 0.0f);
      bool near_tie = false;
      if (c.G > 1 && c.TG < c.G) {  // mask the groups the CPU twin drops, and check the group scores too
        const int64_t per = c.E / c.G;
        std::vector<float> gs;
        for (int64_t g = 0; g < c.G; ++g) {
          std::vector<float> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
          std::sort(v.rbegin(), v.rend());
          gs.push_back(v[0] + v[1]);
        }
        std::vector<int64_t> go(static_cast<size_t>(c.G));
        std::iota(go.begin(), go.end(), 0);
        std::stable_sort(go.begin(), go.end(),
                         [&](int64_t a, int64_t b) { return gs[static_cast<size_t>(a)] > gs[static_cast<size_t>(b)]; });
        for (size_t i = 0; i + 1 < go.size(); ++i)
          near_tie |= gs[static_cast<size_t>(go[i])] - gs[static_cast<size_t>(go[i + 1])] < 1e-6f;
        for (int64_t i = c.TG; i < c.G; ++i)
          for (int64_t e = go[static_cast<size_t>(i)] * per; e < (go[static_cast<size_t>(i)] + 1) * per; ++e)
            sel[static_cast<size_t>(e)] = -INFINITY;
      }
      std::vector<float> srt = sel;
      std::sort(srt.rbegin(), srt.rend());
      for (int64_t i = 0; i < std::min(c.K, c.E - 1); ++i)
        near_tie |= srt[static_cast<size_t>(i)] - srt[static_cast<size_t>(i + 1)] < 1e-6f;
      if (near_tie) continue;
      ++compared;
      for (int64_t k = 0; k < c.K; ++k) {
        const size_t i = static_cast<size_t>(t * c.K + k);
        ASSERT_EQ(idx_g[i], idx_c[i]) << "E=" << c.E << " K=" << c.K << " G=" << c.G << " token " << t << " k " << k;
        ASSERT_NEAR(w_g[i], w_c[i], 1e-5 * std::fabs(w_c[i]) + 1e-7)
            << "E=" << c.E << " K=" << c.K << " token " << t << " k " << k;
      }
    }
    std::printf("[router] E=%lld K=%lld G=%lld: %lld of %lld tokens compared (rest within 1e-6 of a tie)\n",
                (long long)c.E, (long long)c.K, (long long)c.G, (long long)compared, (long long)c.T);
    EXPECT_GE(compared, c.T * 9 / 10) << "too many near-ties: the test would not test much";
  }
}

TEST(CudaMoeRouter, ExactTiesGoToTheLowerExpert) {
  K3_REQUIRE_GPU();
  const int64_t T = 5, E = 64, K = 8;
  k3::moe::RouterParams p{E, K, 1, 1, true, 1.0f};
  std::vector<float> logits(static_cast<size_t>(T * E), 0.3f), bias(static_cast<size_t>(E), 0.0f);
  // token 1: expert 40 scores higher; token 2: experts 50..63 score lower (0.29), but the bias lifts 63
  logits[static_cast<size_t>(1 * E + 40)] = 2.0f;
  for (int64_t e = 50; e < E; ++e) logits[static_cast<size_t>(2 * E + e)] = 0.29f;  // lower raw score ...
  bias[static_cast<size_t>(63)] = 0.5f;                                             // ... but 63 wins by bias
  DeviceBuffer<float> dl(logits.data(), logits.size()), db(bias.data(), bias.size());
  DeviceBuffer<int32_t> di(static_cast<size_t>(T * K));
  DeviceBuffer<float> dw(static_cast<size_t>(T * K));
  mc::router_forward(di.data(), dw.data(), dl.data(), db.data(), T, p);
  k3::cuda::synchronize();
  const auto idx = download(di, static_cast<size_t>(T * K));
  const auto w = download(dw, static_cast<size_t>(T * K));
  std::vector<int32_t> idx_c(static_cast<size_t>(T * K));
  std::vector<float> w_c(static_cast<size_t>(T * K));
  k3::moe::router_forward(idx_c.data(), w_c.data(), nullptr, logits.data(), bias.data(), T, p);
  EXPECT_EQ(idx, idx_c);
  // The bias is per expert, so expert 63 (sigmoid(0.3) + 0.5 = 1.07) comes first for every token.
  // Token 0: the other 63 experts tie exactly, so they follow in index order, 0..K-2. The mixture
  // weights use the unbiased scores, all equal: 1/K each.
  EXPECT_EQ(idx[0], 63);
  for (int64_t k = 1; k < K; ++k)
    EXPECT_EQ(idx[static_cast<size_t>(k)], int32_t(k - 1)) << "tied scores must select the lower experts first";
  for (int64_t k = 0; k < K; ++k) EXPECT_NEAR(w[static_cast<size_t>(k)], 1.0f / K, 1e-6f);
  // Token 1: 63, then expert 40 (sigmoid(2) = 0.88), then the tied 0.3 experts from 0.
  EXPECT_EQ(idx[static_cast<size_t>(1 * K)], 63);
  EXPECT_EQ(idx[static_cast<size_t>(1 * K + 1)], 40);
  EXPECT_EQ(idx[static_cast<size_t>(1 * K + 2)], 0);
  // Token 2: 63 (its raw 0.29 lifted by the bias), then experts 0.. (0.3 beats the other 0.29s).
  EXPECT_EQ(idx[static_cast<size_t>(2 * K)], 63);
  EXPECT_EQ(idx[static_cast<size_t>(2 * K + 1)], 0);
  EXPECT_EQ(idx[static_cast<size_t>(2 * K + K - 1)], int32_t(K - 2));
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], w_c[i], 1e-6f) << i;
}

TEST(CudaMoeDispatch, CountsOffsetsSlotsAndTiles) {
  K3_REQUIRE_GPU();
  // The single-CTA plan (S <= kPlanSmallSlots) and the general path, each with experts fewer and more than the
  // scan's threads (one and two experts per thread).
  const std::pair<int64_t, int64_t> shapes[] = {{300, 40}, {7, 1500}, {3000, 40}, {3000, 1500}};
  for (const auto& [T, E] : shapes) {
    SCOPED_TRACE("T " + std::to_string(T) + " E " + std::to_string(E));
    std::mt19937_64 r(99);
    const int64_t K = 6, S = T * K;
    const std::vector<int32_t> idx = skewed_idx(T, E, K, r);
    DeviceBuffer<int32_t> didx(idx.data(), idx.size());
    mc::Dispatch d(T, E, K);
    for (int rep = 0; rep < 3; ++rep) {  // later builds must not see an earlier one's state
      const int tm = rep == 1 ? 64 : 128;
      d.build(didx.data(), T, tm);
      ASSERT_EQ(d.tile_m(), tm);
      k3::cuda::synchronize();
      std::vector<int32_t> counts(static_cast<size_t>(E)), offsets(static_cast<size_t>(E + 1)),
          slot_of(static_cast<size_t>(S)), slot_token(static_cast<size_t>(S)), nt(1);
      k3::cuda::copy_to_host(counts.data(), d.counts(), counts.size() * 4);
      k3::cuda::copy_to_host(offsets.data(), d.offsets(), offsets.size() * 4);
      k3::cuda::copy_to_host(slot_of.data(), d.slot_of(), slot_of.size() * 4);
      k3::cuda::copy_to_host(slot_token.data(), d.slot_token(), slot_token.size() * 4);
      k3::cuda::copy_to_host(nt.data(), d.num_tiles(), 4);
      std::vector<int32_t> want(static_cast<size_t>(E), 0);
      for (int32_t e : idx) ++want[static_cast<size_t>(e)];
      ASSERT_EQ(counts, want);
      EXPECT_EQ(counts[0], T);
      EXPECT_EQ(counts[1], 1);
      EXPECT_EQ(counts[2], 0);
      int32_t run = 0, tiles = 0;
      for (int64_t e = 0; e < E; ++e) {
        ASSERT_EQ(offsets[static_cast<size_t>(e)], run) << e;
        run += want[static_cast<size_t>(e)];
        tiles += (want[static_cast<size_t>(e)] + tm - 1) / tm;
      }
      ASSERT_EQ(offsets[static_cast<size_t>(E)], S);
      ASSERT_EQ(nt[0], tiles);
      ASSERT_LE(tiles, d.max_tiles());
      std::vector<char> seen(static_cast<size_t>(S), 0);
      for (int64_t i = 0; i < S; ++i) {
        const int32_t pos = slot_of[static_cast<size_t>(i)], e = idx[static_cast<size_t>(i)];
        ASSERT_TRUE(pos >= offsets[static_cast<size_t>(e)] && pos < offsets[static_cast<size_t>(e + 1)])
            << "slot " << i << " outside expert " << e;
        ASSERT_FALSE(seen[static_cast<size_t>(pos)]) << "sorted row " << pos << " used twice";
        seen[static_cast<size_t>(pos)] = 1;
        ASSERT_EQ(slot_token[static_cast<size_t>(pos)], int32_t(i / K));
      }
      std::vector<int32_t> tl(static_cast<size_t>(2 * tiles));
      k3::cuda::copy_to_host(tl.data(), d.tiles(), tl.size() * 4);
      std::vector<int32_t> covered(static_cast<size_t>(E), 0);
      for (int32_t t = 0; t < tiles; ++t) {
        const int32_t e = tl[static_cast<size_t>(2 * t)], m0 = tl[static_cast<size_t>(2 * t + 1)];
        ASSERT_TRUE(e >= 0 && e < E && m0 % tm == 0 && m0 < want[static_cast<size_t>(e)]) << "tile " << t;
        covered[static_cast<size_t>(e)] += std::min(tm, want[static_cast<size_t>(e)] - m0);
      }
      EXPECT_EQ(covered, want);
    }
  }
}

// Y_e = X_e W_eᵀ through grouped_gemm (gathered rows, N = 136 and K = 96: neither a multiple of the tile).
TEST(CudaMoeGemm, GroupedGemmMatchesCpu) {
  K3_REQUIRE_GPU();
  for (bool mx : {false, true}) {
    std::mt19937_64 r(mx ? 7 : 8);
    const int64_t T = 150, E = 6, K = 2, N = 136, Kd = 96, S = T * K;
    const std::vector<bf16> x = random_bf16(static_cast<size_t>(T * Kd), 1.0f, r);
    const std::vector<int32_t> idx = skewed_idx(T, E, K, r);
    Mx m = random_mxfp4(E, N, Kd, 119, 123, r);
    const std::vector<bf16> w = mx ? dequant_bf16(m, E, N, Kd) : random_bf16(static_cast<size_t>(E * N * Kd), 0.1f, r);
    DeviceBuffer<bf16> dx(x.data(), x.size()), dwb(w.data(), w.size());
    DeviceBuffer<uint8_t> dp(m.packed.data(), m.packed.size()), ds(m.scales.data(), m.scales.size());
    DeviceBuffer<int32_t> didx(idx.data(), idx.size());
    const std::vector<bf16> poison(static_cast<size_t>(S * N), kBf16NaN);
    DeviceBuffer<bf16> dy(poison.data(), poison.size());
    mc::Dispatch d(T, E, K);
    d.build(didx.data(), T, mx ? 64 : 128);
    const mc::ExpertLinear wl = mx ? mc::ExpertLinear::mxfp4_stacked(dp.data(), ds.data(), N, Kd)
                                   : mc::ExpertLinear::bf16_stacked(dwb.data(), N, Kd);
    ASSERT_EQ(mc::gemm_can_run(wl), "");
    mc::grouped_gemm(dy.data(), dx.data(), d.slot_token(), d, wl);
    k3::cuda::synchronize();
    const auto y = widen(download(dy, static_cast<size_t>(S * N)));
    std::vector<int32_t> slot_of(static_cast<size_t>(S));
    k3::cuda::copy_to_host(slot_of.data(), d.slot_of(), slot_of.size() * 4);
    const std::vector<float> xf = widen(x);
    std::vector<float> ref(static_cast<size_t>(S * N)), got(static_cast<size_t>(S * N));
    for (int64_t i = 0; i < S; ++i) {
      WeightRef wr;
      wr.rows = N;
      wr.cols = Kd;
      if (mx) {
        wr.format = WeightRef::Format::MXFP4;
        wr.data = &m.packed[static_cast<size_t>(idx[static_cast<size_t>(i)] * N * Kd / 2)];
        wr.scales = &m.scales[static_cast<size_t>(idx[static_cast<size_t>(i)] * N * Kd / 32)];
      } else {
        wr.format = WeightRef::Format::BF16;
        wr.data = &w[static_cast<size_t>(idx[static_cast<size_t>(i)] * N * Kd)];
      }
      k3::linear_forward(&ref[static_cast<size_t>(i * N)], &xf[static_cast<size_t>((i / K) * Kd)], 1, wr);
      std::copy_n(&y[static_cast<size_t>(slot_of[static_cast<size_t>(i)] * N)], N, &got[static_cast<size_t>(i * N)]);
    }
    const double err = rel_l2(got, ref, mx ? "grouped_gemm MXFP4" : "grouped_gemm BF16");
    std::printf("[gemm] %s N=%lld K=%lld rel L2 %.3e (tol %.0e)\n", mx ? "MXFP4" : "BF16 ", (long long)N, (long long)Kd,
                err, kRelL2);
    EXPECT_LE(err, kRelL2);
  }
}

TEST(CudaMoeExperts, Bf16MatchesCpuTwin) {
  K3_REQUIRE_GPU();
  uint64_t seed = 100;
  for (int tm : {128, 64})
    for (const Case& c : kCases) run_experts_case(c, false, tm, seed++);
}

TEST(CudaMoeExperts, Mxfp4MatchesCpuTwin) {
  K3_REQUIRE_GPU();
  uint64_t seed = 200;
  for (int tm : {128, 64})
    for (const Case& c : kCases) run_experts_case(c, true, tm, seed++);
}

// MXFP4 weights give bit-for-bit the result of their bf16 dequantisation, including scales far from
// 1 (both decode paths: 2^(s-1) folded into one multiply for s <= 128, two multiplies above).
TEST(CudaMoeExperts, Mxfp4EqualsItsBf16Dequantisation) {
  K3_REQUIRE_GPU();
  const k3::GluParams gp{true, 4.0f, 25.0f};
  for (const Case& c : {kCases[1], kCases[3]}) {
    for (int wide_scales = 0; wide_scales < 2; ++wide_scales) {
      std::mt19937_64 r(300 + wide_scales);
      HostExperts hx = make_experts(true, c.E, c.L, c.I, r);
      if (wide_scales) {  // gate/up scales spread over 2^-30 .. 2^30 (outputs stay finite: SiTU-GLU is bounded)
        hx.m1 = random_mxfp4(c.E, c.I, c.L, 97, 157, r);
        hx.m3 = random_mxfp4(c.E, c.I, c.L, 97, 157, r);
        hx.w1 = dequant_bf16(hx.m1, c.E, c.I, c.L);
        hx.w3 = dequant_bf16(hx.m3, c.E, c.I, c.L);
      }
      const std::vector<bf16> z = random_bf16(static_cast<size_t>(c.T * c.L), 1.0f, r);
      const std::vector<int32_t> idx = skewed_idx(c.T, c.E, c.K, r);
      const std::vector<float> wt = random_weights(c.T * c.K, r);
      DevExperts dm, db;
      upload(dm, hx, true);
      upload(db, hx, false);
      const int tm = wide_scales ? 64 : 128;
      // MXFP4 runs on the mma.sync kernel; bf16 at TM 128 would take the wgmma kernel, so kMmaSync
      // keeps the bf16 run on the mma.sync kernel too (the claim is about one kernel's decoding).
      mc::GemmConfig mma;
      mma.kernel = mc::GemmConfig::Kernel::kMmaSync;
      const GpuOut gm = gpu_experts(dm, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, tm, mma);
      const GpuOut gb = gpu_experts(db, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, tm, mma);
      // Sorted row order depends on atomics, so compare u (token order) bitwise, and h as multisets of rows
      // would need the slot maps: u depends on every h row, which suffices.
      ASSERT_EQ(gm.u.size(), gb.u.size());
      size_t first_diff = gm.u.size();
      for (size_t i = 0; i < gm.u.size(); ++i)
        if (std::memcmp(&gm.u[i], &gb.u[i], 4) != 0) {
          first_diff = i;
          break;
        }
      EXPECT_EQ(first_diff, gm.u.size()) << c.name << " wide_scales=" << wide_scales << ": u differs at " << first_diff
                                         << " (" << gm.u[first_diff % gm.u.size()] << " vs "
                                         << gb.u[first_diff % gm.u.size()] << ")";
      for (float v : gm.u) ASSERT_TRUE(std::isfinite(v)) << c.name;
      std::printf("[mxfp4=bf16] %-10s wide_scales=%d: %s\n", c.name, wide_scales,
                  first_diff == gm.u.size() ? "bitwise equal" : "DIFFERENT");
    }
  }
}

// The GEMM configurations (mc::GemmConfig: tile raster, weight-tile height, skipping, grid size,
// schedule) only reorder the same per-element work: u must be bitwise the default's. Two families, each
// compared within itself: "default" (bf16 at TM 128 on the wgmma kernel, which ignores "narrow"; ctas=3
// runs it on 3 persistent CTAs, so each takes many items through its ring of item slots; "static" is
// its static schedule) and "mma.sync" (bf16 on the mma.sync kernel). MXFP4 and TM 64 always run on the
// mma.sync kernel, where "narrow" gives TM 128 lists the 128-row weight tiles MXFP4 takes at K > 12,672.
TEST(CudaMoeExperts, KernelVariantsAreBitwiseEqual) {
  K3_REQUIRE_GPU();
  const k3::GluParams gp{true, 4.0f, 25.0f};
  uint64_t seed = 700;
  for (bool mx : {false, true})
    for (const Case& c : kCases)
      for (int tm : {128, 64}) {
        std::mt19937_64 r(seed++);
        const HostExperts hx = make_experts(mx, c.E, c.L, c.I, r);
        const std::vector<bf16> z = random_bf16(static_cast<size_t>(c.T * c.L), 1.0f, r);
        const std::vector<int32_t> idx = skewed_idx(c.T, c.E, c.K, r);
        const std::vector<float> wt = random_weights(c.T * c.K, r);
        DevExperts dx;
        upload(dx, hx, mx);
        const std::vector<std::pair<const char*, std::vector<const char*>>> families = {
            {"default",
             {"row-major", "narrow", "row-major+narrow", "no-skip", "row-major+no-skip+narrow", "ctas=3",
              "row-major+no-skip+ctas=3", "static", "row-major+ctas=3+static", "no-skip+static"}},
            {"mma.sync",
             {"mma.sync+row-major", "mma.sync+narrow", "mma.sync+row-major+narrow", "mma.sync+no-skip",
              "mma.sync+row-major+no-skip+narrow"}}};
        for (const auto& [base, variants] : families) {
          const GpuOut g0 = gpu_experts(dx, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, tm, mc::parse_gemm_config(base));
          for (const char* v : variants) {
            const GpuOut gv = gpu_experts(dx, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, tm, mc::parse_gemm_config(v));
            ASSERT_EQ(gv.u.size(), g0.u.size());
            EXPECT_EQ(std::memcmp(gv.u.data(), g0.u.data(), g0.u.size() * 4), 0)
                << c.name << (mx ? " MXFP4" : " BF16") << " TM=" << tm << " variant " << v << " vs " << base;
          }
        }
      }
}

// Top-1 routing with exactly counts[e] tokens on expert e, tokens shuffled (so gathered rows are not
// in order).
std::vector<int32_t> idx_with_counts(const std::vector<int32_t>& counts, std::mt19937_64& r) {
  std::vector<int32_t> idx;
  for (size_t e = 0; e < counts.size(); ++e) idx.insert(idx.end(), static_cast<size_t>(counts[e]), int32_t(e));
  std::shuffle(idx.begin(), idx.end(), r);
  return idx;
}

// The Hopper wgmma kernel (bf16 weights, 128-row tiles) where its 128 × 256 × 64 tiles do not divide
// the problem: N not a multiple of 256 (gate/up: of 128), K not a multiple of 64 (and K = 8, below
// one k block), experts with 0, 1, 64, 65, 128, 129 and several tiles of rows (a tile's second 64
// rows empty: that consumer warpgroup idles), on the full grid and on 3 persistent CTAs (many work
// items per CTA, the stage ring running on across tiles). Against the CPU twin, and against the
// mma.sync kernel (GemmConfig::Kernel::kMmaSync) to the same tolerance (both run the same k16 steps in
// the same order, but nothing documents that wgmma and mma.sync round alike).
TEST(CudaMoeExperts, WgmmaKernelAwkwardShapes) {
  K3_REQUIRE_GPU();
  const k3::GluParams gp{true, 4.0f, 25.0f};
  struct WC {
    const char* name;
    int64_t T, E, K, L, I;
    std::vector<int32_t> counts;  // empty: skewed_idx
  };
  const WC cases[] = {
      {"odd-wide", 260, 6, 3, 1000, 264, {}},  // gate/up N 264, K 1000; down N 1000, K 264
      {"tiny-k", 70, 5, 2, 8, 24, {}},         // gate/up K 8; down N 8, K 24
      {"big-expert", 700, 4, 2, 136, 72, {}},  // expert 0: 700 rows, 6 tiles, the last of 60 rows
      {"counts", 0, 9, 1, 200, 136, {0, 1, 64, 65, 128, 129, 300, 7, 2}},
  };
  uint64_t seed = 900;
  for (const WC& c0 : cases) {
    WC c = c0;
    std::mt19937_64 r(seed++);
    std::vector<int32_t> idx;
    if (c.counts.empty()) {
      idx = skewed_idx(c.T, c.E, c.K, r);
    } else {
      idx = idx_with_counts(c.counts, r);
      c.T = int64_t(idx.size());
    }
    const HostExperts hx = make_experts(false, c.E, c.L, c.I, r);
    const std::vector<bf16> z = random_bf16(static_cast<size_t>(c.T * c.L), 1.0f, r);
    const std::vector<float> wt = random_weights(c.T * c.K, r);
    DevExperts dx;
    upload(dx, hx, false);
    const std::vector<float> ref = cpu_experts(hx, widen(z), idx, wt, c.T, c.K, gp);
    const mc::GemmConfig mma = mc::parse_gemm_config("mma.sync");
    const GpuOut g_mma = gpu_experts(dx, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, 128, mma);
    for (const char* v : {"default", "ctas=3", "static", "ctas=3+static"}) {
      const GpuOut g = gpu_experts(dx, z, idx, wt, c.T, c.E, c.K, c.L, c.I, gp, 128, mc::parse_gemm_config(v));
      const std::string what = std::string(c.name) + " wgmma variant " + v + " T=" + std::to_string(c.T) +
                               " L=" + std::to_string(c.L) + " I=" + std::to_string(c.I);
      const double err = rel_l2(g.u, ref, what);
      const double err_mma = rel_l2(g.u, g_mma.u, what + " vs mma.sync");
      std::printf("[wgmma] %-48s rel L2 %.3e vs CPU, %.3e vs mma.sync (tol %.0e)\n", what.c_str(), err, err_mma,
                  kRelL2);
      EXPECT_LE(err, kRelL2) << what;
      EXPECT_LE(err_mma, kRelL2) << what;
    }
  }
}

// Router -> dispatch -> experts on the GPU against the CPU router + experts (K3's routing rule).
TEST(CudaMoeExperts, RoutedLayerMatchesCpuTwin) {
  K3_REQUIRE_GPU();
  std::mt19937_64 r(555);
  const int64_t T = 70, E = 16, K = 4, L = 64, I = 64;
  const k3::GluParams gp{true, 4.0f, 25.0f};
  k3::moe::RouterParams p{E, K, 1, 1, true, 1.0f};
  std::normal_distribution<float> ld(0.0f, 2.0f), bd(0.0f, 0.1f);
  std::vector<float> logits(static_cast<size_t>(T * E)), bias(static_cast<size_t>(E));
  for (auto& x : logits) x = ld(r);
  for (auto& x : bias) x = bd(r);
  const HostExperts hx = make_experts(false, E, L, I, r);
  const std::vector<bf16> z = random_bf16(static_cast<size_t>(T * L), 1.0f, r);

  std::vector<int32_t> idx_c(static_cast<size_t>(T * K));
  std::vector<float> w_c(static_cast<size_t>(T * K));
  k3::moe::router_forward(idx_c.data(), w_c.data(), nullptr, logits.data(), bias.data(), T, p);
  const std::vector<float> ref = cpu_experts(hx, widen(z), idx_c, w_c, T, K, gp);

  DevExperts dx;
  upload(dx, hx, false);
  DeviceBuffer<float> dl(logits.data(), logits.size()), db(bias.data(), bias.size()), dw(static_cast<size_t>(T * K));
  DeviceBuffer<int32_t> di(static_cast<size_t>(T * K));
  DeviceBuffer<bf16> dz(z.data(), z.size()), h(static_cast<size_t>(T * K * I)), y(static_cast<size_t>(T * K * L));
  DeviceBuffer<float> u(static_cast<size_t>(T * L));
  mc::Dispatch d(T, E, K);
  mc::router_forward(di.data(), dw.data(), dl.data(), db.data(), T, p);
  d.build(di.data(), T);
  mc::experts_forward(u.data(), h.data(), y.data(), dz.data(), dw.data(), d, dx.w1, dx.w3, dx.w2, gp);
  k3::cuda::synchronize();
  const double err = rel_l2(download(u, static_cast<size_t>(T * L)), ref, "routed layer");
  std::printf("[routed layer] T=%lld E=%lld K=%lld rel L2 %.3e (tol %.0e)\n", (long long)T, (long long)E, (long long)K,
              err, kRelL2);
  EXPECT_LE(err, kRelL2);

  // The weighted sum and the latent norm in one launch: every row the RMSNorm (double here) of combine's own u,
  // with and without a weight, within one bf16 rounding.
  std::vector<float> nw(static_cast<size_t>(L));
  std::uniform_real_distribution<float> wd(0.5f, 1.5f);
  for (auto& x : nw) x = wd(r);
  const std::vector<float> uh = download(u, static_cast<size_t>(T * L));
  DeviceBuffer<float> dn(nw.data(), nw.size());
  DeviceBuffer<bf16> normed(static_cast<size_t>(T * L));
  for (const bool weighted : {true, false}) {
    mc::combine_rmsnorm(normed.data(), y.data(), dw.data(), d, L, weighted ? dn.data() : nullptr, 1e-5f);
    k3::cuda::synchronize();
    const std::vector<bf16> got = download(normed, static_cast<size_t>(T * L));
    double worst = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      double ss = 0.0;
      for (int64_t c = 0; c < L; ++c) ss += double(uh[size_t(t * L + c)]) * uh[size_t(t * L + c)];
      const double rr = 1.0 / std::sqrt(ss / double(L) + 1e-5);
      for (int64_t c = 0; c < L; ++c) {
        const double want = (weighted ? nw[size_t(c)] : 1.0) * uh[size_t(t * L + c)] * rr;
        const double g = k3::bf16_to_f32(got[size_t(t * L + c)]);
        worst = std::max(worst, std::abs(g - want) / std::max(std::abs(want), 1e-3));
      }
    }
    EXPECT_LE(worst, 1.0 / 256) << "combine_rmsnorm, weighted " << weighted;
  }
  EXPECT_NE(k3test::error_of([&] {
              mc::combine_rmsnorm(normed.data(), y.data(), dw.data(), d, 12, nullptr, 1e-5f);
            }).find("multiple of 8"),
            std::string::npos);

  // A decode step's experts as rows, in slot order and without a plan (expert_rows_cuda.h), on the same routing:
  // the first 1, 3 and 8 tokens' normed rows against the RMSNorm (double) of the CPU twin's aggregate.
  for (const int64_t Tn : {int64_t(1), int64_t(3), int64_t(8)}) {
    ASSERT_EQ(mc::expert_rows_can_run(dx.w1, dx.w3, dx.w2, Tn, K), "");
    DeviceBuffer<bf16> hr(static_cast<size_t>(Tn * K * I)), yr(static_cast<size_t>(Tn * K * L));
    mc::expert_rows_forward(hr.data(), yr.data(), dz.data(), di.data(), Tn, K, dx.w1, dx.w3, dx.w2, gp);
    mc::combine_rmsnorm(normed.data(), yr.data(), dw.data(), Tn, K, L, nullptr, nullptr, 1e-5f);
    k3::cuda::synchronize();
    const std::vector<float> got = widen(download(normed, static_cast<size_t>(Tn * L)));
    std::vector<float> want(static_cast<size_t>(Tn * L));
    for (int64_t t = 0; t < Tn; ++t) {
      double ss = 0.0;
      for (int64_t c = 0; c < L; ++c) ss += double(ref[size_t(t * L + c)]) * ref[size_t(t * L + c)];
      const double rr = 1.0 / std::sqrt(ss / double(L) + 1e-5);
      for (int64_t c = 0; c < L; ++c) want[size_t(t * L + c)] = float(ref[size_t(t * L + c)] * rr);
    }
    EXPECT_LE(rel_l2(got, want, "expert rows, " + std::to_string(Tn) + " tokens"), kRelL2);
  }
  EXPECT_NE(mc::expert_rows_can_run(dx.w1, dx.w3, dx.w2, 17, K).find("at most"), std::string::npos);
}

TEST(CudaMoe, RejectsShapesItCannotRun) {
  K3_REQUIRE_GPU();
  mc::ExpertLinear w;
  EXPECT_NE(mc::gemm_can_run(w).find("empty"), std::string::npos);
  DeviceBuffer<uint8_t> buf(4096);
  w = mc::ExpertLinear::mxfp4_stacked(buf.data(), buf.data(), 8, 48);
  EXPECT_NE(mc::gemm_can_run(w).find("multiple of 32"), std::string::npos) << mc::gemm_can_run(w);
  k3::moe::RouterParams p{10, 11, 1, 1, true, 1.0f};
  EXPECT_NE(mc::router_can_run(p).find("top_k"), std::string::npos);
  mc::Dispatch d(4, 8, 2);
  try {
    d.build(nullptr, 5);
    FAIL() << "build over capacity accepted";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity"), std::string::npos) << e.what();
  }
  mc::GemmConfig bad;
  bad.max_ctas = -1;
  const mc::ExpertLinear wb = mc::ExpertLinear::bf16_stacked(reinterpret_cast<const bf16*>(buf.data()), 8, 48);
  EXPECT_EQ(k3test::error_of([&] { mc::grouped_gemm(nullptr, nullptr, nullptr, d, wb, bad); }),
            "moe::cuda::grouped_gemm: GemmConfig::max_ctas must be >= 0 (0: one CTA per SM), got -1");
}

// The configuration names bench_cuda_moe --variants takes and the tests print (no GPU needed): the
// defaults, each part, the fixed order of gemm_config_name, the round trip, and refusals that name
// the bad part.
TEST(CudaMoeGemmConfig, NamesRoundTripAndBadNamesAreRefused) {
  const mc::GemmConfig d = mc::parse_gemm_config("default");
  EXPECT_EQ(d.kernel, mc::GemmConfig::Kernel::kAuto);
  EXPECT_TRUE(d.expert_raster);
  EXPECT_TRUE(d.skip_empty_rows);
  EXPECT_FALSE(d.narrow_weight_tiles);
  EXPECT_EQ(d.max_ctas, 0);
  EXPECT_TRUE(d.dynamic_schedule);
  EXPECT_EQ(mc::gemm_config_name(d), "default");
  EXPECT_EQ(mc::gemm_config_name(mc::GemmConfig{}), "default");

  const mc::GemmConfig all = mc::parse_gemm_config("static+ctas=3+narrow+no-skip+row-major+mma.sync");
  EXPECT_EQ(all.kernel, mc::GemmConfig::Kernel::kMmaSync);
  EXPECT_FALSE(all.expert_raster);
  EXPECT_FALSE(all.skip_empty_rows);
  EXPECT_TRUE(all.narrow_weight_tiles);
  EXPECT_EQ(all.max_ctas, 3);
  EXPECT_FALSE(all.dynamic_schedule);
  EXPECT_EQ(mc::gemm_config_name(all), "mma.sync+row-major+no-skip+narrow+ctas=3+static");
  for (const char* name : {"mma.sync", "row-major", "no-skip", "narrow", "ctas=132", "static", "mma.sync+narrow"})
    EXPECT_EQ(mc::gemm_config_name(mc::parse_gemm_config(name)), name);

  using k3test::error_of;
  EXPECT_EQ(error_of([] { mc::parse_gemm_config("fast"); }),
            "GEMM variant 'fast': unknown part 'fast' (expected default, or parts joined by '+': mma.sync, "
            "row-major, no-skip, narrow, ctas=N, static)");
  EXPECT_THAT(error_of([] { mc::parse_gemm_config(""); }), HasSubstr("unknown part ''"));
  EXPECT_THAT(error_of([] { mc::parse_gemm_config("mma.sync+"); }), HasSubstr("unknown part ''"));
  EXPECT_THAT(error_of([] { mc::parse_gemm_config("default+static"); }), HasSubstr("unknown part 'default'"));
  EXPECT_THAT(error_of([] { mc::parse_gemm_config("static+static"); }), HasSubstr("'static' given twice"));
  EXPECT_THAT(error_of([] { mc::parse_gemm_config("ctas=2+ctas=3"); }), HasSubstr("'ctas=' given twice"));
  for (const char* n : {"0", "-1", " 3", "x", "", "3x", "99999999999"})
    EXPECT_EQ(error_of([&] { mc::parse_gemm_config(std::string("ctas=") + n); }),
              std::string("GEMM variant 'ctas=") + n + "': ctas=N needs a positive integer N, got '" + n + "'");
}

// The gate/up epilogue (moe_glu: hardware tanh, exp and reciprocal) against the formula in double
// precision, element by element over g, u in ±60 (a log-spaced sweep from 1e-6 and a linear one), for
// SiTU at K3's betas and at 1, and for SwiGLU. Its relative error must stay below 2^-9, the bf16 rounding
// every output element gets next, so it adds less than the output's own rounding.
TEST(CudaMoeExperts, FastGluIsWithinBf16Rounding) {
  K3_REQUIRE_GPU();
  std::vector<float> axis;
  for (double m = 1e-6; m < 60; m *= 1.07) axis.insert(axis.end(), {float(m), float(-m)});
  for (int i = -600; i <= 600; ++i) axis.push_back(0.1f * float(i));
  std::vector<float> g, u;
  for (float a : axis)
    for (int j = 0; j < int(axis.size()); j += 7) {
      g.push_back(a);
      u.push_back(axis[size_t(j)]);
    }
  const size_t n = g.size();
  DeviceBuffer<float> dg(g.data(), n), du(u.data(), n), dy(n);
  for (const k3::GluParams glu :
       {k3::GluParams{true, 4.0f, 25.0f}, k3::GluParams{true, 1.0f, 1.0f}, k3::GluParams{false, 1.0f, 1.0f}}) {
    mc::glu_eval(dy.data(), dg.data(), du.data(), int64_t(n), glu);
    const std::vector<float> y = download(dy, n);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < n; ++i) {
      const double gd = g[i], ud = u[i], sg = 1.0 / (1.0 + std::exp(-gd));
      const double ref =
          glu.situ ? glu.beta_gate * std::tanh(gd / glu.beta_gate) * sg * glu.beta_up * std::tanh(ud / glu.beta_up)
                   : gd * sg * ud;
      ASSERT_TRUE(std::isfinite(y[i])) << "g " << g[i] << " u " << u[i];
      if (std::fabs(ref) < 1e-30) continue;  // σ(g) underflows in fp32 anyway
      const double rel = std::fabs(y[i] - ref) / std::fabs(ref);
      if (rel > worst) worst = rel, at = i;
    }
    std::printf("[glu] situ=%d beta %g/%g: max relative error %.3e (2^%.2f) at g %g u %g\n", int(glu.situ),
                glu.beta_gate, glu.beta_up, worst, std::log2(worst), g[at], u[at]);
    EXPECT_LT(worst, std::ldexp(1.0, -9)) << "at g " << g[at] << " u " << u[at];
  }
}
