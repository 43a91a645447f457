// Float64 forwards and backwards of the vision tower's own ops (see vision_f64.h).
#include "kernels/vision/vision_f64.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/vision/bilinear_taps.h"
#include "kernels/vision/rope2d_turn.h"

namespace k3 {

using vision_detail::bilinear_taps;
using vision_detail::BilinearTap;

void position_table_resize_f64(double* out, const double* table, int64_t H0, int64_t W0, int64_t h, int64_t w,
                               int64_t D) {
  vision_detail::resize_table(out, table, H0, W0, h, w, D);
}

void position_table_resize_backward_f64(double* dtable, const double* dout, int64_t H0, int64_t W0, int64_t h,
                                        int64_t w, int64_t D) {
  if (h == H0 && w == W0) {
    for (int64_t i = 0; i < H0 * W0 * D; ++i) dtable[i] += dout[i];
    return;
  }
  // Scattered in output order on one thread: several outputs write to one table row, and the order of those
  // additions then never depends on the thread count. A position table is small (64 x 64 in the release).
  const std::vector<BilinearTap> tr = bilinear_taps(h, H0), tc = bilinear_taps(w, W0);
  for (int64_t p = 0; p < h * w; ++p) {
    const BilinearTap& r = tr[size_t(p / w)];
    const BilinearTap& c = tc[size_t(p % w)];
    const struct {
      int64_t row, col;
      double weight;
    } corners[4] = {{r.i0, c.i0, (1.0 - r.frac) * (1.0 - c.frac)},
                    {r.i0, c.i1, (1.0 - r.frac) * c.frac},
                    {r.i1, c.i0, r.frac * (1.0 - c.frac)},
                    {r.i1, c.i1, r.frac * c.frac}};
    const double* g = dout + p * D;
    for (const auto& k : corners) {
      double* dst = dtable + (k.row * W0 + k.col) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] += k.weight * g[d];
    }
  }
}

void frame_time_embedding_f64(double* out, int64_t t, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t f = 0; f < t; ++f)
    for (int64_t i = 0; i < half; ++i) {
      const double a = double(f) * std::pow(10000.0, -double(i) / double(half));
      out[f * D + i] = std::sin(a);
      out[f * D + half + i] = std::cos(a);
    }
}

void rope2d_forward_f64(double* x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows,
                        const int32_t* cols) {
  vision_detail::rope2d_turn(x, ld, n, heads, hd, rows, cols, 1.0);
}

void rope2d_backward_f64(double* dx, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int32_t* rows,
                         const int32_t* cols) {
  vision_detail::rope2d_turn(dx, ld, n, heads, hd, rows, cols, -1.0);
}

namespace {

double dot(const double* a, const double* b, int64_t n) {
  double s = 0.0;
  for (int64_t c = 0; c < n; ++c) s += a[c] * b[c];
  return s;
}

}  // namespace

void attention_bidirectional_forward_f64(double* o, double* lse, const double* q, const double* k, const double* v,
                                         int64_t ld, int64_t n, int64_t heads, int64_t hd) {
  const double scale = 1.0 / std::sqrt(double(hd));
  parallel_region(heads * n * n * hd * 2, [&] {
    std::vector<double> s(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < heads * n; ++t) {
      const int64_t hh = t / n, i = t % n;
      const double* qi = q + i * ld + hh * hd;
      double mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        s[size_t(j)] = dot(qi, k + j * ld + hh * hd, hd) * scale;
        mx = std::max(mx, s[size_t(j)]);
      }
      double* oi = o + i * heads * hd + hh * hd;
      std::fill(oi, oi + hd, 0.0);
      double z = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        const double p = std::exp(s[size_t(j)] - mx);
        z += p;
        const double* vj = v + j * ld + hh * hd;
        for (int64_t c = 0; c < hd; ++c) oi[c] += p * vj[c];
      }
      for (int64_t c = 0; c < hd; ++c) oi[c] /= z;
      lse[hh * n + i] = mx + std::log(z);
    }
  });
}

void attention_bidirectional_backward_f64(double* dq, double* dk, double* dv, int64_t ldd, const double* dO,
                                          const double* q, const double* k, const double* v, int64_t ld,
                                          const double* o, const double* lse, int64_t n, int64_t heads, int64_t hd) {
  const double scale = 1.0 / std::sqrt(double(hd));
  const int64_t ldo = heads * hd;
  // One head per iteration: a head's dk and dv rows take sums over every query row, and no other head writes
  // its columns.
  parallel_for(heads, heads * n * n * hd * 4, [&](int64_t hh) {
    const int64_t c0 = hh * hd;
    for (int64_t r = 0; r < n; ++r) {
      std::fill(dq + r * ldd + c0, dq + r * ldd + c0 + hd, 0.0);
      std::fill(dk + r * ldd + c0, dk + r * ldd + c0 + hd, 0.0);
      std::fill(dv + r * ldd + c0, dv + r * ldd + c0 + hd, 0.0);
    }
    for (int64_t i = 0; i < n; ++i) {
      const double* qi = q + i * ld + c0;
      const double* doi = dO + i * ldo + c0;
      const double row_dot = dot(doi, o + i * ldo + c0, hd);  // Σ_j P_ij dP_ij
      double* dqi = dq + i * ldd + c0;
      for (int64_t j = 0; j < n; ++j) {
        const double* kj = k + j * ld + c0;
        const double* vj = v + j * ld + c0;
        const double p = std::exp(dot(qi, kj, hd) * scale - lse[hh * n + i]);
        const double ds = p * (dot(doi, vj, hd) - row_dot) * scale;
        double* dkj = dk + j * ldd + c0;
        double* dvj = dv + j * ldd + c0;
        for (int64_t c = 0; c < hd; ++c) {
          dvj[c] += p * doi[c];
          dqi[c] += ds * kj[c];
          dkj[c] += ds * qi[c];
        }
      }
    }
  });
}

void patch_merge_forward_f64(double* merged, const double* x, int64_t t, int64_t h, int64_t w, int64_t mh, int64_t mw,
                             int64_t D) {
  const int64_t tw = w / mw, K = mh * mw, tokens = (h / mh) * tw;
  for (int64_t tok = 0; tok < tokens; ++tok)
    for (int64_t kk = 0; kk < K; ++kk) {
      const int64_t r = (tok / tw) * mh + kk / mw, c = (tok % tw) * mw + kk % mw;
      double* dst = merged + (tok * K + kk) * D;
      for (int64_t d = 0; d < D; ++d) {
        double s = 0.0;
        for (int64_t f = 0; f < t; ++f) s += x[((f * h + r) * w + c) * D + d];
        dst[d] = s / double(t);
      }
    }
}

void patch_merge_backward_f64(double* dx, const double* dmerged, int64_t t, int64_t h, int64_t w, int64_t mh,
                              int64_t mw, int64_t D) {
  const int64_t tw = w / mw, K = mh * mw, tokens = (h / mh) * tw;
  for (int64_t tok = 0; tok < tokens; ++tok)
    for (int64_t kk = 0; kk < K; ++kk) {
      const int64_t r = (tok / tw) * mh + kk / mw, c = (tok % tw) * mw + kk % mw;
      const double* g = dmerged + (tok * K + kk) * D;
      for (int64_t f = 0; f < t; ++f) {
        double* dst = dx + ((f * h + r) * w + c) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = g[d] / double(t);
      }
    }
}

}  // namespace k3
