// What the forward's non-finite checks cost (model/nonfinite.h): first_nonfinite over a block output,
// against an isfinite() loop as the baseline (timed in the same run), and against the arithmetic of
// the block it guards.
//
//   build/bench_finite_scan [--rows 512] [--hidden 128,256,3584] [--reps 50]
//
// For each hidden size D it scans rows x D floats (one block output of a prefill of `rows` tokens)
// and prints the median time per scan, GB/s, the speed-up over the isfinite() loop, and the scan's
// share of the cheapest matrix product a block does on that output (rows x D x D multiply-adds at
// the machine's measured sgemm rate): a bound from above of the checks' share of a forward.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/finite.h"

namespace {

using clock_type = std::chrono::steady_clock;

template <class Fn>
double median_seconds(int reps, Fn&& fn) {
  std::vector<double> t;
  fn();  // warm-up
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    fn();
    t.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int64_t isfinite_loop(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cost of the forward's non-finite checks"};
  int64_t rows = 512;
  std::vector<int64_t> hidden = {128, 256, 3584};
  int reps = 50;
  app.add_option("--rows", rows, "token rows of a block output")->capture_default_str();
  app.add_option("--hidden", hidden, "hidden sizes")->delimiter(',');
  app.add_option("--reps", reps, "timed repetitions (median reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  std::printf("%8s %8s %12s %10s %14s %10s %16s\n", "rows", "hidden", "scan (us)", "GB/s", "isfinite (us)", "speed-up",
              "share of x*W");
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t D : hidden) {
    const int64_t n = rows * D;
    std::vector<float> x(static_cast<size_t>(n)), w(static_cast<size_t>(D * D)), y(static_cast<size_t>(n));
    for (auto& v : x) v = d(rng);
    for (auto& v : w) v = d(rng) * 0.01f;
    volatile int64_t sink = 0;
    const double scan = median_seconds(reps, [&] { sink = k3::first_nonfinite(x.data(), n); });
    const double loop = median_seconds(reps, [&] { sink = isfinite_loop(x.data(), n); });
    const double gemm = median_seconds(std::max(3, reps / 10), [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(D), int(D), 1.0f, x.data(), int(D), w.data(),
                  int(D), 0.0f, y.data(), int(D));
    });
    (void)sink;
    std::printf("%8lld %8lld %12.2f %10.2f %14.2f %9.2fx %15.3f%%\n", (long long)rows, (long long)D, scan * 1e6,
                double(n) * 4 / scan / 1e9, loop * 1e6, loop / scan, 100.0 * scan / gemm);
  }
  return 0;
}
