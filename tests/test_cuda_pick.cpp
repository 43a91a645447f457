// Token picks on the GPU (kernels/sample/pick_cuda.h) against the host's definition (model/generate.h:
// pick_on_host): greedy ids equal always; temperature ids equal wherever the draw is not within a whisker of a
// boundary between two ids (the one place the two sums' rounding orders may disagree); the non-finite check.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "model/generate.h"
#include "model/sampler.h"
#include "util/cuda_test.h"
#ifdef K3_HAVE_CUDA
#include "kernels/sample/pick_cuda.h"
#endif

namespace {

#ifdef K3_HAVE_CUDA
using k3::sample::cuda::PickRow;

struct Picked {
  std::vector<int32_t> ids, bad;
  std::vector<double> logprob;
};

Picked pick_on_gpu(const std::vector<float>& logits, int64_t V, const std::vector<PickRow>& rows) {
  const int64_t B = int64_t(rows.size());
  k3::cuda::DeviceBuffer<float> l(logits.data(), logits.size());
  k3::cuda::DeviceBuffer<uint8_t> r(reinterpret_cast<const uint8_t*>(rows.data()), rows.size() * sizeof(PickRow));
  k3::cuda::DeviceBuffer<int32_t> out(size_t(2 * B));
  k3::cuda::DeviceBuffer<double> lp(static_cast<size_t>(B));
  k3::sample::cuda::pick_tokens(l.data(), B, V, reinterpret_cast<const PickRow*>(r.data()), out.data(), out.data() + B,
                                lp.data());
  std::vector<int32_t> h(size_t(2 * B));
  out.download(h.data(), h.size());
  std::vector<double> hl(static_cast<size_t>(B));
  lp.download(hl.data(), hl.size());
  return {std::vector<int32_t>(h.begin(), h.begin() + B), std::vector<int32_t>(h.begin() + B, h.end()), hl};
}

// Whether u's target lies within a relative 1e-9 of a boundary of the host's running sum (or of its end).
bool near_boundary(const float* l, int64_t V, float T, double u) {
  double mx = -INFINITY;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(l[v]));
  std::vector<double> p(static_cast<size_t>(V));
  double z = 0.0;
  for (int64_t v = 0; v < V; ++v) z += (p[size_t(v)] = std::exp((double(l[v]) - mx) / double(T)));
  const double target = u * z, eps = 1e-9 * z;
  double cum = 0.0;
  for (int64_t v = 0; v < V; ++v) {
    cum += p[size_t(v)];
    if (std::abs(cum - target) < eps) return true;
  }
  return false;
}
#endif

}  // namespace

TEST(CudaPick, GreedyAndTemperatureFollowTheHostRule) {
  K3_REQUIRE_GPU();
#ifdef K3_HAVE_CUDA
  for (const int64_t V : {int64_t(7), int64_t(1000), int64_t(163840)}) {
    std::mt19937 rng(static_cast<uint32_t>(V));
    std::normal_distribution<float> nd(0.0f, 3.0f);
    std::uniform_real_distribution<double> ud(0.0, 1.0);
    const std::vector<float> temps = {0.05f, 0.6f, 1.0f, 2.5f};
    std::vector<PickRow> rows;
    std::vector<float> logits;
    for (int i = 0; i < 24; ++i) {
      std::vector<float> row(static_cast<size_t>(V));
      for (auto& x : row) x = nd(rng);
      if (i % 6 == 1) row[size_t(V / 2)] = row[size_t(V / 3)] = 50.0f;  // a tie for the maximum: the lower id
      if (i % 6 == 2)
        for (int64_t v = 0; v < V; v += 3) row[size_t(v)] = -INFINITY;  // masked ids are never drawn
      logits.insert(logits.end(), row.begin(), row.end());
      PickRow r;
      r.mode = i % 3 == 0 ? 1 : 2;
      r.temperature = temps[size_t(i) % temps.size()];
      r.uniform = i % 8 == 7 ? 0.0 : ud(rng);
      rows.push_back(r);
    }
    const Picked got = pick_on_gpu(logits, V, rows);
    int compared = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      const float* l = logits.data() + i * size_t(V);
      EXPECT_EQ(got.bad[i], 0) << "row " << i;
      k3::TokenPick p;
      p.pick = true, p.greedy = rows[i].mode == 1, p.temperature = rows[i].temperature, p.uniform = rows[i].uniform;
      if (!p.greedy && near_boundary(l, V, p.temperature, p.uniform)) continue;
      ++compared;
      p.want_logprob = !p.greedy;
      const k3::PickResult want = k3::pick_on_host(std::vector<float>(l, l + V), p);
      EXPECT_EQ(got.ids[i], want.id) << "V " << V << " row " << i << (p.greedy ? " greedy" : " temperature");
      // The sampled id's log-probability (an RL rollout's behaviour log-probability): the host's, up to the order
      // of the double sums.
      if (p.greedy) EXPECT_TRUE(std::isnan(got.logprob[i])) << "row " << i;
      else EXPECT_NEAR(got.logprob[i], want.logprob, 1e-12 * (1.0 + std::abs(want.logprob))) << "row " << i;
    }
    EXPECT_GE(compared, 20) << "V " << V;
  }
#endif
}

TEST(CudaPick, NonFiniteRowsAreFlagged) {
  K3_REQUIRE_GPU();
#ifdef K3_HAVE_CUDA
  const int64_t V = 5000;
  std::vector<float> logits(size_t(5 * V), 0.25f);
  logits[size_t(0 * V + 4321)] = std::numeric_limits<float>::quiet_NaN();
  logits[size_t(1 * V + 17)] = INFINITY;
  for (int64_t v = 0; v < V; ++v) logits[size_t(2 * V + v)] = -INFINITY;
  logits[size_t(3 * V + 99)] = -INFINITY;  // -inf alone is a mask, not an error
  logits[size_t(4 * V + 1)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<PickRow> rows(5);
  for (auto& r : rows) r.mode = 2, r.uniform = 0.5;
  rows[4].mode = 0;  // checked though not picked
  const Picked got = pick_on_gpu(logits, V, rows);
  EXPECT_EQ(got.bad, (std::vector<int32_t>{1, 1, 1, 0, 1}));
  EXPECT_EQ(got.ids[0], -1);
  EXPECT_EQ(got.ids[4], -1);
  EXPECT_GE(got.ids[3], 0);
  EXPECT_NE(got.ids[3], 99);
#endif
}
