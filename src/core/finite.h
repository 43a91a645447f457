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

namespace detail {

// The first element of x[0..n) whose exponent bits (kExp of its bit pattern U) are all ones, or -1.
// Blocks of 1024 take the largest exponent field first (a max reduction the compiler vectorises),
// and only a block that holds a hit is searched element by element.
template <class T, class U, U kExp>
int64_t first_all_ones_exponent(const T* x, int64_t n) {
  static_assert(sizeof(T) == sizeof(U));
  constexpr int64_t kBlock = 1024;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = b + kBlock < n ? b + kBlock : n;
    U worst = 0;
    for (int64_t i = b; i < e; ++i) {
      U u;
      std::memcpy(&u, &x[i], sizeof(U));
      const U exp = u & kExp;
      worst = exp > worst ? exp : worst;
    }
    if (worst == kExp)
      for (int64_t i = b; i < e; ++i) {
        U u;
        std::memcpy(&u, &x[i], sizeof(U));
        if ((u & kExp) == kExp) return i;
      }
  }
  return -1;
}

}  // namespace detail

// The index of the first NaN or ±Inf in x[0..n), or -1 when all are finite.
inline int64_t first_nonfinite(const float* x, int64_t n) {
  return detail::first_all_ones_exponent<float, uint32_t, 0x7f800000u>(x, n);
}
inline int64_t first_nonfinite(const double* x, int64_t n) {
  return detail::first_all_ones_exponent<double, uint64_t, 0x7ff0000000000000ull>(x, n);
}

// "NaN", "+Inf" or "-Inf" (or the number itself when finite).
inline std::string nonfinite_name(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return std::to_string(v);
}

}  // namespace k3
