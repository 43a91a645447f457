// The exact MLA attention of the GPU model's fp32 mode (mla_cuda.h: attention_expanded_exact).
// Readable rather than fast: it exists so that the whole model can be checked on the GPU against the
// float64 golden fixtures, where every MLA input (kvh in particular) is kept at the CPU's precision.
//
// One CTA per (query i, head h), blockDim >= Dv threads. Keys are visited in tiles of blockDim: each
// thread scores one key of the tile in fp64 into shared memory; every thread then reads the whole
// tile (the same values in the same order, so all threads hold the same running max and
// denominator bits), rescales its running state, and thread j < Dv accumulates output column j.
#include <cmath>

#include "core/cuda_check.cuh"
#include "kernels/mla/mla_cuda.h"

namespace k3::mla::cuda {

namespace {

__global__ void attention_exact_kernel(ExactParams a, double scale) {
  extern __shared__ double sh[];  // q as fp64 [Dn + Dr], then the tile's scores [blockDim]
  const int64_t i = blockIdx.x, h = blockIdx.y, H = a.d.H, Dn = a.d.Dn, Dr = a.d.Dr, Dv = a.d.Dv, R = a.d.R;
  const int64_t dq = Dn + Dr, dkv = Dn + Dv, len = a.p0 + i + 1;  // causal: keys 0 .. p0+i
  const int tid = int(threadIdx.x), tb = int(blockDim.x);
  double* qs = sh;
  double* p = sh + dq;
  for (int64_t j = tid; j < dq; j += tb) qs[j] = double(a.q[(i * H + h) * dq + j]);
  __syncthreads();

  double m = -INFINITY, z = 0.0, acc = 0.0;
  for (int64_t s0 = 0; s0 < len; s0 += tb) {
    const int64_t s = s0 + tid;
    double sc = -INFINITY;
    if (s < len) {
      const double* k = a.kvh + (s * H + h) * dkv;
      const float* kr = a.cache + s * a.ldc + R;
      double d = 0.0;
      for (int64_t j = 0; j < Dn; ++j) d += qs[j] * k[j];
      for (int64_t j = 0; j < Dr; ++j) d += qs[Dn + j] * double(kr[j]);
      sc = d * scale;
    }
    p[tid] = sc;
    __syncthreads();
    const int64_t tile = len - s0 < tb ? len - s0 : tb;
    double tm = m;
    for (int64_t t = 0; t < tile; ++t) tm = fmax(tm, p[t]);
    const double corr = exp(m - tm);  // m = -inf on the first tile: corr = 0 and the state is empty
    __syncthreads();
    if (s < len) p[tid] = exp(sc - tm);
    __syncthreads();
    double zt = 0.0, at = 0.0;
    for (int64_t t = 0; t < tile; ++t) {
      zt += p[t];
      if (tid < Dv) at += p[t] * a.kvh[((s0 + t) * H + h) * dkv + Dn + tid];
    }
    z = z * corr + zt;
    acc = acc * corr + at;
    m = tm;
    __syncthreads();  // the tile's scores are read by all before the next tile overwrites them
  }
  if (tid < Dv) a.o[(i * H + h) * Dv + tid] = float(acc / z);
}

}  // namespace

std::string can_run(const ExactParams& p) {
  if (!p.o || !p.q || !p.kvh || !p.cache) return "mla exact attention: null pointer";
  if (p.n < 0 || p.p0 < 0 || p.d.H < 1 || p.d.Dv < 1 || p.d.Dn < 0 || p.d.Dr < 0)
    return "mla exact attention: bad shape";
  if (p.d.Dv > 1024) return "mla exact attention: v_head_dim > 1024";
  if (p.d.Dn + p.d.Dr > 4096) return "mla exact attention: qk head dim > 4096";
  if (p.ldc < p.d.R + p.d.Dr) return "mla exact attention: cache row stride < R + Dr";
  if (p.n > 65535 * 1024 || p.d.H > 65535) return "mla exact attention: too many queries or heads";
  return {};
}

void attention_expanded_exact(const ExactParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail(why);
  if (p.n == 0) return;
  const int threads = int(p.d.Dv <= 128 ? 128 : (p.d.Dv + 31) / 32 * 32);
  const size_t smem = size_t(p.d.Dn + p.d.Dr + threads) * sizeof(double);
  const double scale = 1.0 / std::sqrt(double(p.d.Dn + p.d.Dr));
  attention_exact_kernel<<<dim3(unsigned(p.n), unsigned(p.d.H)), threads, smem>>>(p, scale);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::mla::cuda
