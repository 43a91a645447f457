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

// The loops below take the calling thread without entering an OpenMP region when `work` is not worth threads:
// `#pragma omp parallel if (false)` still builds a team of one, about a microsecond, and decoding k3-tiny runs
// hundreds of such loops a token.

// body() once per thread of a parallel region, or once on the calling thread. For loops that keep per-thread
// scratch: body sets it up, then shares its loop with `#pragma omp for` (outside a region that runs every
// iteration on the calling thread, in order, for a few nanoseconds).
template <class F>
inline void parallel_region(int64_t work, F&& body) {
  if (worth_threads(work)) {
#pragma omp parallel
    body();
  } else {
    body();
  }
}

// body(i) for i in [0, n): static schedule on OpenMP's threads, or in order on the calling thread.
template <class F>
inline void parallel_for(int64_t n, int64_t work, F&& body) {
  parallel_region(work, [&] {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  });
}

// As parallel_for, with a dynamic schedule (iterations of uneven cost).
template <class F>
inline void parallel_for_dynamic(int64_t n, int64_t work, F&& body) {
  parallel_region(work, [&] {
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < n; ++i) body(i);
  });
}

}  // namespace k3
