// Seeded standard-normal test inputs.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace k3test {

// n draws of N(0, 1) from mt19937_64(seed): the same vector for the same seed, on every platform
// whose standard library implements normal_distribution the same way (libstdc++ here).
inline std::vector<double> randn(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& e : v) e = nd(rng);
  return v;
}

}  // namespace k3test
