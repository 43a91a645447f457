// SplitMix64 (Steele, Lea & Flood 2014): a stateless, well-mixed 64-bit hash. Counter-based random
// numbers where a draw must be a pure function of (seed, index), so that it can be recomputed
// anywhere: the training loop's window starts (an exact resume draws the same windows) and the
// synthetic retrieval tasks (a task is a function of its seed).
#pragma once
#include <cstdint>

namespace k3 {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace k3
