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

// The sequential SplitMix64 generator as uniform doubles in [0, 1): draw i is the top 53 bits of
// splitmix64(s + i·0x9e3779b97f4a7c15) for the initial state s.
struct SplitMixUniform {
  uint64_t s;
  double next() {
    const uint64_t z = splitmix64(s);
    s += 0x9e3779b97f4a7c15ULL;
    return double(z >> 11) * (1.0 / 9007199254740992.0);
  }
};

}  // namespace k3
