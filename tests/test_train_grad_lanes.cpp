// Gradient lanes (train/grad_lanes.h): a step's sequences run side by side on several gradient
// buffers. Checked against the serial loop (sequence_loss piece after piece into one buffer):
// one lane is bit-identical to it; more lanes differ only by the rounding of the gradient sum; a
// lane count gives the same bits at every thread count; router scores reach Quantile Balancing in
// the serial order.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"
#include "model/config.h"
#include "model/params.h"
#include "model/training/ffn_block.h"
#include "model/training/model_train.h"
#include "train/grad_lanes.h"
#include "train/train_device.h"
#include "util/fixture.h"

using namespace k3;
using namespace k3::train;
using k3test::fixture;

namespace {

const K3Config& cfg() {
  static K3Config c = load_config(fixture("k3-tiny-a/config.json"));
  return c;
}

// Pieces of awkward, unequal lengths (as windows cut at document boundaries are).
std::vector<std::vector<int32_t>> make_pieces() {
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> pieces;
  for (int len : {37, 5, 64, 2, 19, 48, 11, 30}) {
    std::vector<int32_t> p(static_cast<size_t>(len));
    for (int32_t& id : p) id = int32_t(rng() % uint32_t(cfg().vocab_size));
    pieces.push_back(p);
  }
  return pieces;
}

struct RouterCall {
  int64_t layer, N;
  std::vector<double> scores;
  bool operator==(const RouterCall& o) const { return layer == o.layer && N == o.N && scores == o.scores; }
};

struct StepResult {
  double loss = 0.0;
  std::vector<double> grads;
  std::vector<RouterCall> router;
};

const double kScale = 1.0 / 200.0;

// OpenMP's thread count for the life of the object; the count before is restored on every exit (an
// error thrown on the way, a failed ASSERT).
struct OmpThreads {
  int saved = omp_get_max_threads();
  explicit OmpThreads(int n) { omp_set_num_threads(n); }
  ~OmpThreads() { omp_set_num_threads(saved); }
  OmpThreads(const OmpThreads&) = delete;
  OmpThreads& operator=(const OmpThreads&) = delete;
};

// The serial loop, single-threaded.
StepResult serial_step(const std::vector<std::vector<int32_t>>& pieces) {
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  P.zero_grads();
  StepResult r;
  TrainHooks h;
  h.on_moe = [&](int64_t l, const MoeTape& t) { r.router.push_back({l, t.N, t.scores}); };
  {
    const OmpThreads one(1);
    for (const auto& p : pieces) r.loss += sequence_loss(P, cfg(), p, true, kScale, nullptr, &h);
  }
  r.grads = P.grads();
  return r;
}

StepResult lanes_step(const std::vector<std::vector<int32_t>>& pieces, int64_t lanes, int threads) {
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  P.zero_grads();
  GradLanes gl(P, lanes);
  StepResult r;
  {
    const OmpThreads n(threads);
    r.loss = gl.step(cfg(), pieces, kScale, nullptr, [&](int64_t l, const double* s, int64_t N) {
      r.router.push_back({l, N, std::vector<double>(s, s + N * cfg().num_experts)});
    });
  }
  r.grads = P.grads();
  return r;
}

double max_rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return num / den;
}

}  // namespace

TEST(GradLanes, AssignmentIsLongestFirstToTheLeastLoadedLane) {
  const std::vector<std::vector<int32_t>> pieces = {std::vector<int32_t>(5), std::vector<int32_t>(9),
                                                    std::vector<int32_t>(3), std::vector<int32_t>(9),
                                                    std::vector<int32_t>(4)};
  // Order by length (stable): 9 (#1), 9 (#3), 5 (#0), 4 (#4), 3 (#2).
  // #1 -> lane 0 (9 | 0), #3 -> lane 1 (9 | 9), #0 -> lane 0 (14 | 9), #4 -> lane 1 (14 | 13), #2 -> lane 1.
  EXPECT_EQ(assign_lanes(pieces, 2), (std::vector<int64_t>{0, 0, 1, 1, 1}));
  EXPECT_EQ(assign_lanes(pieces, 1), (std::vector<int64_t>{0, 0, 0, 0, 0}));
  // More lanes than pieces: every piece alone, the rest idle.
  const std::vector<int64_t> many = assign_lanes(pieces, 8);
  std::vector<int64_t> sorted = many;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(std::unique(sorted.begin(), sorted.end()) - sorted.begin(), 5);
  EXPECT_THROW(assign_lanes(pieces, 0), Error);
}

TEST(GradLanes, OneLaneIsBitIdenticalToTheSerialLoop) {
  const auto pieces = make_pieces();
  const StepResult want = serial_step(pieces);
  const StepResult got = lanes_step(pieces, 1, 2);
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_TRUE(got.grads == want.grads);
  EXPECT_TRUE(got.router == want.router);
}

TEST(GradLanes, ManyLanesMatchTheSerialLoopAndNotTheThreadCount) {
  const auto pieces = make_pieces();
  const StepResult want = serial_step(pieces);
  for (int64_t lanes : {2, 3, 5}) {
    const StepResult one = lanes_step(pieces, lanes, 1), two = lanes_step(pieces, lanes, 2);
    // Per-piece losses and router scores are combined in piece order: exact.
    EXPECT_EQ(one.loss, want.loss) << lanes << " lanes";
    EXPECT_TRUE(one.router == want.router) << lanes << " lanes";
    // The gradient is the same sum in another order: rounding only.
    EXPECT_LT(max_rel(one.grads, want.grads), 1e-12) << lanes << " lanes";
    // For a given lane count the thread count changes nothing.
    EXPECT_EQ(two.loss, one.loss) << lanes << " lanes";
    EXPECT_TRUE(two.grads == one.grads) << lanes << " lanes";
    EXPECT_TRUE(two.router == one.router) << lanes << " lanes";
  }
}

TEST(GradLanes, ForwardLossesEqualTheSerialSum) {
  const auto pieces = make_pieces();
  ParamStore P = ParamStore::from_model_dir(fixture("k3-tiny-a"));
  double want = 0.0, got = 0.0;
  {
    const OmpThreads one(1);
    for (const auto& p : pieces) want += sequence_loss(P, cfg(), p, false, 0.0);
  }
  {
    const OmpThreads two(2);
    got = forward_losses(P, cfg(), pieces, nullptr);
  }
  EXPECT_EQ(got, want);
}

TEST(GradLanes, ALaneReadsItsBaseAndCannotWriteIt) {
  ParamStore P;
  P.add("w", {3});
  P.p_mut("w")[1] = 2.5;
  ParamStore lane = ParamStore::gradient_lane(P);
  EXPECT_EQ(lane.p("w", 3)[1], 2.5);
  P.p_mut("w")[1] = -1.0;
  EXPECT_EQ(lane.p("w")[1], -1.0);  // shared, not copied
  lane.g("w")[0] = 4.0;
  EXPECT_EQ(P.g("w")[0], 0.0);  // gradients are its own
  EXPECT_THROW(lane.p_mut("w"), Error);
  EXPECT_THROW(lane.add("v", {1}), Error);
  EXPECT_THROW(GradLanes(P, 0), Error);
}

// The GPU trainer's micro-batches (train_device.h): consecutive, in order, every piece once, none
// over the limit unless it is longer than the limit by itself.
TEST(MicroBatches, CoverThePiecesInOrderWithinTheLimit) {
  using Runs = std::vector<std::pair<size_t, size_t>>;
  auto pieces = [](const std::vector<size_t>& lens) {
    std::vector<std::vector<int32_t>> p;
    for (size_t n : lens) p.emplace_back(n, 1);
    return p;
  };
  EXPECT_EQ(micro_batches(pieces({}), 8), Runs{});
  EXPECT_EQ(micro_batches(pieces({4, 4, 4}), 0), (Runs{{0, 3}}));
  EXPECT_EQ(micro_batches(pieces({4, 4, 4}), 8), (Runs{{0, 2}, {2, 3}}));
  EXPECT_EQ(micro_batches(pieces({4, 4, 4}), 7), (Runs{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_EQ(micro_batches(pieces({3, 9, 2, 2, 5}), 4), (Runs{{0, 1}, {1, 2}, {2, 4}, {4, 5}}));
  EXPECT_EQ(micro_batches(pieces({4, 4, 4}), 100), (Runs{{0, 3}}));
}
