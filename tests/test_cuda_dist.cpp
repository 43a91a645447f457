// The NCCL group (dist/nccl_group.h) on the GPUs of one process's view: a communicator of one rank over the world
// group (a process started without mpirun). Skipped without a Hopper GPU; the multi-rank runs of the same
// collectives are `mpirun -np N` runs of this binary on a multi-GPU machine (each rank one GPU): with N > 1 ranks
// every test below checks the N-rank results instead.
#include <gtest/gtest.h>

#include <numeric>

#include "core/cuda.h"
#include "core/error.h"
#include "dist/group.h"
#include "dist/nccl_group.h"
#include "util/cuda_test.h"

namespace {

k3::dist::NcclGroup& group() {
  static k3::dist::NcclGroup g(k3::dist::world(), /*timeout_s=*/120.0);
  return g;
}

}  // namespace

TEST(NcclGroup, AllReduceSumsEveryRanksValues) {
  K3_REQUIRE_GPU();
  k3::dist::NcclGroup& g = group();
  const int R = g.size(), r = g.rank();
  std::vector<float> f(1000);
  std::vector<double> d(1000);
  for (size_t i = 0; i < f.size(); ++i) {
    f[i] = float(i % 7) + float(r);
    d[i] = double(i) * 0.25 + double(r) * 1e-3;
  }
  k3::cuda::DeviceBuffer<float> df(f.data(), f.size());
  k3::cuda::DeviceBuffer<double> dd(d.data(), d.size());
  g.all_reduce_sum(df.data(), int64_t(f.size()), nullptr);
  g.all_reduce_sum(dd.data(), int64_t(d.size()), nullptr);
  g.synchronize(nullptr, "all-reduce");
  df.download(f.data(), f.size());
  dd.download(d.data(), d.size());
  const double rank_sum = double(R) * double(R - 1) / 2.0;
  for (size_t i = 0; i < f.size(); ++i) {
    EXPECT_EQ(f[i], float(R) * float(i % 7) + float(rank_sum)) << i;
    EXPECT_NEAR(d[i], double(R) * double(i) * 0.25 + rank_sum * 1e-3, 1e-12) << i;
  }
}

TEST(NcclGroup, AllToAllDeliversEachRanksBlocks) {
  K3_REQUIRE_GPU();
  k3::dist::NcclGroup& g = group();
  const int R = g.size(), r = g.rank();
  // Rank r sends q + 1 values of (r · 100 + q) to rank q: block sizes differ per destination, as a dispatch's do.
  std::vector<int64_t> sb(static_cast<size_t>(R)), so(static_cast<size_t>(R)), rb(static_cast<size_t>(R)),
      ro(static_cast<size_t>(R));
  std::vector<int32_t> send;
  for (int q = 0; q < R; ++q) {
    so[size_t(q)] = int64_t(send.size()) * 4;
    for (int i = 0; i <= q; ++i) send.push_back(r * 100 + q);
    sb[size_t(q)] = int64_t(q + 1) * 4;
    ro[size_t(q)] = int64_t(q) * int64_t(r + 1) * 4;
    rb[size_t(q)] = int64_t(r + 1) * 4;
  }
  k3::cuda::DeviceBuffer<int32_t> ds(send.data(), send.size()), dr(size_t(R) * size_t(r + 1));
  g.all_to_all_bytes(ds.data(), sb, so, dr.data(), rb, ro, nullptr);
  g.synchronize(nullptr, "all-to-all");
  std::vector<int32_t> got(size_t(R) * size_t(r + 1));
  dr.download(got.data(), got.size());
  for (int q = 0; q < R; ++q)
    for (int i = 0; i <= r; ++i) EXPECT_EQ(got[size_t(q * (r + 1) + i)], q * 100 + r) << "from rank " << q;
}

TEST(NcclGroup, AllGatherConcatenatesInRankOrder) {
  K3_REQUIRE_GPU();
  k3::dist::NcclGroup& g = group();
  const int R = g.size(), r = g.rank();
  std::vector<int32_t> mine(16);
  std::iota(mine.begin(), mine.end(), r * 1000);
  k3::cuda::DeviceBuffer<int32_t> in(mine.data(), mine.size()), out(size_t(R) * mine.size());
  g.all_gather_bytes(in.data(), out.data(), int64_t(mine.size() * 4), nullptr);
  g.synchronize(nullptr, "all-gather");
  std::vector<int32_t> all(size_t(R) * mine.size());
  out.download(all.data(), all.size());
  for (int q = 0; q < R; ++q)
    for (int i = 0; i < 16; ++i) EXPECT_EQ(all[size_t(q * 16 + i)], q * 1000 + i);
}

TEST(NcclGroup, WithoutTheCudaBackendItIsAClearError) {
  if (k3::dist::nccl_built()) GTEST_SKIP() << "this build has NCCL";
  EXPECT_THROW(k3::dist::NcclGroup g(k3::dist::world()), k3::Error);
}
