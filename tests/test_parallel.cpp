// The loops of core/parallel.h: each index visited exactly once, whether the work is worth OpenMP's threads or
// not; below worth_threads' bar no OpenMP region is entered (not even a one-thread one, which costs about a
// microsecond: the point of the helpers), and the indices come in order on the calling thread.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <vector>

#include "core/parallel.h"

namespace {

constexpr int64_t kN = 1000;
constexpr int64_t kSmall = 10;                        // below the bar
constexpr int64_t kLarge = k3::kMinParallelWork + 1;  // above it

template <class Loop>
void check_each_index_once(Loop loop, int64_t work, bool expect_region) {
  std::vector<std::atomic<int>> seen(kN);
  std::atomic<int> levels_wrong{0};
  loop(kN, work, [&](int64_t i) {
    seen[size_t(i)].fetch_add(1);
    if ((omp_get_level() > 0) != expect_region) levels_wrong.fetch_add(1);
  });
  for (int64_t i = 0; i < kN; ++i) EXPECT_EQ(seen[size_t(i)].load(), 1) << "index " << i;
  EXPECT_EQ(levels_wrong.load(), 0);
}

TEST(Parallel, ForVisitsEveryIndexOnce) {
  auto loop = [](int64_t n, int64_t work, auto&& body) { k3::parallel_for(n, work, body); };
  check_each_index_once(loop, kSmall, false);
  check_each_index_once(loop, kLarge, true);
}

TEST(Parallel, ForDynamicVisitsEveryIndexOnce) {
  auto loop = [](int64_t n, int64_t work, auto&& body) { k3::parallel_for_dynamic(n, work, body); };
  check_each_index_once(loop, kSmall, false);
  check_each_index_once(loop, kLarge, true);
}

TEST(Parallel, SmallLoopsRunInOrderOnTheCallingThread) {
  std::vector<int64_t> order;
  k3::parallel_for(kN, kSmall, [&](int64_t i) { order.push_back(i); });  // no synchronisation needed: one thread
  ASSERT_EQ(order.size(), size_t(kN));
  for (int64_t i = 0; i < kN; ++i) EXPECT_EQ(order[size_t(i)], i);
  int calls = 0;
  k3::parallel_region(kSmall, [&] {
    ++calls;
    EXPECT_EQ(omp_get_level(), 0);
  });
  EXPECT_EQ(calls, 1);
}

TEST(Parallel, RegionSharesItsLoopAmongTheThreads) {
  std::vector<std::atomic<int>> seen(kN);
  std::atomic<int> bodies{0}, team{0};
  k3::parallel_region(kLarge, [&] {
    bodies.fetch_add(1);
    team.store(omp_get_num_threads());
#pragma omp for schedule(static)
    for (int64_t i = 0; i < kN; ++i) seen[size_t(i)].fetch_add(1);
  });
  EXPECT_EQ(bodies.load(), team.load());  // once per thread of the region
  for (int64_t i = 0; i < kN; ++i) EXPECT_EQ(seen[size_t(i)].load(), 1) << "index " << i;
}

}  // namespace
