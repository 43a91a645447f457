#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/vision/bilinear_taps.h"
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
  const int64_t nf = hd / 4;
  std::vector<double> freq(static_cast<size_t>(nf));
  for (int64_t i = 0; i < nf; ++i) freq[size_t(i)] = 1.0 / std::pow(10000.0, double(4 * i) / double(hd));
  parallel_for(n, n * heads * hd * 4, [&](int64_t r) {
    float* row = x + r * ld;
    for (int64_t i = 0; i < nf; ++i)
      for (int axis = 0; axis < 2; ++axis) {  // pair 2i: the column; pair 2i + 1: the row
        const double a = double(axis == 0 ? cols[r] : rows[r]) * freq[size_t(i)];
        const double c = std::cos(a), s = std::sin(a);
        const int64_t j = 2 * i + axis;  // the pair
        for (int64_t hh = 0; hh < heads; ++hh) {
          float* p = row + hh * hd + 2 * j;
          const double re = p[0], im = p[1];
          p[0] = float(re * c - im * s);
          p[1] = float(re * s + im * c);
        }
      }
  });
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
