// The float64 training ops (kernels/: linear_f64, norm, attnres, loss) against central finite differences,
// forwards against the inference kernels (fp32) on the same inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "kernels/attnres/attnres.h"
#include "kernels/gemm/linear_f64.h"
#include "kernels/loss/cross_entropy.h"
#include "kernels/norm/norm.h"
#include "util/finite_diff.h"

using namespace k3;

namespace {

std::vector<double> randn(size_t n, std::mt19937& rng, double scale = 1.0) {
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = d(rng);
  return v;
}

// Central difference of f at every entry of v, against the analytic gradient `g`.
void expect_fd(const std::function<double()>& f, std::vector<double>& v, const std::vector<double>& g,
               const char* what) {
  ASSERT_EQ(v.size(), g.size());
  const double eps = 1e-6;
  for (size_t i = 0; i < v.size(); ++i) {
    const double num = k3test::central_difference(&v[i], f, eps);
    EXPECT_NEAR(g[i], num, 1e-7 + 1e-6 * std::abs(num)) << what << "[" << i << "]";
  }
}

}  // namespace

TEST(TrainOps, LinearBackwardMatchesFiniteDifferences) {
  std::mt19937 rng(1);
  const int64_t N = 3, in = 5, out = 4;
  std::vector<double> x = randn(N * in, rng), W = randn(out * in, rng), R = randn(N * out, rng);
  auto loss = [&] {
    std::vector<double> y(N * out);
    linear_forward(y.data(), x.data(), W.data(), N, in, out);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * R[i];
    return s;
  };
  std::vector<double> dx(N * in), dW(out * in, 0.0);
  linear_backward(dx.data(), dW.data(), R.data(), x.data(), W.data(), N, in, out);
  expect_fd(loss, x, dx, "dx");
  expect_fd(loss, W, dW, "dW");
}

// The batch-invariant forward (RL's deterministic mode): every row of a product is the same bits whatever rows came
// with it (here: alone, in a batch of 37, strided), and the product is dgemm's to rounding. Sizes with a remainder
// after the four interleaved sums, and large enough that threads share the work.
TEST(TrainOps, BatchInvariantLinearRowsDoNotDependOnTheBatch) {
  std::mt19937 rng(2);
  const int64_t N = 37, in = 203, out = 130;
  const std::vector<double> x = randn(N * in, rng), W = randn(out * in, rng);
  std::vector<double> blas(N * out), batch(N * out), strided(N * (out + 3));
  linear_forward(blas.data(), x.data(), W.data(), N, in, out);
  struct Off {  // however the test ends, the tests after it run with the default
    ~Off() { set_f64_batch_invariant(false); }
  } off;
  set_f64_batch_invariant(true);
  linear_forward(batch.data(), x.data(), W.data(), N, in, out);
  linear_forward_strided(strided.data(), out + 3, x.data(), in, W.data(), N, in, out);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> alone(out);
    linear_forward(alone.data(), x.data() + n * in, W.data(), 1, in, out);
    for (int64_t o = 0; o < out; ++o) {
      ASSERT_EQ(alone[o], batch[n * out + o]) << "row " << n << " output " << o;
      ASSERT_EQ(strided[n * (out + 3) + o], batch[n * out + o]) << "row " << n << " output " << o;
      EXPECT_NEAR(batch[n * out + o], blas[n * out + o], 1e-12 * std::sqrt(double(in))) << n << ", " << o;
    }
  }
}

TEST(TrainOps, RmsNormBackwardMatchesFiniteDifferencesAndForwardMatchesKernel) {
  std::mt19937 rng(2);
  const int64_t N = 3, D = 6;
  std::vector<double> x = randn(N * D, rng), w = randn(D, rng), R = randn(N * D, rng);
  auto loss = [&] {
    std::vector<double> y(N * D);
    rmsnorm_forward(y.data(), x.data(), w.data(), 1e-6, N, D);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * R[i];
    return s;
  };
  std::vector<double> dx(N * D), dw(D, 0.0);
  rmsnorm_backward(dx.data(), dw.data(), R.data(), x.data(), w.data(), 1e-6, N, D);
  expect_fd(loss, x, dx, "dx");
  expect_fd(loss, w, dw, "dw");
  // The inference kernel computes the same function.
  std::vector<float> xf(x.begin(), x.end()), wf(w.begin(), w.end()), yf(N * D);
  k3::rmsnorm_forward(yf.data(), xf.data(), wf.data(), 1e-6f, N, D);
  std::vector<double> y(N * D);
  rmsnorm_forward(y.data(), x.data(), w.data(), 1e-6, N, D);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(yf[i], y[i], 1e-5 * (1 + std::abs(y[i])));
}

TEST(TrainOps, AttnResBackwardMatchesFiniteDifferencesAndForwardMatchesKernel) {
  std::mt19937 rng(3);
  const int64_t N = 2, D = 5;
  const int S = 4;
  std::vector<std::vector<double>> v;
  for (int i = 0; i < S; ++i) v.push_back(randn(N * D, rng));
  std::vector<double> q = randn(D, rng), R = randn(N * D, rng);
  auto srcs = [&] {
    std::vector<const double*> p;
    for (auto& s : v) p.push_back(s.data());
    return p;
  };
  auto loss = [&] {
    std::vector<double> y(N * D);
    attnres_forward(y.data(), srcs(), q.data(), 1e-6, N, D);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * R[i];
    return s;
  };
  std::vector<std::vector<double>> dv(S, std::vector<double>(N * D, 0.0));
  std::vector<double*> dp;
  for (auto& d : dv) dp.push_back(d.data());
  std::vector<double> dq(D, 0.0);
  attnres_backward(dp, dq.data(), R.data(), srcs(), q.data(), 1e-6, N, D);
  for (int i = 0; i < S; ++i) expect_fd(loss, v[size_t(i)], dv[size_t(i)], "dsrc");
  expect_fd(loss, q, dq, "dq");
  std::vector<std::vector<float>> vf;
  std::vector<const float*> pf;
  for (auto& s : v) vf.emplace_back(s.begin(), s.end());
  for (auto& s : vf) pf.push_back(s.data());
  std::vector<float> qf(q.begin(), q.end()), yf(N * D);
  k3::attnres_forward(yf.data(), pf.data(), S, N, D, qf.data(), 1e-6f);
  std::vector<double> y(N * D);
  attnres_forward(y.data(), srcs(), q.data(), 1e-6, N, D);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(yf[i], y[i], 1e-5 * (1 + std::abs(y[i])));
}

TEST(TrainOps, CrossEntropyBackwardMatchesFiniteDifferences) {
  std::mt19937 rng(4);
  const int64_t N = 3, V = 7;
  std::vector<double> l = randn(N * V, rng, 3.0);
  const std::vector<int32_t> t = {2, -1, 6};
  auto loss = [&] { return cross_entropy(l.data(), t.data(), N, V, nullptr, 1.0) * 0.5; };
  std::vector<double> dl(N * V);
  const double got = cross_entropy(l.data(), t.data(), N, V, dl.data(), 0.5);
  expect_fd(loss, l, dl, "dlogits");
  // Independent value: -log softmax by hand for row 0.
  double z = 0;
  for (int v = 0; v < V; ++v) z += std::exp(l[size_t(v)]);
  double z2 = 0;
  for (int v = 0; v < V; ++v) z2 += std::exp(l[size_t(2 * V + v)]);
  EXPECT_NEAR(got, (std::log(z) - l[2]) + (std::log(z2) - l[size_t(2 * V + 6)]), 1e-12);
}
