// Shared helpers for tests: relative L2 error with a non-finite check first, and fixture paths.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace k3test {

inline std::string fixture(const std::string& rel) { return std::string(K3_SOURCE_DIR) + "/tests/fixtures/" + rel; }

// ||a - b|| / ||b|| in double, for any pair of float/double arrays; +inf when any value is
// non-finite (so a NaN never "passes").
template <class A, class B>
double rel_l2(const A* a, const B* b, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / (den > 0 ? den : 1e-300));
}
inline double rel_l2(const std::vector<double>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  return rel_l2(a.data(), b.data(), a.size());
}
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  return rel_l2(a.data(), b.data(), a.size());
}

}  // namespace k3test
