// When a CPU loop is worth OpenMP's threads. Waking them costs tens of microseconds, and far more when
// other processes share the cores (the woken thread waits for the scheduler while the caller waits at
// the barrier), so a loop of less work runs on the calling thread: decoding k3-tiny is all such loops
// (its largest, the lm_head, is 4096 x 128), and then runs as fast as with one thread on an idle
// machine and keeps that speed on a busy one (docs/BENCHMARKS.md). Results never depend on it: every
// parallel loop in k3 gives each output to one thread.
#pragma once
#include <cstdint>

namespace k3 {

// About the scalar operations (or values touched) a loop does.
constexpr int64_t kMinParallelWork = int64_t(1) << 20;
inline bool worth_threads(int64_t work) { return work > kMinParallelWork; }

}  // namespace k3
