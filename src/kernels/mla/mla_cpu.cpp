#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/mla/mla.h"

namespace k3::mla {

namespace {

// p[0..len) <- softmax(p); fp32 values, double accumulation of the normaliser.
void softmax_inplace(float* p, int64_t len) {
  float mx = -INFINITY;
  for (int64_t s = 0; s < len; ++s) mx = std::max(mx, p[s]);
  double z = 0.0;
  for (int64_t s = 0; s < len; ++s) z += (p[s] = std::exp(p[s] - mx));
  const float inv = float(1.0 / z);
  for (int64_t s = 0; s < len; ++s) p[s] *= inv;
}

}  // namespace

void attention_expanded(float* out, const float* q, const float* kv, const float* cache, int64_t ldc, int64_t n,
                        int64_t p0, const Dims& d, float scale) {
  const int64_t T = p0 + n, dq = d.Dn + d.Dr, dkv = d.Dn + d.Dv;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < d.H; ++h) {
        const float* qh = q + i * d.H * dq + h * dq;
        const int64_t len = p0 + i + 1;  // causal: positions 0..p0+i
        for (int64_t s = 0; s < len; ++s) {
          const float* k = kv + s * d.H * dkv + h * dkv;
          const float* kr = cache + s * ldc + d.R;
          float acc = 0.0f;
          for (int64_t j = 0; j < d.Dn; ++j) acc += qh[j] * k[j];
          for (int64_t j = 0; j < d.Dr; ++j) acc += qh[d.Dn + j] * kr[j];
          p[size_t(s)] = acc * scale;
        }
        softmax_inplace(p.data(), len);
        float* o = out + i * d.H * d.Dv + h * d.Dv;
        std::fill(o, o + d.Dv, 0.0f);
        for (int64_t s = 0; s < len; ++s) {
          const float* v = kv + s * d.H * dkv + h * dkv + d.Dn;
          const float w = p[size_t(s)];
          for (int64_t j = 0; j < d.Dv; ++j) o[j] += w * v[j];
        }
      }
  }
}

void attention_latent(float* out_lat, const float* q_lat, const float* q, const float* cache, int64_t ldc, int64_t n,
                      int64_t p0, const Dims& d, float scale) {
  const int64_t T = p0 + n, dq = d.Dn + d.Dr;
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(T));
#pragma omp for collapse(2) schedule(dynamic, 4)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < d.H; ++h) {
        const float* ql = q_lat + (i * d.H + h) * d.R;
        const float* qr = q + i * d.H * dq + h * dq + d.Dn;
        const int64_t len = p0 + i + 1;
        for (int64_t s = 0; s < len; ++s) {
          const float* c = cache + s * ldc;
          float acc = 0.0f;
          for (int64_t j = 0; j < d.R; ++j) acc += ql[j] * c[j];
          for (int64_t j = 0; j < d.Dr; ++j) acc += qr[j] * c[d.R + j];
          p[size_t(s)] = acc * scale;
        }
        softmax_inplace(p.data(), len);
        float* o = out_lat + (i * d.H + h) * d.R;
        std::fill(o, o + d.R, 0.0f);
        for (int64_t s = 0; s < len; ++s) {
          const float* c = cache + s * ldc;
          const float w = p[size_t(s)];
          for (int64_t j = 0; j < d.R; ++j) o[j] += w * c[j];
        }
      }
  }
}

}  // namespace k3::mla
