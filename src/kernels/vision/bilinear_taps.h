// One axis of PyTorch's bilinear resize (align_corners = false, no antialiasing), shared by the position
// table's fp32 resize (vision_cpu.cpp), its float64 twin and that twin's transpose (vision_f64.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace k3::vision_detail {

// Output index i reads source rows i0 and i1 with weights 1 - frac and frac.
struct BilinearTap {
  int64_t i0, i1;
  double frac;
};

// Source index (i + 0.5) n_in / n_out - 0.5, clamped below at 0; the last source row repeats.
inline std::vector<BilinearTap> bilinear_taps(int64_t n_out, int64_t n_in) {
  std::vector<BilinearTap> t(static_cast<size_t>(n_out));
  const double scale = double(n_in) / double(n_out);
  for (int64_t i = 0; i < n_out; ++i) {
    const double src = std::max((double(i) + 0.5) * scale - 0.5, 0.0);
    const int64_t i0 = std::min(int64_t(src), n_in - 1);
    t[size_t(i)] = {i0, std::min(i0 + 1, n_in - 1), src - double(i0)};
  }
  return t;
}

}  // namespace k3::vision_detail
