// Finding the first NaN or infinity in a buffer: the check behind "non-finite results are an error
// naming where they first appeared" (weights at load, block outputs in the forward, logits,
// gradients and parameters in training).
//
// The scan tests the exponent bits as integers, so it vectorises (an isfinite() loop does not, and
// a float sum would stop at the first overflow without saying where); a model's forward checks
// every block output with it at a cost far below the block's own arithmetic.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

namespace k3 {

// The index of the first NaN or ±Inf in x[0..n), or -1 when all are finite.
inline int64_t first_nonfinite(const float* x, int64_t n) {
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = b + kBlock < n ? b + kBlock : n;
    uint32_t worst = 0;
    for (int64_t i = b; i < e; ++i) {
      uint32_t u;
      std::memcpy(&u, &x[i], 4);
      const uint32_t exp = u & 0x7f800000u;
      worst = exp > worst ? exp : worst;
    }
    if (worst == 0x7f800000u)
      for (int64_t i = b; i < e; ++i) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        if ((u & 0x7f800000u) == 0x7f800000u) return i;
      }
  }
  return -1;
}

inline int64_t first_nonfinite(const double* x, int64_t n) {
  constexpr uint64_t kExp = 0x7ff0000000000000ull;
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = b + kBlock < n ? b + kBlock : n;
    uint64_t worst = 0;
    for (int64_t i = b; i < e; ++i) {
      uint64_t u;
      std::memcpy(&u, &x[i], 8);
      const uint64_t exp = u & kExp;
      worst = exp > worst ? exp : worst;
    }
    if (worst == kExp)
      for (int64_t i = b; i < e; ++i) {
        uint64_t u;
        std::memcpy(&u, &x[i], 8);
        if ((u & kExp) == kExp) return i;
      }
  }
  return -1;
}

// "NaN", "+Inf" or "-Inf" (or the number itself when finite).
inline std::string nonfinite_name(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return std::to_string(v);
}

}  // namespace k3
