// The vision tower's training ops on the GPU (vision_train_cuda.h has the API and the numerics): the RoPE into
// the training attention's layout and back, the position table's transposed resize, the GELUs' forwards and
// backwards in fp32, and the merge's backward. Elementwise kernels, one thread per output element, grid-stride.
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <string>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/vision/vision_train_cuda.h"

namespace k3::vision::cuda {

namespace {

#define K3_VISION_TRAIN_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

constexpr int kThreads = 256;
unsigned grid_for(int64_t n) { return unsigned(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535 * 8)); }

// ---- RoPE. One thread per (row, head, group of 4 columns): columns 4g, 4g + 1 are pair 2g (turned by the
// column), 4g + 2, 4g + 3 pair 2g + 1 (turned by the row), both at frequency g. sign = +1 turns forward, -1 back.

struct Turn {
  float cc, sc, cr, sr;
};
__device__ __forceinline__ Turn turn_of(const float* table, int64_t nf, int64_t g, int col, int row, float sign) {
  return {table[(col * nf + g) * 2], sign * table[(col * nf + g) * 2 + 1], table[(row * nf + g) * 2],
          sign * table[(row * nf + g) * 2 + 1]};
}
__device__ __forceinline__ void turn4(float* dst, const float* src, const Turn& t) {
  const float a = src[0], b = src[1], c = src[2], d = src[3];
  dst[0] = a * t.cc - b * t.sc;
  dst[1] = a * t.sc + b * t.cc;
  dst[2] = c * t.cr - d * t.sr;
  dst[3] = c * t.sr + d * t.cr;
}

// kBackward = false: q, kv from qkv; true: qkv from q, kv (gradients), turned back.
template <bool kBackward>
__global__ void rope_split_kernel(const RopeSplitParams p) {
  const int64_t nf = p.hd / 4, Q = p.heads * p.hd, n = p.L * p.heads * nf;
  K3_VISION_TRAIN_STRIDE(i, n) {
    const int64_t g = i % nf, rh = i / nf, hh = rh % p.heads, r = rh / p.heads;
    float* qkv = p.qkv + r * p.ld + hh * p.hd + 4 * g;
    float* q = p.q + r * Q + hh * p.hd + 4 * g;
    float* k = p.kv + r * 2 * Q + hh * 2 * p.hd + 4 * g;
    float* v = k + p.hd;
    for (int j = 0; j < 4; ++j) {
      if constexpr (kBackward) qkv[2 * Q + j] = v[j];
      else v[j] = qkv[2 * Q + j];
    }
    float* turned_q = kBackward ? qkv : q;  // what this direction writes
    float* turned_k = kBackward ? qkv + Q : k;
    const int col = p.cols[r], row = p.rows[r];
    if (col < 0 || col >= p.positions || row < 0 || row >= p.positions) {  // never read outside the table
      for (int j = 0; j < 4; ++j) turned_q[j] = turned_k[j] = NAN;
      continue;
    }
    const Turn t = turn_of(p.table, nf, g, col, row, kBackward ? -1.0f : 1.0f);
    turn4(turned_q, kBackward ? q : qkv, t);
    turn4(turned_k, kBackward ? k : qkv + Q, t);
  }
}

// ---- the position table's transposed resize. One thread per table element (row a, column b, channel d).

__global__ void position_backward_kernel(const PositionBackwardParams p) {
  const int64_t n = p.H0 * p.W0 * p.D, frame = p.h * p.w * p.D;
  K3_VISION_TRAIN_STRIDE(i, n) {
    const int64_t d = i % p.D, ab = i / p.D, a = ab / p.W0, b = ab % p.W0;
    double sum = 0.0;
    for (int32_t ry = p.row_start[a]; ry < p.row_start[a + 1]; ++ry) {
      const int64_t y = p.row_index[ry];
      for (int32_t cx = p.col_start[b]; cx < p.col_start[b + 1]; ++cx) {
        const float* src = p.dx + (y * p.w + p.col_index[cx]) * p.D + d;
        double s = 0.0;
        for (int64_t f = 0; f < p.t; ++f) s += double(src[f * frame]);
        sum += p.row_weight[ry] * p.col_weight[cx] * s;
      }
    }
    p.dtable[i] = float(double(p.dtable[i]) + sum);
  }
}

// ---- GELU. The forwards are vision_cuda.cu's (x σ(2z) for tanh, x erfc(-x/√2) / 2 for erf) without the bf16
// rounding; σ(2z) and σ(-2z) from one exp, with σ(-2z) = 1 where e^(-2z) overflows (its limit).

__device__ __forceinline__ void tanh_parts(float x, float& s, float& one_minus_s, float& dz) {
  constexpr float c = 0.7978845608028654f, a = 0.044715f;  // sqrt(2/pi), the cubic's coefficient
  const float z = c * (x + a * x * x * x);
  const float e = expf(-2.0f * z);
  s = 1.0f / (1.0f + e);
  one_minus_s = isinf(e) ? 1.0f : e * s;
  dz = c * (1.0f + 3.0f * a * x * x);
}

template <int kForm>
__global__ void gelu_forward_kernel(float* y, const float* x, int64_t n) {  // y may alias x
  K3_VISION_TRAIN_STRIDE(i, n) {
    const float v = x[i];
    if constexpr (kForm == 0) {
      float s, oms, dz;
      tanh_parts(v, s, oms, dz);
      y[i] = v * s;
    } else {
      y[i] = 0.5f * v * erfcf(-v * 0.7071067811865476f);
    }
  }
}

template <int kForm>
__global__ void gelu_backward_kernel(float* dx, const float* dy, const float* __restrict__ x, int64_t n) {
  K3_VISION_TRAIN_STRIDE(i, n) {
    const float v = x[i];
    float d;
    if constexpr (kForm == 0) {
      float s, oms, dz;
      tanh_parts(v, s, oms, dz);
      d = s + 2.0f * v * s * oms * dz;
    } else {
      d = 0.5f * erfcf(-v * 0.7071067811865476f) + v * expf(-0.5f * v * v) * 0.3989422804014327f;  // 1/sqrt(2 pi)
    }
    dx[i] = dy[i] * d;
  }
}

// ---- the merge's backward: one thread per patch element of every frame.

__global__ void merge_backward_kernel(float* __restrict__ dx, const float* __restrict__ dmerged, int t, int h, int w,
                                      int64_t D, int mh, int mw) {
  const int tw = w / mw, K = mh * mw;
  const int64_t n = int64_t(t) * h * w * D;
  K3_VISION_TRAIN_STRIDE(i, n) {
    const int64_t d = i % D, p = (i / D) % (int64_t(h) * w);
    const int r = int(p / w), c = int(p % w);
    const int64_t tok = int64_t(r / mh) * tw + c / mw;
    const int kk = (r % mh) * mw + c % mw;
    dx[i] = float(double(dmerged[(tok * K + kk) * D + d]) / double(t));
  }
}

void check_rope(const char* fn, const RopeSplitParams& p) {
  K3_CHECK(p.heads > 0 && p.hd > 0 && p.hd % 4 == 0, fn, ": the head dim ", p.hd,
           " must be a positive multiple of 4 (heads ", p.heads, ")");
  K3_CHECK(p.L >= 0 && p.ld >= 3 * p.heads * p.hd, fn, ": ld = ", p.ld, " must be at least 3 heads hd = ",
           3 * p.heads * p.hd);
  K3_CHECK(p.positions > 0, fn, ": positions must be positive, got ", p.positions);
  K3_CHECK(p.L == 0 || (p.qkv && p.rows && p.cols && p.table && p.q && p.kv), fn, ": null device pointer");
}

}  // namespace

void rope_split(const RopeSplitParams& p) {
  check_rope("vision rope_split (cuda)", p);
  if (p.L == 0) return;
  rope_split_kernel<false><<<grid_for(p.L * p.heads * (p.hd / 4)), kThreads>>>(p);
  K3_CUDA_LAUNCH_CHECK();
}

void rope_split_backward(const RopeSplitParams& p) {
  check_rope("vision rope_split_backward (cuda)", p);
  if (p.L == 0) return;
  rope_split_kernel<true><<<grid_for(p.L * p.heads * (p.hd / 4)), kThreads>>>(p);
  K3_CUDA_LAUNCH_CHECK();
}

void position_embedding_backward(const PositionBackwardParams& p) {
  constexpr const char* fn = "vision position_embedding_backward (cuda)";
  K3_CHECK(p.H0 > 0 && p.W0 > 0 && p.D > 0 && p.t > 0 && p.h > 0 && p.w > 0, fn, ": the table (", p.H0, ", ", p.W0,
           ", ", p.D, ") and the grid (", p.t, ", ", p.h, ", ", p.w, ") must be positive");
  K3_CHECK(p.dtable && p.dx && p.row_start && p.row_index && p.row_weight && p.col_start && p.col_index && p.col_weight,
           fn, ": null device pointer");
  position_backward_kernel<<<grid_for(p.H0 * p.W0 * p.D), kThreads>>>(p);
  K3_CUDA_LAUNCH_CHECK();
}

void gelu_forward_train(float* y, const float* x, int64_t n, Gelu form) {
  K3_CHECK(n >= 0, "vision gelu_forward_train (cuda): negative length ", n);
  if (n == 0) return;
  if (form == Gelu::kTanh) gelu_forward_kernel<0><<<grid_for(n), kThreads>>>(y, x, n);
  else gelu_forward_kernel<1><<<grid_for(n), kThreads>>>(y, x, n);
  K3_CUDA_LAUNCH_CHECK();
}

void gelu_backward_train(float* dx, const float* dy, const float* x, int64_t n, Gelu form) {
  K3_CHECK(n >= 0, "vision gelu_backward_train (cuda): negative length ", n);
  if (n == 0) return;
  if (form == Gelu::kTanh) gelu_backward_kernel<0><<<grid_for(n), kThreads>>>(dx, dy, x, n);
  else gelu_backward_kernel<1><<<grid_for(n), kThreads>>>(dx, dy, x, n);
  K3_CUDA_LAUNCH_CHECK();
}

void merge_tpool_backward(float* dx, const float* dmerged, int64_t t, int64_t h, int64_t w, int64_t D, int64_t mh,
                          int64_t mw) {
  constexpr const char* fn = "vision merge_tpool_backward (cuda)";
  K3_CHECK(mh >= 1 && mw >= 1 && t >= 1 && h >= mh && w >= mw && h % mh == 0 && w % mw == 0 && D > 0 &&
               h <= INT_MAX / 2 && w <= INT_MAX / 2 && t <= INT_MAX / 2,
           fn, ": the grid (", t, ", ", h, ", ", w, ") must be positive with h, w multiples of the merge kernel (", mh,
           ", ", mw, "), D = ", D, " positive");
  K3_CHECK(dx && dmerged, fn, ": null device pointer");
  merge_backward_kernel<<<grid_for(t * h * w * D), kThreads>>>(dx, dmerged, int(t), int(h), int(w), D, int(mh),
                                                               int(mw));
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::vision::cuda
