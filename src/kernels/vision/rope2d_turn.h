// The 2D rotary turn of the vision tower (kernels/vision/vision.h, rope2d_forward), shared by the fp32 forward
// (vision_cpu.cpp) and the float64 forward and backward (vision_f64.cpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/parallel.h"

namespace k3::vision_detail {

// Turns every pair of x (n rows of stride ld, `heads` head vectors of hd values) by its angle times `sign` (+1: the
// forward, -1: its transpose): pair 2i by the column, pair 2i + 1 by the row, times 10000^(-4i / hd). The
// arithmetic in double, each value rounded once to T.
template <class T>
void rope2d_turn(T* x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows, const int32_t* cols,
                 double sign) {
  const int64_t nf = hd / 4;
  std::vector<double> freq(static_cast<size_t>(nf));
  for (int64_t i = 0; i < nf; ++i) freq[size_t(i)] = 1.0 / std::pow(10000.0, double(4 * i) / double(hd));
  parallel_for(n, n * heads * hd * 4, [&](int64_t r) {
    T* row = x + r * ld;
    for (int64_t i = 0; i < nf; ++i)
      for (int axis = 0; axis < 2; ++axis) {  // pair 2i: the column; pair 2i + 1: the row
        const double a = double(axis == 0 ? cols[r] : rows[r]) * freq[size_t(i)];
        const double c = std::cos(a), s = sign * std::sin(a);
        const int64_t j = 2 * i + axis;  // the pair
        for (int64_t hh = 0; hh < heads; ++hh) {
          T* p = row + hh * hd + 2 * j;
          const double re = p[0], im = p[1];
          p[0] = T(re * c - im * s);
          p[1] = T(re * s + im * c);
        }
      }
  });
}

}  // namespace k3::vision_detail
