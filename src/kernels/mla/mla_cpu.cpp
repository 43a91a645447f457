#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/mla/mla.h"

namespace k3::mla {

namespace {

// p[0..len) <- softmax(p).
void softmax_inplace(double* p, int64_t len) {
  double mx = -INFINITY;
  for (int64_t s = 0; s < len; ++s) mx = std::max(mx, p[s]);
  double z = 0.0;
  for (int64_t s = 0; s < len; ++s) z += (p[s] = std::exp(p[s] - mx));
  for (int64_t s = 0; s < len; ++s) p[s] /= z;
}

}  // namespace

void attention_head_expanded(float* out, int64_t ldo, const float* q, int64_t ldq, const double* kvh,
                             const float* cache, int64_t ldc, int64_t n, int64_t p0, const Dims& d, double scale) {
  const int64_t T = p0 + n, dkv = d.Dn + d.Dv;
  parallel_region(n * T * dkv, [&] {
    std::vector<double> p(static_cast<size_t>(T)), o(static_cast<size_t>(d.Dv));
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < n; ++i) {
      const float* qi = q + i * ldq;
      const int64_t len = p0 + i + 1;  // causal: positions 0..p0+i
      for (int64_t s = 0; s < len; ++s) {
        const double* k = kvh + s * dkv;
        const float* kr = cache + s * ldc + d.R;
        double acc = 0.0;
        for (int64_t j = 0; j < d.Dn; ++j) acc += qi[j] * k[j];
        for (int64_t j = 0; j < d.Dr; ++j) acc += double(qi[d.Dn + j]) * kr[j];
        p[size_t(s)] = acc * scale;
      }
      softmax_inplace(p.data(), len);
      std::fill(o.begin(), o.end(), 0.0);
      for (int64_t s = 0; s < len; ++s) {
        const double* v = kvh + s * dkv + d.Dn;
        const double w = p[size_t(s)];
        for (int64_t j = 0; j < d.Dv; ++j) o[size_t(j)] += w * v[j];
      }
      for (int64_t j = 0; j < d.Dv; ++j) out[i * ldo + j] = float(o[size_t(j)]);
    }
  });
}

void attention_head_latent(double* out_lat, const double* q_lat, const float* q, int64_t ldq, const float* cache,
                           int64_t ldc, int64_t n, int64_t p0, const Dims& d, double scale) {
  const int64_t T = p0 + n;
  std::vector<double> p(static_cast<size_t>(T));
  for (int64_t i = 0; i < n; ++i) {
    const double* ql = q_lat + i * d.R;
    const float* qr = q + i * ldq + d.Dn;
    const int64_t len = p0 + i + 1;
    for (int64_t s = 0; s < len; ++s) {
      const float* c = cache + s * ldc;
      double acc = 0.0;
      for (int64_t j = 0; j < d.R; ++j) acc += ql[j] * c[j];
      for (int64_t j = 0; j < d.Dr; ++j) acc += double(qr[j]) * c[d.R + j];
      p[size_t(s)] = acc * scale;
    }
    softmax_inplace(p.data(), len);
    double* o = out_lat + i * d.R;
    std::fill(o, o + d.R, 0.0);
    for (int64_t s = 0; s < len; ++s) {
      const float* c = cache + s * ldc;
      const double w = p[size_t(s)];
      for (int64_t j = 0; j < d.R; ++j) o[j] += w * c[j];
    }
  }
}

}  // namespace k3::mla
