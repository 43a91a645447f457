#include <cblas.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "kernels/gemm/linear.h"
#include "kernels/gemm/mxfp4.h"

namespace k3 {

WeightRef WeightRef::row_slice(int64_t r0, int64_t n) const {
  K3_ASSERT(r0 >= 0 && n >= 0 && r0 + n <= rows);
  WeightRef w = *this;
  w.rows = n;
  const auto* base = static_cast<const uint8_t*>(data);
  switch (format) {
    case Format::F32: w.data = base + r0 * cols * 4; break;
    case Format::BF16:
    case Format::F16: w.data = base + r0 * cols * 2; break;
    case Format::MXFP4:
      w.data = base + r0 * (cols / 2);
      w.scales = scales + r0 * (cols / 32);
      break;
  }
  return w;
}

void WeightRef::rows_to_f32(float* dst, int64_t r0, int64_t n) const {
  const auto* base = static_cast<const uint8_t*>(data);
  switch (format) {
    case Format::F32: std::memcpy(dst, base + r0 * cols * 4, size_t(n * cols) * 4); return;
    case Format::BF16: widen_to_f32(dst, base + r0 * cols * 2, DType::BF16, size_t(n * cols)); return;
    case Format::F16: widen_to_f32(dst, base + r0 * cols * 2, DType::F16, size_t(n * cols)); return;
    case Format::MXFP4:
      for (int64_t r = r0; r < r0 + n; ++r)
        mxfp4_decode_row(dst + (r - r0) * cols, base + r * (cols / 2), scales + r * (cols / 32), cols);
      return;
  }
}

static GemmPrecision g_precision = GemmPrecision::F64Accumulate;
GemmPrecision gemm_precision() { return g_precision; }
void set_gemm_precision(GemmPrecision p) { g_precision = p; }

namespace {

// Up to this many activation rows, stream the weight once with fused widen-and-dot; beyond it,
// widening to a dense type and calling BLAS wins because the weight is reused across rows.
constexpr int64_t kSmallN = 4;
// Weight elements widened per BLAS slab (~8 MB as fp64), so the slab stays in cache.
constexpr int64_t kSlabElems = int64_t(1) << 20;

// sum_i w[i] x[i] in Acc, over kLanes partial sums (i mod kLanes) added pairwise at the end. A bf16 or fp32 weight
// times an fp32 activation is exact in double, so in fp64 only the additions round. The pairwise end matters
// at decode's short rows: an `omp simd` reduction ends with its lanes added one after another (32 dependent
// additions, four times the loop itself at a row of 128).
template <class Acc, class W>
inline Acc dot(const W* w, const float* x, int64_t n) {
  constexpr int kLanes = 32;
  auto widen = [](W v) -> float {
    if constexpr (sizeof(W) == 2) return bf16_to_f32(v);
    else return v;
  };
  Acc part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int l = 0; l < kLanes; ++l) part[l] += Acc(widen(w[i + l])) * Acc(x[i + l]);
  }
  for (int l = 0; i < n; ++i, ++l) part[l] += Acc(widen(w[i])) * Acc(x[i]);
#pragma GCC unroll 8
  for (int half = kLanes / 2; half >= 1; half /= 2) {
#pragma omp simd
    for (int l = 0; l < half; ++l) part[l] += part[l + half];
  }
  return part[0];
}

template <class Acc>
void linear_small_n(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t N, const WeightRef& W, bool acc) {
  const int64_t In = W.cols;
  parallel_region(N * W.rows * In, [&] {
    std::vector<float> row;
    if (W.format != WeightRef::Format::F32 && W.format != WeightRef::Format::BF16) row.resize(size_t(In));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < W.rows; ++r) {
      const float* wf = nullptr;
      const uint16_t* wb = nullptr;
      if (W.format == WeightRef::Format::F32) {
        wf = static_cast<const float*>(W.data) + r * In;
      } else if (W.format == WeightRef::Format::BF16) {
        wb = static_cast<const uint16_t*>(W.data) + r * In;
      } else {
        W.rows_to_f32(row.data(), r, 1);
        wf = row.data();
      }
      for (int64_t n = 0; n < N; ++n) {
        const Acc v = wb ? dot<Acc>(wb, x + n * ldx, In) : dot<Acc>(wf, x + n * ldx, In);
        float& out = y[n * ldy + r];
        out = acc ? float(Acc(out) + v) : float(v);
      }
    }
  });
}

// Widen rows [r0, r0+n) of W into dst (float or double).
template <class T>
void widen_rows(T* dst, const WeightRef& W, int64_t r0, int64_t n) {
  parallel_region(n * W.cols, [&] {
    std::vector<float> tmp;
    if constexpr (!std::is_same_v<T, float>) tmp.resize(size_t(W.cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      if constexpr (std::is_same_v<T, float>) {
        W.rows_to_f32(dst + r * W.cols, r0 + r, 1);
      } else {
        W.rows_to_f32(tmp.data(), r0 + r, 1);
        for (int64_t i = 0; i < W.cols; ++i) dst[r * W.cols + i] = T(tmp[size_t(i)]);
      }
    }
  });
}

void gemm_nt(int64_t M, int64_t N, int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
             float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.0f, a, int(lda), b, int(ldb), beta, c,
              int(ldc));
}
void gemm_nt(int64_t M, int64_t N, int64_t K, const double* a, int64_t lda, const double* b, int64_t ldb, double beta,
             double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.0, a, int(lda), b, int(ldb), beta, c,
              int(ldc));
}
void gemm_nn(int64_t M, int64_t N, int64_t K, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
             int64_t ldc) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(N), int(K), 1.0, a, int(lda), b, int(ldb), 1.0, c,
              int(ldc));
}

// y[N, Out] (+)= x · Wᵀ through BLAS in precision T, weight widened slab by slab.
template <class T>
void linear_blas(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t N, const WeightRef& W, bool accumulate) {
  const int64_t In = W.cols, Out = W.rows;
  const T* xa;
  std::vector<T> xw;
  int64_t lda = ldx;
  if constexpr (std::is_same_v<T, float>) {
    xa = x;
  } else {
    xw.resize(size_t(N * In));
    parallel_for(N, N * In, [&](int64_t n) {
      for (int64_t i = 0; i < In; ++i) xw[size_t(n * In + i)] = T(x[n * ldx + i]);
    });
    xa = xw.data();
    lda = In;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (W.format == WeightRef::Format::F32) {  // fp32 weights: no widening needed
      gemm_nt(N, Out, In, x, ldx, static_cast<const float*>(W.data), In, accumulate ? 1.0f : 0.0f, y, ldy);
      return;
    }
  }
  const int64_t slab = std::max<int64_t>(1, std::min<int64_t>(Out, kSlabElems / In));
  std::vector<T> wbuf(size_t(slab * In));
  std::vector<T> ybuf;
  if constexpr (!std::is_same_v<T, float>) ybuf.resize(size_t(N * slab));
  for (int64_t r0 = 0; r0 < Out; r0 += slab) {
    const int64_t n = std::min(slab, Out - r0);
    widen_rows(wbuf.data(), W, r0, n);
    if constexpr (std::is_same_v<T, float>) {
      gemm_nt(N, n, In, xa, lda, wbuf.data(), In, accumulate ? 1.0f : 0.0f, y + r0, ldy);
    } else {
      gemm_nt(N, n, In, xa, lda, wbuf.data(), In, T(0), ybuf.data(), n);
      parallel_for(N, N * n, [&](int64_t i) {
        for (int64_t j = 0; j < n; ++j) {
          float& o = y[i * ldy + r0 + j];
          o = accumulate ? float(T(o) + ybuf[size_t(i * n + j)]) : float(ybuf[size_t(i * n + j)]);
        }
      });
    }
  }
}

}  // namespace

void linear_forward(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t N, const WeightRef& W,
                    bool accumulate) {
  K3_ASSERT(!W.empty());
  if (N <= 0 || W.rows == 0) return;
  if (W.cols == 0) {
    if (!accumulate)
      for (int64_t n = 0; n < N; ++n) std::fill(y + n * ldy, y + n * ldy + W.rows, 0.0f);
    return;
  }
  const bool f64 = g_precision == GemmPrecision::F64Accumulate;
  if (N <= kSmallN) {
    if (f64) linear_small_n<double>(y, ldy, x, ldx, N, W, accumulate);
    else linear_small_n<float>(y, ldy, x, ldx, N, W, accumulate);
    return;
  }
  if (f64) linear_blas<double>(y, ldy, x, ldx, N, W, accumulate);
  else linear_blas<float>(y, ldy, x, ldx, N, W, accumulate);
}

void linear_forward_f64(double* y, const double* x, int64_t N, const WeightRef& W) {
  K3_ASSERT(!W.empty());
  if (N <= 0 || W.rows == 0) return;
  const int64_t In = W.cols, Out = W.rows;
  const int64_t slab = std::max<int64_t>(1, std::min<int64_t>(Out, kSlabElems / std::max<int64_t>(In, 1)));
  std::vector<double> wbuf(size_t(slab * In));
  for (int64_t r0 = 0; r0 < Out; r0 += slab) {
    const int64_t n = std::min(slab, Out - r0);
    widen_rows(wbuf.data(), W, r0, n);
    gemm_nt(N, n, In, x, In, wbuf.data(), In, 0.0, y + r0, Out);
  }
}

void linear_transposed_forward_f64(double* y, const double* x, int64_t N, const WeightRef& W) {
  K3_ASSERT(!W.empty());
  std::fill(y, y + N * W.cols, 0.0);
  if (N <= 0 || W.rows == 0 || W.cols == 0) return;
  const int64_t In = W.cols, Out = W.rows;
  const int64_t slab = std::max<int64_t>(1, std::min<int64_t>(Out, kSlabElems / In));
  std::vector<double> wbuf(size_t(slab * In));
  for (int64_t r0 = 0; r0 < Out; r0 += slab) {
    const int64_t n = std::min(slab, Out - r0);
    widen_rows(wbuf.data(), W, r0, n);
    gemm_nn(N, In, n, x + r0, Out, wbuf.data(), In, y, In);
  }
}

}  // namespace k3
