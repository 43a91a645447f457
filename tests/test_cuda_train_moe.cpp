// GPU training of Stable LatentMoE and the GLU MLP (kernels/moe/moe_train_cuda.h,
// kernels/ffn/glu_train_cuda.h) against the float64 CPU twins, on random inputs of awkward sizes:
//   - GLU backward (and the fp32 forward) against k3::glu_backward / glu_forward (ffn/glu.h), SiTU and
//     SwiGLU, |g|, |u| up to 60;
//   - the router's forward (idx exact, weight, scores, sel_sum) and backward against the f64
//     router_forward (moe/router.h) and the router loop of moe_ffn_backward, with a bias, with and
//     without renormalisation, with group-limited routing, with exact ties;
//   - the dispatch (bit-exact against a stable CPU sort), the row gather/scatter and the combine;
//   - a whole LatentMoE layer composed from these pieces plus cuBLAS linears against moe_ffn_forward /
//     moe_ffn_backward (model/training/ffn_block.h) on a ParamStore: output, dx, every gradient.
//     The latent RMSNorm's forward is norm::cuda::rmsnorm_forward; its backward runs on the host in
//     float64 from the GPU's fp32 tensors (its GPU twin lives with the norm kernels).
//     The router's linear stays fp32 in both modes, so the selection is the f64 one.
//
// Tolerances (relative L2, non-finite values fail first):
//   - fp32 math against f64 on the same fp32 inputs: 1e-5 (the fp32 roundings along each chain are
//     ~1e-7 relative; the pedantic fp32 GEMMs add ~2^-24·sqrt(K) with K <= 80);
//   - the fp32 GLU forward: 1e-6 (a few ulps of tanhf/expf per element);
//   - sums of <= 8 fp32 terms and fp64 dots rounded once (dispatch rows): 1e-6;
//   - the LatentMoE with bf16 GEMM operands: 1e-2 (each operand is one bf16 rounding, 2^-9 relative,
//     along chains of <= 6 GEMMs; fp32 accumulation).
// Selections: inputs are redrawn (per token) until the f64 routing has no near-tie closer than 1e-5
// (router, fp32 logits) or 1e-4 (layer, logits from fp32 GEMMs), so idx must match exactly; exact
// ties are built on purpose and must go to the lower index in both.
// Outputs start as NaN, so an element a kernel forgets to write fails the finite check.
// Skips without a Hopper GPU (K3_REQUIRE_GPU); the float64 references run either way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "util/cuda_test.h"

#if defined(K3_HAVE_CUDA)

#include "core/cuda.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/ffn/glu.h"
#include "kernels/ffn/glu_cuda.h"
#include "kernels/ffn/glu_train_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/gemm/linear_cuda.h"
#include "kernels/moe/moe_cuda.h"
#include "kernels/moe/moe_train_cuda.h"
#include "kernels/moe/router.h"
#include "kernels/norm/norm.h"
#include "kernels/norm/norm_cuda.h"
#include "model/config.h"
#include "model/layers.h"
#include "model/params.h"
#include "model/tensor_table.h"
#include "model/training/ffn_block.h"

namespace {

namespace mc = k3::moe::cuda;
namespace gc = k3::gemm::cuda;
using k3::DType;
using k3::TensorKind;
using k3::cuda::DeviceBuffer;
using k3::moe::RouterParams;
using k3::train::ParamStore;

// ---- helpers ----------------------------------------------------------------------------------------

template <class T>
DeviceBuffer<T> to_device(const std::vector<T>& h) {
  return DeviceBuffer<T>(h.data(), h.size());
}
// A device buffer of n NaNs (unwritten outputs fail the finite check).
DeviceBuffer<float> nan_buffer(size_t n) { return to_device(std::vector<float>(n, NAN)); }
DeviceBuffer<float> zero_buffer(size_t n) { return to_device(std::vector<float>(n, 0.0f)); }
template <class T>
std::vector<T> to_host(const DeviceBuffer<T>& d, size_t n) {
  std::vector<T> h(n);
  d.download(h.data(), n);
  return h;
}
std::vector<double> widen(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
std::vector<float> narrow(const double* v, size_t n) {
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = float(v[i]);
  return f;
}

// ||got - ref|| / ||ref|| (ref float64); +inf with a failure naming the element when got is not finite.
double rel_l2(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  if (got.size() != ref.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(ref[i])) {
      ADD_FAILURE() << what << ": non-finite value at " << i << " (got " << got[i] << ", ref " << ref[i] << ")";
      return INFINITY;
    }
    const double d = double(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}

// ---- 1. GLU -----------------------------------------------------------------------------------------

void glu_case(const k3::GluParams& p, const char* name) {
  const int64_t n = 10007;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> wide(-60.0f, 60.0f);
  std::normal_distribution<float> mid(0.0f, 3.0f), unit(0.0f, 1.0f);
  std::vector<float> g(static_cast<size_t>(n)), u(static_cast<size_t>(n)), dh(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    g[size_t(i)] = i % 2 ? wide(rng) : mid(rng);
    u[size_t(i)] = i % 3 ? wide(rng) : mid(rng);
    dh[size_t(i)] = unit(rng);
  }
  // Named points: zeros, the ±60 ends, a tiny gate.
  g[0] = 0.0f, u[0] = 0.0f, g[1] = 60.0f, g[2] = -60.0f, u[3] = 60.0f, u[4] = -60.0f, g[5] = 1e-30f;
  const std::vector<double> g64 = widen(g), u64 = widen(u), dh64 = widen(dh);
  std::vector<double> dg64(static_cast<size_t>(n)), du64(static_cast<size_t>(n)), h64(static_cast<size_t>(n));
  k3::glu_backward(dg64.data(), du64.data(), dh64.data(), g64.data(), u64.data(), n, p);
  k3::glu_forward(h64.data(), g64.data(), u64.data(), n, p);

  K3_REQUIRE_GPU();
  DeviceBuffer<float> gd = to_device(g), ud = to_device(u), dhd = to_device(dh);
  DeviceBuffer<float> dg = nan_buffer(size_t(n)), du = nan_buffer(size_t(n)), h = nan_buffer(size_t(n));
  k3::ffn::cuda::glu_backward_train(dg.data(), du.data(), dhd.data(), gd.data(), ud.data(), n, p);
  k3::ffn::cuda::glu_forward(h.data(), gd.data(), ud.data(), n, p);
  const std::vector<float> dg_h = to_host(dg, size_t(n)), du_h = to_host(du, size_t(n));
  const double e_dg = rel_l2(dg_h, dg64, std::string(name) + " dg");
  const double e_du = rel_l2(du_h, du64, std::string(name) + " du");
  const double e_h = rel_l2(to_host(h, size_t(n)), h64, std::string(name) + " h");
  EXPECT_LE(e_dg, 1e-5) << name;
  EXPECT_LE(e_du, 1e-5) << name;
  EXPECT_LE(e_h, 1e-6) << name << ": the fp32 glu_forward is not the f64 glu_forward to fp32 rounding";
  std::printf("glu %s: rel L2 dg %.2e du %.2e h %.2e\n", name, e_dg, e_du, e_h);

  // In place: dg over dh, then du over dh; the same bits as out of place.
  DeviceBuffer<float> a = to_device(dh), other = nan_buffer(size_t(n));
  k3::ffn::cuda::glu_backward_train(a.data(), other.data(), a.data(), gd.data(), ud.data(), n, p);
  EXPECT_EQ(to_host(a, size_t(n)), dg_h) << name << ": dg aliasing dh";
  EXPECT_EQ(to_host(other, size_t(n)), du_h) << name << ": du beside dg aliasing dh";
  DeviceBuffer<float> b = to_device(dh), other2 = nan_buffer(size_t(n));
  k3::ffn::cuda::glu_backward_train(other2.data(), b.data(), b.data(), gd.data(), ud.data(), n, p);
  EXPECT_EQ(to_host(b, size_t(n)), du_h) << name << ": du aliasing dh";
  EXPECT_EQ(to_host(other2, size_t(n)), dg_h) << name << ": dg beside du aliasing dh";
}

TEST(CudaTrainMoe, GluBackwardSiTU) { glu_case(k3::GluParams{true, 4.0f, 25.0f}, "SiTU"); }
TEST(CudaTrainMoe, GluBackwardSwiGLU) { glu_case(k3::GluParams{false, 4.0f, 25.0f}, "SwiGLU"); }
// Small caps: the tanh curvature of both factors over most of the range, a beta that is not a power of 2.
TEST(CudaTrainMoe, GluBackwardSiTUSmallCaps) { glu_case(k3::GluParams{true, 1.5f, 3.0f}, "SiTU b=1.5,3"); }

// ---- 2. router --------------------------------------------------------------------------------------

// True when the f64 routing of one token (logits [E]) is decided by margins of at least `margin`:
// consecutive scores of the selection order down to the first unselected differ by >= margin or are
// exactly equal (a tie built on purpose: equal logit and bias, so equal in fp32 too, and broken to
// the lower index by both routers); with a group limit, the last kept and first dropped group scores
// differ by >= margin.
bool robust_routing(const double* logits, const double* bias, const RouterParams& p, double margin) {
  const int64_t E = p.num_experts, K = p.top_k, G = p.num_groups, per = E / G;
  std::vector<double> sel(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) sel[size_t(e)] = k3::sigmoid_stable(logits[e]) + (bias ? bias[e] : 0.0);
  if (G > 1 && p.topk_groups < G) {
    std::vector<double> gs(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(v.rbegin(), v.rend());
      gs[size_t(g)] = per >= 2 ? v[0] + v[1] : v[0];
    }
    std::vector<int64_t> order(static_cast<size_t>(G));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return gs[size_t(a)] > gs[size_t(b)]; });
    if (gs[size_t(order[size_t(p.topk_groups - 1)])] - gs[size_t(order[size_t(p.topk_groups)])] < margin) return false;
    for (int64_t r = p.topk_groups; r < G; ++r)
      for (int64_t e = order[size_t(r)] * per; e < (order[size_t(r)] + 1) * per; ++e) sel[size_t(e)] = -INFINITY;
  }
  std::vector<double> v;
  for (double s : sel)
    if (s > -INFINITY) v.push_back(s);
  std::sort(v.rbegin(), v.rend());
  for (int64_t k = 0; k < K && k + 1 < int64_t(v.size()); ++k)
    if (v[size_t(k)] != v[size_t(k + 1)] && v[size_t(k)] - v[size_t(k + 1)] < margin) return false;
  return true;
}

// The router part of moe_ffn_backward (model/training/ffn_block.cpp), written out again in f64.
std::vector<double> router_backward_f64(const std::vector<double>& dw, const std::vector<double>& scores,
                                        const std::vector<int32_t>& idx, const std::vector<double>& sel_sum, int64_t N,
                                        const RouterParams& p) {
  const int64_t E = p.num_experts, K = p.top_k;
  const double c = double(p.scaling);
  std::vector<double> dl(size_t(N * E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const double* s = &scores[size_t(n * E)];
    const double S = sel_sum[size_t(n)] + 1e-20;
    double dot = 0.0;
    for (int64_t k = 0; k < K; ++k) dot += dw[size_t(n * K + k)] * s[idx[size_t(n * K + k)]];
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[size_t(n * K + k)];
      const double g = dw[size_t(n * K + k)];
      const double ds = p.renormalize ? c * (g / S - dot / (S * S)) : c * g;
      dl[size_t(n * E + e)] = ds * s[e] * (1.0 - s[e]);
    }
  }
  return dl;
}

struct RouterCase {
  const char* name;
  int64_t E, K, G, topk_groups;
  bool renormalize;
  float scaling;
  bool bias, null_sel_sum;
};

void router_case(const RouterCase& rc) {
  const RouterParams p{rc.E, rc.K, rc.G, rc.topk_groups, rc.renormalize, rc.scaling};
  const int64_t N = 203, E = rc.E, K = rc.K;
  std::mt19937_64 rng(uint64_t(E * 131 + K));
  std::normal_distribution<float> nl(0.0f, 2.0f), nb(0.0f, 0.05f), nd(0.0f, 1.0f);
  std::vector<float> bias(size_t(E), 0.0f);
  if (rc.bias) {
    for (float& b : bias) b = nb(rng);
    bias[1] = bias[2] = 0.3f;  // experts 1 and 2 tie exactly, above every other, on the rows built below
  }
  std::vector<float> logits(size_t(N * E));
  const std::vector<double> bias64 = widen(bias);
  for (int64_t n = 0; n < N; ++n) {
    float* row = &logits[size_t(n * E)];
    std::vector<double> row64(static_cast<size_t>(E));
    for (int tries = 0;; ++tries) {
      ASSERT_LT(tries, 1000) << rc.name << ": no robust routing drawn for token " << n;
      for (int64_t e = 0; e < E; ++e) row[e] = nl(rng);
      if (n % 10 == 3) row[1] = row[2] = 12.0f;  // an exact tie at the top of the selection
      for (int64_t e = 0; e < E; ++e) row64[size_t(e)] = row[e];
      if (robust_routing(row64.data(), rc.bias ? bias64.data() : nullptr, p, 1e-5)) break;
    }
  }
  std::vector<float> dweight(size_t(N * K));
  for (float& v : dweight) v = nd(rng);

  const std::vector<double> logits64 = widen(logits);
  std::vector<int32_t> idx64(size_t(N * K));
  std::vector<double> w64(size_t(N * K)), s64(size_t(N * E)), sum64(static_cast<size_t>(N));
  k3::moe::router_forward(idx64.data(), w64.data(), s64.data(), sum64.data(), logits64.data(),
                          rc.bias ? bias64.data() : nullptr, N, p);
  for (int64_t n = 3; n < N; n += 10)
    ASSERT_TRUE(idx64[size_t(n * K)] == 1 && idx64[size_t(n * K + 1)] == 2)
        << rc.name << ": the built tie is not the top pair of token " << n;
  const std::vector<double> dl64 = router_backward_f64(widen(dweight), s64, idx64, sum64, N, p);

  K3_REQUIRE_GPU();
  DeviceBuffer<float> ld = to_device(logits), bd = to_device(bias), dwd = to_device(dweight);
  DeviceBuffer<int32_t> idx(size_t(N * K));
  DeviceBuffer<float> w = nan_buffer(size_t(N * K)), s = nan_buffer(size_t(N * E)), sum = nan_buffer(size_t(N));
  mc::router_forward_train(idx.data(), w.data(), s.data(), sum.data(), ld.data(), rc.bias ? bd.data() : nullptr, N, p);
  const std::vector<int32_t> idx_h = to_host(idx, size_t(N * K));
  ASSERT_EQ(idx_h, idx64) << rc.name << ": selection differs from the f64 router";
  const std::vector<float> w_h = to_host(w, size_t(N * K));
  const double e_w = rel_l2(w_h, w64, std::string(rc.name) + " weight");
  const double e_s = rel_l2(to_host(s, size_t(N * E)), s64, std::string(rc.name) + " scores");
  const double e_sum = rel_l2(to_host(sum, size_t(N)), sum64, std::string(rc.name) + " sel_sum");
  EXPECT_LE(e_w, 1e-5) << rc.name;
  EXPECT_LE(e_s, 1e-5) << rc.name;
  EXPECT_LE(e_sum, 1e-5) << rc.name;

  // The inference entry point runs the same kernel: the same bits.
  DeviceBuffer<int32_t> idx2(size_t(N * K));
  DeviceBuffer<float> w2 = nan_buffer(size_t(N * K));
  mc::router_forward(idx2.data(), w2.data(), ld.data(), rc.bias ? bd.data() : nullptr, N, p);
  EXPECT_EQ(to_host(idx2, size_t(N * K)), idx_h) << rc.name;
  EXPECT_EQ(to_host(w2, size_t(N * K)), w_h) << rc.name;

  DeviceBuffer<float> dl = nan_buffer(size_t(N * E));
  mc::router_backward_train(dl.data(), dwd.data(), s.data(), idx.data(), rc.null_sel_sum ? nullptr : sum.data(), N, p);
  const std::vector<float> dl_h = to_host(dl, size_t(N * E));
  const double e_dl = rel_l2(dl_h, dl64, std::string(rc.name) + " dlogits");
  EXPECT_LE(e_dl, 1e-5) << rc.name;
  for (size_t i = 0; i < dl_h.size(); ++i)
    if (dl64[i] == 0.0) {
      ASSERT_EQ(dl_h[i], 0.0f) << rc.name << ": an unselected expert's dlogit at " << i;
    }
  std::printf("router %s: rel L2 weight %.2e scores %.2e sel_sum %.2e dlogits %.2e\n", rc.name, e_w, e_s, e_sum, e_dl);
}

TEST(CudaTrainMoe, Router) {
  const RouterCase cases[] = {
      {"E16K4", 16, 4, 1, 1, true, 1.0f, true, false},
      {"E16K4-nobias", 16, 4, 1, 1, true, 1.0f, false, false},
      {"E16K4-plain-scaled", 16, 4, 1, 1, false, 2.5f, true, true},
      {"E32K6-groups4of2", 32, 6, 4, 2, true, 2.5f, true, false},
      {"E64K8-groups8of3-plain", 64, 8, 8, 3, false, 1.0f, true, false},
      {"E384K8", 384, 8, 1, 1, true, 2.827f, true, false},  // more experts than the kernels' threads
  };
  for (const RouterCase& rc : cases) {
    SCOPED_TRACE(rc.name);
    router_case(rc);  // without a GPU: each case's f64 part, then a skip
    if (HasFatalFailure()) return;
  }
}

TEST(CudaTrainMoe, RouterRejectsBadParams) {
  K3_REQUIRE_GPU();
  const RouterParams bad{16, 17, 1, 1, true, 1.0f};  // top-k above E
  EXPECT_THROW(mc::router_forward_train(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 1, bad), k3::Error);
  EXPECT_THROW(mc::router_backward_train(nullptr, nullptr, nullptr, nullptr, nullptr, 1, bad), k3::Error);
  const RouterParams renorm{16, 4, 1, 1, true, 1.0f};
  DeviceBuffer<float> f(64);
  DeviceBuffer<int32_t> i(4);
  EXPECT_THROW(mc::router_backward_train(f.data(), f.data(), f.data(), i.data(), nullptr, 1, renorm), k3::Error)
      << "renormalised routing needs sel_sum";
}

// ---- 3. dispatch and rows -----------------------------------------------------------------------------

// idx [N, K]: distinct experts per token, never an expert e with e % 5 == 4 (empty experts), and
// expert 0 in about half the tokens (an uneven load).
std::vector<int32_t> random_idx(int64_t N, int64_t E, int64_t K, std::mt19937_64& rng) {
  std::vector<int32_t> allowed;
  for (int32_t e = 0; e < E; ++e)
    if (e % 5 != 4) allowed.push_back(e);
  std::vector<int32_t> idx(size_t(N * K));
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int32_t> a = allowed;
    std::shuffle(a.begin(), a.end(), rng);
    if (rng() % 2) std::swap(a[0], *std::find(a.begin(), a.end(), 0));
    std::copy_n(a.begin(), K, &idx[size_t(n * K)]);
  }
  return idx;
}

void dispatch_case(int64_t capacity, int64_t N, int64_t E, int64_t K, int64_t L) {
  const std::string name =
      "N=" + std::to_string(N) + " E=" + std::to_string(E) + " K=" + std::to_string(K) + " L=" + std::to_string(L);
  std::mt19937_64 rng(uint64_t(N * 7 + E));
  const std::vector<int32_t> idx = random_idx(N, E, K, rng);
  const int64_t S = N * K;
  // The stable sort: expert by expert, slots in flat (token-ascending) order.
  std::vector<int64_t> offsets(size_t(E + 1), 0);
  std::vector<int32_t> pos(static_cast<size_t>(S)), token(static_cast<size_t>(S));
  int64_t r = 0;
  for (int64_t e = 0; e < E; ++e) {
    offsets[size_t(e)] = r;
    for (int64_t i = 0; i < S; ++i)
      if (idx[size_t(i)] == e) {
        pos[size_t(i)] = int32_t(r);
        token[size_t(r)] = int32_t(i / K);
        ++r;
      }
  }
  offsets[size_t(E)] = r;
  // Row data and the host results of the row functions.
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto randv = [&](size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = nd(rng);
    return v;
  };
  const std::vector<float> x = randv(size_t(N * L)), ys = randv(size_t(S * L)), w = randv(size_t(S)),
                           dagg = randv(size_t(N * L));
  std::vector<double> scat(size_t(N * L), 0.0), agg(size_t(N * L), 0.0), dwt(size_t(S), 0.0);
  std::vector<float> xs(size_t(S * L)), dy(size_t(S * L));
  for (int64_t i = 0; i < S; ++i) {
    const int64_t n = i / K, p = pos[size_t(i)];
    for (int64_t c = 0; c < L; ++c) {
      xs[size_t(p * L + c)] = x[size_t(n * L + c)];
      scat[size_t(n * L + c)] += ys[size_t(p * L + c)];
      agg[size_t(n * L + c)] += double(w[size_t(i)]) * ys[size_t(p * L + c)];
      dy[size_t(p * L + c)] = w[size_t(i)] * dagg[size_t(n * L + c)];
      dwt[size_t(i)] += double(dagg[size_t(n * L + c)]) * ys[size_t(p * L + c)];
    }
  }

  K3_REQUIRE_GPU();
  mc::TrainDispatch d(capacity, E, K);
  DeviceBuffer<int32_t> idx_d = to_device(idx);
  d.build(idx_d.data(), N);
  ASSERT_EQ(d.tokens(), N) << name;
  ASSERT_EQ(d.rows(), S) << name;
  ASSERT_EQ(d.offsets(), offsets) << name;
  std::vector<int32_t> off_dev(size_t(E + 1));
  k3::cuda::copy_to_host(off_dev.data(), d.offsets_device(), off_dev.size() * sizeof(int32_t));
  for (int64_t e = 0; e <= E; ++e) ASSERT_EQ(off_dev[size_t(e)], offsets[size_t(e)]) << name << " expert " << e;
  std::vector<int32_t> pos_d(static_cast<size_t>(S)), token_d(static_cast<size_t>(S));
  k3::cuda::copy_to_host(pos_d.data(), d.pos(), size_t(S) * sizeof(int32_t));
  k3::cuda::copy_to_host(token_d.data(), d.token(), size_t(S) * sizeof(int32_t));
  ASSERT_EQ(pos_d, pos) << name;
  ASSERT_EQ(token_d, token) << name;

  DeviceBuffer<float> xd = to_device(x), ysd = to_device(ys), wd = to_device(w), daggd = to_device(dagg);
  DeviceBuffer<float> xs_d = nan_buffer(size_t(S * L)), scat_d = nan_buffer(size_t(N * L)),
                      agg_d = nan_buffer(size_t(N * L)), dy_d = nan_buffer(size_t(S * L)),
                      dwt_d = nan_buffer(size_t(S));
  mc::gather_sorted_rows(xs_d.data(), xd.data(), d, L);
  mc::scatter_sorted_rows(scat_d.data(), ysd.data(), d, N, L);
  mc::combine_forward_train(agg_d.data(), ysd.data(), wd.data(), d, N, L);
  mc::combine_backward_train(dy_d.data(), dwt_d.data(), daggd.data(), ysd.data(), wd.data(), d, N, L);
  EXPECT_EQ(to_host(xs_d, size_t(S * L)), xs) << name << ": gather";
  EXPECT_EQ(to_host(dy_d, size_t(S * L)), dy) << name << ": combine backward dy";
  EXPECT_LE(rel_l2(to_host(scat_d, size_t(N * L)), scat, name + " scatter"), 1e-6);
  EXPECT_LE(rel_l2(to_host(agg_d, size_t(N * L)), agg, name + " combine"), 1e-6);
  EXPECT_LE(rel_l2(to_host(dwt_d, size_t(S)), dwt, name + " dweight"), 1e-6);
}

TEST(CudaTrainMoe, DispatchAndRows) {
  dispatch_case(1, 1, 8, 3, 24);
  dispatch_case(64, 37, 8, 3, 24);       // capacity above N
  dispatch_case(1500, 1500, 37, 6, 37);  // 9000 slots: three chunks of 4096
  dispatch_case(5000, 5000, 384, 8, 8);  // 40000 slots, ten chunks; more experts than threads
}

TEST(CudaTrainMoe, DispatchReuseEmptyAndBadIndex) {
  K3_REQUIRE_GPU();
  const int64_t E = 8, K = 2;
  mc::TrainDispatch d(10, E, K);
  const std::vector<int32_t> a = {3, 1, 1, 3, 0, 3};  // tokens 0..2
  DeviceBuffer<int32_t> ad = to_device(a);
  d.build(ad.data(), 3);
  EXPECT_EQ(d.offsets(), (std::vector<int64_t>{0, 1, 3, 3, 6, 6, 6, 6, 6}));
  std::vector<int32_t> pos(6);
  k3::cuda::copy_to_host(pos.data(), d.pos(), 6 * sizeof(int32_t));
  EXPECT_EQ(pos, (std::vector<int32_t>{3, 1, 2, 4, 0, 5}));
  d.build(ad.data(), 0);  // no tokens: every expert empty
  EXPECT_EQ(d.offsets(), std::vector<int64_t>(size_t(E + 1), 0));
  EXPECT_EQ(d.rows(), 0);
  const std::vector<int32_t> bad = {3, 1, 8, 2};
  DeviceBuffer<int32_t> bd = to_device(bad);
  try {
    d.build(bd.data(), 2);
    ADD_FAILURE() << "an expert index of E must throw";
  } catch (const k3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 expert indices outside [0, 8)"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(d.offsets().empty()) << "a failed build leaves the dispatch unbuilt";
  EXPECT_THROW(d.build(ad.data(), 11), k3::Error) << "over capacity";
  EXPECT_THROW(mc::TrainDispatch(10, 8, 9), k3::Error) << "K > E";
}

// ---- 4. a whole LatentMoE layer -------------------------------------------------------------------

// The test's dense GEMMs in one operand mode: fp32 (pedantic, TF32 off) or bf16 copies of both
// operands made on the device (kept alive until the object goes).
class Gemms {
 public:
  Gemms(gc::GemmContext& ctx, bool bf16) : ctx_(ctx), bf16_(bf16) {}
  DType type() const { return bf16_ ? DType::BF16 : DType::F32; }
  // p [n] fp32 as a GEMM operand of type().
  const void* op(const float* p, int64_t n) {
    if (!bf16_) return p;
    keep_.emplace_back(size_t(n));
    gc::convert_f32_to_bf16(keep_.back().data(), p, n);
    return keep_.back().data();
  }
  // y [M, N] (+)= x [M, K] · W [N, K]ᵀ
  void fwd(float* y, const float* x, const float* W, int64_t M, int64_t N, int64_t K, bool acc = false) {
    gc::LinearParams p;
    p.y = y, p.y_type = DType::F32, p.x = op(x, M * K), p.w = op(W, N * K), p.in_type = type();
    p.M = M, p.N = N, p.K = K, p.accumulate = acc;
    gc::linear_forward(ctx_, p);
  }
  // dx [M, K] (+)= dy [M, N] · W [N, K]
  void bwd_data(float* dx, const float* dy, const float* W, int64_t M, int64_t N, int64_t K, bool acc) {
    gc::LinearParams p;
    p.y = dx, p.y_type = DType::F32, p.x = op(dy, M * N), p.w = op(W, N * K), p.in_type = type();
    p.w_in_out = true, p.M = M, p.N = K, p.K = N, p.accumulate = acc;
    gc::linear_forward(ctx_, p);
  }
  // dW [N, K] += dy [M, N]ᵀ · x [M, K]
  void bwd_weight(float* dW, const float* dy, const float* x, int64_t M, int64_t N, int64_t K) {
    gc::WeightGradParams p;
    p.dw = dW, p.dy = op(dy, M * N), p.x = op(x, M * K), p.in_type = type(), p.M = M, p.N = N, p.K = K;
    gc::linear_weight_grad(ctx_, p);
  }

 private:
  gc::GemmContext& ctx_;
  bool bf16_;
  std::vector<DeviceBuffer<uint16_t>> keep_;
};

struct MoeCase {
  const char* name;
  k3::Activation act;
  bool renormalize, grouped;
  float scaling;
};

void latent_moe_case(const MoeCase& mcase, bool bf16) {
  const std::string name = std::string(mcase.name) + (bf16 ? " bf16" : " fp32");
  k3::K3Config c;
  c.source = "test_cuda_train_moe";
  c.hidden_size = 48;
  c.hidden_act = mcase.act;
  c.num_experts = 8;
  c.num_experts_per_token = 3;
  c.num_shared_experts = 2;
  c.moe_intermediate_size = 40;
  c.routed_expert_hidden_size = 24;
  c.latent_moe_use_norm = true;
  c.moe_renormalize = mcase.renormalize;
  c.routed_scaling_factor = mcase.scaling;
  c.use_grouped_topk = mcase.grouped;
  c.num_expert_group = 4;
  c.topk_group = 2;
  const int64_t N = 37, D = c.hidden_size, E = c.num_experts, K = c.num_experts_per_token;
  const int64_t L = c.routed_expert_hidden_size, I = c.moe_intermediate_size, SI = c.shared_intermediate();
  const int64_t S = N * K;
  const RouterParams rp = k3::router_params(c);
  const k3::GluParams glu = k3::glu_params(c);
  const std::string pre = "layers.3.";
  auto tn = [&](TensorKind k, int64_t e = -1) { return k3::tensor_name_at(pre, k, e); };

  // Parameters in f64 holding fp32 values (the GPU gets exactly them).
  std::mt19937_64 rng(99);
  std::normal_distribution<double> nd(0.0, 1.0);
  ParamStore P;
  auto add = [&](const std::string& n, const std::vector<int64_t>& shape, double sd, double mean = 0.0) {
    P.add(n, shape);
    double* v = P.p_mut(n);
    for (int64_t i = 0; i < P.numel(n); ++i) v[i] = double(float(mean + sd * nd(rng)));
  };
  add(tn(TensorKind::MoeRouter), {E, D}, 1.0 / std::sqrt(double(D)));
  add(tn(TensorKind::MoeRouterBias), {E}, 0.05);
  P.p_mut(tn(TensorKind::MoeRouterBias))[E - 1] = -10.0;  // never selected: an expert with no rows
  add(tn(TensorKind::MoeLatentDown), {L, D}, 1.0 / std::sqrt(double(D)));
  add(tn(TensorKind::MoeLatentUp), {D, L}, 1.0 / std::sqrt(double(L)));
  add(tn(TensorKind::MoeLatentNorm), {L}, 0.2, 1.0);
  for (int64_t e = 0; e < E; ++e) {
    add(tn(TensorKind::ExpertGate, e), {I, L}, 1.5 / std::sqrt(double(L)));
    add(tn(TensorKind::ExpertUp, e), {I, L}, 1.5 / std::sqrt(double(L)));
    add(tn(TensorKind::ExpertDown, e), {L, I}, 1.0 / std::sqrt(double(I)));
  }
  add(tn(TensorKind::SharedGate), {SI, D}, 1.5 / std::sqrt(double(D)));
  add(tn(TensorKind::SharedUp), {SI, D}, 1.5 / std::sqrt(double(D)));
  add(tn(TensorKind::SharedDown), {D, SI}, 1.0 / std::sqrt(double(SI)));

  // x: rows redrawn until their routing has margins of 1e-4; dy.
  const double* Wr = P.p(tn(TensorKind::MoeRouter));
  const double* bias = P.p(tn(TensorKind::MoeRouterBias));
  std::vector<double> x(size_t(N * D)), dy(size_t(N * D));
  for (int64_t n = 0; n < N; ++n) {
    double* row = &x[size_t(n * D)];
    for (int tries = 0;; ++tries) {
      ASSERT_LT(tries, 1000) << name << ": no robust routing drawn for token " << n;
      for (int64_t j = 0; j < D; ++j) row[j] = double(float(nd(rng)));
      std::vector<double> lg(size_t(E), 0.0);
      for (int64_t e = 0; e < E; ++e)
        for (int64_t j = 0; j < D; ++j) lg[size_t(e)] += row[j] * Wr[e * D + j];
      if (robust_routing(lg.data(), bias, rp, 1e-4)) break;
    }
  }
  for (double& v : dy) v = double(float(nd(rng)));

  // The float64 truth.
  k3::train::MoeTape t;
  std::vector<double> y64(size_t(N * D)), dx64(size_t(N * D));
  P.zero_grads();
  k3::train::moe_ffn_forward(P, pre, c, 3, x.data(), N, y64.data(), &t, bias);
  k3::train::moe_ffn_backward(P, pre, c, 3, t, dy.data(), dx64.data());
  ASSERT_TRUE(t.rows[size_t(E - 1)].empty()) << name;
  int busy = 0;
  for (const auto& rows : t.rows) busy += rows.size() >= 2;
  ASSERT_GE(busy, 3) << name << ": too few experts with several rows";

  K3_REQUIRE_GPU();
  gc::GemmContext ctx;
  Gemms G(ctx, bf16), G32(ctx, false);  // the router's linear is fp32 in both modes
  const DType type = G.type();
  auto dev = [&](const std::string& n) {
    const std::vector<float> v = narrow(P.p(n), size_t(P.numel(n)));
    return to_device(v);
  };
  auto dev_stacked = [&](TensorKind k) {  // [E, rows, cols] from the per-expert tensors
    std::vector<float> v;
    for (int64_t e = 0; e < E; ++e) {
      const std::string n = tn(k, e);
      const std::vector<float> part = narrow(P.p(n), size_t(P.numel(n)));
      v.insert(v.end(), part.begin(), part.end());
    }
    return to_device(v);
  };
  DeviceBuffer<float> xd = to_device(narrow(x.data(), x.size())), dyd = to_device(narrow(dy.data(), dy.size()));
  DeviceBuffer<float> Wrd = dev(tn(TensorKind::MoeRouter)), biasd = dev(tn(TensorKind::MoeRouterBias));
  DeviceBuffer<float> Wdn = dev(tn(TensorKind::MoeLatentDown)), Wup = dev(tn(TensorKind::MoeLatentUp));
  DeviceBuffer<float> gamma = dev(tn(TensorKind::MoeLatentNorm));
  DeviceBuffer<float> W1 = dev_stacked(TensorKind::ExpertGate), W3 = dev_stacked(TensorKind::ExpertUp),
                      W2 = dev_stacked(TensorKind::ExpertDown);
  DeviceBuffer<float> Wsg = dev(tn(TensorKind::SharedGate)), Wsu = dev(tn(TensorKind::SharedUp)),
                      Wsd = dev(tn(TensorKind::SharedDown));

  // ---- forward
  DeviceBuffer<float> logits = nan_buffer(size_t(N * E)), w = nan_buffer(size_t(N * K)),
                      scores = nan_buffer(size_t(N * E)), sel_sum = nan_buffer(size_t(N));
  DeviceBuffer<int32_t> idx(size_t(N * K));
  G32.fwd(logits.data(), xd.data(), Wrd.data(), N, E, D);  // [N, E]
  mc::router_forward_train(idx.data(), w.data(), scores.data(), sel_sum.data(), logits.data(), biasd.data(), N, rp);
  DeviceBuffer<float> z = nan_buffer(size_t(N * L));
  G.fwd(z.data(), xd.data(), Wdn.data(), N, L, D);  // [N, L]
  mc::TrainDispatch d(N, E, K);
  d.build(idx.data(), N);
  ASSERT_EQ(to_host(idx, size_t(N * K)), t.topk) << name << ": selection differs from the f64 layer's";
  for (int64_t e = 0; e < E; ++e)
    ASSERT_EQ(d.offsets()[size_t(e + 1)] - d.offsets()[size_t(e)], int64_t(t.rows[size_t(e)].size())) << name;
  EXPECT_LE(rel_l2(to_host(w, size_t(N * K)), t.weight, name + " weight"), 1e-5);
  DeviceBuffer<float> zs = nan_buffer(size_t(S * L)), g = nan_buffer(size_t(S * I)), u = nan_buffer(size_t(S * I)),
                      h = nan_buffer(size_t(S * I)), ye = nan_buffer(size_t(S * L));
  mc::gather_sorted_rows(zs.data(), z.data(), d, L);  // [S, L]
  const void* zs_op = G.op(zs.data(), S * L);
  mc::experts_linear_forward(ctx, g.data(), zs_op, G.op(W1.data(), E * I * L), type, d, I, L);  // [S, I]
  mc::experts_linear_forward(ctx, u.data(), zs_op, G.op(W3.data(), E * I * L), type, d, I, L);  // [S, I]
  k3::ffn::cuda::glu_forward(h.data(), g.data(), u.data(), S * I, glu);
  mc::experts_linear_forward(ctx, ye.data(), G.op(h.data(), S * I), G.op(W2.data(), E * L * I), type, d, L, I);
  DeviceBuffer<float> agg = nan_buffer(size_t(N * L)), normed = nan_buffer(size_t(N * L));
  mc::combine_forward_train(agg.data(), ye.data(), w.data(), d, N, L);  // [N, L]
  k3::norm::cuda::rmsnorm_forward(normed.data(), agg.data(), gamma.data(), float(c.rms_norm_eps), N, L);
  DeviceBuffer<float> y = nan_buffer(size_t(N * D)), sg = nan_buffer(size_t(N * SI)), su = nan_buffer(size_t(N * SI)),
                      sh = nan_buffer(size_t(N * SI));
  G.fwd(y.data(), normed.data(), Wup.data(), N, D, L);  // [N, D]
  G.fwd(sg.data(), xd.data(), Wsg.data(), N, SI, D);    // shared experts on x
  G.fwd(su.data(), xd.data(), Wsu.data(), N, SI, D);
  k3::ffn::cuda::glu_forward(sh.data(), sg.data(), su.data(), N * SI, glu);
  G.fwd(y.data(), sh.data(), Wsd.data(), N, D, SI, /*acc=*/true);

  // ---- backward (parameter gradients start at zero and accumulate)
  const size_t nW1 = size_t(E * I * L);
  DeviceBuffer<float> dWr = zero_buffer(size_t(E * D)), dWdn = zero_buffer(size_t(L * D)),
                      dWup = zero_buffer(size_t(D * L)), dW1 = zero_buffer(nW1), dW3 = zero_buffer(nW1),
                      dW2 = zero_buffer(nW1), dWsg = zero_buffer(size_t(SI * D)), dWsu = zero_buffer(size_t(SI * D)),
                      dWsd = zero_buffer(size_t(D * SI));
  DeviceBuffer<float> dx = nan_buffer(size_t(N * D)), dsh = nan_buffer(size_t(N * SI)),
                      dsg = nan_buffer(size_t(N * SI)), dsu = nan_buffer(size_t(N * SI));
  G.bwd_weight(dWsd.data(), dyd.data(), sh.data(), N, D, SI);
  G.bwd_data(dsh.data(), dyd.data(), Wsd.data(), N, D, SI, false);
  k3::ffn::cuda::glu_backward_train(dsg.data(), dsu.data(), dsh.data(), sg.data(), su.data(), N * SI, glu);
  G.bwd_weight(dWsg.data(), dsg.data(), xd.data(), N, SI, D);
  G.bwd_weight(dWsu.data(), dsu.data(), xd.data(), N, SI, D);
  G.bwd_data(dx.data(), dsg.data(), Wsg.data(), N, SI, D, false);
  G.bwd_data(dx.data(), dsu.data(), Wsu.data(), N, SI, D, true);
  DeviceBuffer<float> dnormed = nan_buffer(size_t(N * L));
  G.bwd_weight(dWup.data(), dyd.data(), normed.data(), N, D, L);
  G.bwd_data(dnormed.data(), dyd.data(), Wup.data(), N, D, L, false);
  // The latent RMSNorm's backward, in f64 on the host from the GPU's fp32 tensors.
  const std::vector<double> agg64 = widen(to_host(agg, size_t(N * L))),
                            dnormed64 = widen(to_host(dnormed, size_t(N * L)));
  std::vector<double> dagg64(size_t(N * L)), dgamma64(size_t(L), 0.0);
  k3::rmsnorm_backward(dagg64.data(), dgamma64.data(), dnormed64.data(), agg64.data(),
                       P.p(tn(TensorKind::MoeLatentNorm)), c.rms_norm_eps, N, L);
  DeviceBuffer<float> dagg = to_device(narrow(dagg64.data(), dagg64.size()));
  DeviceBuffer<float> dye = nan_buffer(size_t(S * L)), dwt = nan_buffer(size_t(N * K)), dh = nan_buffer(size_t(S * I)),
                      dg = nan_buffer(size_t(S * I)), du = nan_buffer(size_t(S * I)), dzs = nan_buffer(size_t(S * L)),
                      dz = nan_buffer(size_t(N * L)), dlogits = nan_buffer(size_t(N * E));
  mc::combine_backward_train(dye.data(), dwt.data(), dagg.data(), ye.data(), w.data(), d, N, L);
  const void* dye_op = G.op(dye.data(), S * L);
  mc::experts_linear_backward_weight(ctx, dW2.data(), dye_op, G.op(h.data(), S * I), type, d, L, I);
  mc::experts_linear_backward_data(ctx, dh.data(), dye_op, G.op(W2.data(), E * L * I), type, d, L, I);
  k3::ffn::cuda::glu_backward_train(dg.data(), du.data(), dh.data(), g.data(), u.data(), S * I, glu);
  const void* dg_op = G.op(dg.data(), S * I);
  const void* du_op = G.op(du.data(), S * I);
  mc::experts_linear_backward_weight(ctx, dW1.data(), dg_op, zs_op, type, d, I, L);
  mc::experts_linear_backward_weight(ctx, dW3.data(), du_op, zs_op, type, d, I, L);
  mc::experts_linear_backward_data(ctx, dzs.data(), dg_op, G.op(W1.data(), E * I * L), type, d, I, L);
  mc::experts_linear_backward_data(ctx, dzs.data(), du_op, G.op(W3.data(), E * I * L), type, d, I, L,
                                   /*accumulate=*/true);
  mc::scatter_sorted_rows(dz.data(), dzs.data(), d, N, L);
  G.bwd_weight(dWdn.data(), dz.data(), xd.data(), N, L, D);
  G.bwd_data(dx.data(), dz.data(), Wdn.data(), N, L, D, true);
  mc::router_backward_train(dlogits.data(), dwt.data(), scores.data(), idx.data(), sel_sum.data(), N, rp);
  G32.bwd_weight(dWr.data(), dlogits.data(), xd.data(), N, E, D);
  G32.bwd_data(dx.data(), dlogits.data(), Wrd.data(), N, E, D, true);

  // ---- compare
  const double tol = bf16 ? 1e-2 : 1e-5;
  auto grad_of = [&](TensorKind k) {
    const std::string n = tn(k);
    return std::vector<double>(P.g(n), P.g(n) + P.numel(n));
  };
  auto grad_stacked = [&](TensorKind k) {
    std::vector<double> v;
    for (int64_t e = 0; e < E; ++e) {
      const std::string n = tn(k, e);
      v.insert(v.end(), P.g(n), P.g(n) + P.numel(n));
    }
    return v;
  };
  struct Item {
    const char* what;
    std::vector<float> got;
    std::vector<double> ref;
  };
  const std::vector<Item> items = {
      {"y", to_host(y, size_t(N * D)), y64},
      {"dx", to_host(dx, size_t(N * D)), dx64},
      {"d router", to_host(dWr, size_t(E * D)), grad_of(TensorKind::MoeRouter)},
      {"d latent down", to_host(dWdn, size_t(L * D)), grad_of(TensorKind::MoeLatentDown)},
      {"d latent up", to_host(dWup, size_t(D * L)), grad_of(TensorKind::MoeLatentUp)},
      {"d latent norm", narrow(dgamma64.data(), dgamma64.size()), grad_of(TensorKind::MoeLatentNorm)},
      {"d experts w1", to_host(dW1, nW1), grad_stacked(TensorKind::ExpertGate)},
      {"d experts w3", to_host(dW3, nW1), grad_stacked(TensorKind::ExpertUp)},
      {"d experts w2", to_host(dW2, nW1), grad_stacked(TensorKind::ExpertDown)},
      {"d shared gate", to_host(dWsg, size_t(SI * D)), grad_of(TensorKind::SharedGate)},
      {"d shared up", to_host(dWsu, size_t(SI * D)), grad_of(TensorKind::SharedUp)},
      {"d shared down", to_host(dWsd, size_t(D * SI)), grad_of(TensorKind::SharedDown)},
  };
  std::string line = name + ":";
  for (const Item& it : items) {
    const double e = rel_l2(it.got, it.ref, name + " " + it.what);
    EXPECT_LE(e, tol) << name << " " << it.what;
    char buf[64];
    std::snprintf(buf, sizeof buf, " %s %.1e", it.what, e);
    line += buf;
  }
  std::printf("%s\n", line.c_str());
  // The expert that no token selected keeps a zero gradient (its GEMMs are skipped).
  const std::vector<float> dW1_h = to_host(dW1, nW1);
  for (int64_t i = (E - 1) * I * L; i < E * I * L; ++i) ASSERT_EQ(dW1_h[size_t(i)], 0.0f) << name << " at " << i;
}

TEST(CudaTrainMoe, LatentMoeSiTUGroupedRenormFp32) {
  latent_moe_case({"SiTU grouped renorm x2.5", k3::Activation::SiTU, true, true, 2.5f}, false);
}
TEST(CudaTrainMoe, LatentMoeSiTUGroupedRenormBf16) {
  latent_moe_case({"SiTU grouped renorm x2.5", k3::Activation::SiTU, true, true, 2.5f}, true);
}
TEST(CudaTrainMoe, LatentMoeSwiGLUPlainFp32) {
  latent_moe_case({"SwiGLU plain", k3::Activation::SiLU, false, false, 1.0f}, false);
}
TEST(CudaTrainMoe, LatentMoeSwiGLUPlainBf16) {
  latent_moe_case({"SwiGLU plain", k3::Activation::SiLU, false, false, 1.0f}, true);
}

}  // namespace

#else  // no CUDA backend in this build: nothing to link against

TEST(CudaTrainMoe, NeedsTheCudaBackend) { GTEST_SKIP() << "this build has no CUDA backend"; }

#endif
