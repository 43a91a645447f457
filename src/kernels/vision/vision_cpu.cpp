#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/vision/bilinear_taps.h"
#include "kernels/vision/rope2d_turn.h"
#include "kernels/vision/vision.h"
#include "kernels/vision/vision_f64.h"

namespace k3 {

using vision_detail::bilinear_taps;
using vision_detail::BilinearTap;

void position_table_resize(float* out, const float* table, int64_t H0, int64_t W0, int64_t h, int64_t w, int64_t D) {
  vision_detail::resize_table(out, table, H0, W0, h, w, D);
}

void frame_time_embedding(float* out, int64_t t, int64_t D) {
  std::vector<double> e(static_cast<size_t>(t * D));
  frame_time_embedding_f64(e.data(), t, D);
  for (int64_t i = 0; i < t * D; ++i) out[i] = float(e[size_t(i)]);
}

void rope2d_forward(float* x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows,
                    const int32_t* cols) {
  vision_detail::rope2d_turn(x, ld, n, heads, hd, rows, cols, 1.0);
}

void attention_bidirectional(float* o, const float* q, const float* k, const float* v, int64_t ld, int64_t n,
                             int64_t heads, int64_t hd) {
  const double scale = 1.0 / std::sqrt(double(hd));
  parallel_region(heads * n * n * hd * 2, [&] {
    std::vector<double> s(static_cast<size_t>(n)), acc(static_cast<size_t>(hd));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < heads * n; ++t) {
      const int64_t hh = t / n, i = t % n;
      const float* qi = q + i * ld + hh * hd;
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = k + j * ld + hh * hd;
        double d = 0.0;
        for (int64_t c = 0; c < hd; ++c) d += double(qi[c]) * double(kj[c]);
        s[size_t(j)] = d * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double z = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < n; ++j) {
        const double p = std::exp(s[size_t(j)] - mx);
        z += p;
        const float* vj = v + j * ld + hh * hd;
        for (int64_t c = 0; c < hd; ++c) acc[size_t(c)] += p * double(vj[c]);
      }
      float* oi = o + i * heads * hd + hh * hd;
      for (int64_t c = 0; c < hd; ++c) oi[c] = float(acc[size_t(c)] / z);
    }
  });
}

}  // namespace k3
