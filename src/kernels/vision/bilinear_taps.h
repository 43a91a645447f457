// One axis of PyTorch's bilinear resize (align_corners = false, no antialiasing), shared by the position
// table's fp32 resize (vision_cpu.cpp), its float64 twin and that twin's transpose (vision_f64.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/parallel.h"

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

// out [h, w, D] = table [H0, W0, D] resized (a copy when the sizes agree), the sums in double and each output
// rounded once to T: the fp32 resize and its float64 twin are this one function.
template <class T>
void resize_table(T* out, const T* table, int64_t H0, int64_t W0, int64_t h, int64_t w, int64_t D) {
  if (h == H0 && w == W0) {
    std::copy(table, table + H0 * W0 * D, out);
    return;
  }
  const std::vector<BilinearTap> tr = bilinear_taps(h, H0), tc = bilinear_taps(w, W0);
  parallel_for(h * w, h * w * D * 8, [&](int64_t p) {
    const BilinearTap& r = tr[size_t(p / w)];
    const BilinearTap& c = tc[size_t(p % w)];
    const T* a = table + (r.i0 * W0 + c.i0) * D;
    const T* b = table + (r.i0 * W0 + c.i1) * D;
    const T* e = table + (r.i1 * W0 + c.i0) * D;
    const T* f = table + (r.i1 * W0 + c.i1) * D;
    T* y = out + p * D;
    for (int64_t d = 0; d < D; ++d) {
      const double top = double(a[d]) * (1.0 - c.frac) + double(b[d]) * c.frac;
      const double bot = double(e[d]) * (1.0 - c.frac) + double(f[d]) * c.frac;
      y[d] = T(top * (1.0 - r.frac) + bot * r.frac);
    }
  });
}

}  // namespace k3::vision_detail
