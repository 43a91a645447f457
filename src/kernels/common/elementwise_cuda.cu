// Glue kernels of the GPU model (elementwise_cuda.h): grid-stride loops, one element per thread per
// step. They move a few MB per layer at most; clarity over packing.
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"

namespace k3::elementwise::cuda {

namespace {

using rowwise::bf16;

#define K3_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

__global__ void add_kernel(float* __restrict__ y, const float* __restrict__ x, int64_t n) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, n) y[i] += x[i];
}

__global__ void sigmoid_kernel(float* __restrict__ x, int64_t n) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, n) x[i] = rowwise::sigmoid_stable(x[i]);
}

template <class T>
__global__ void mul_sigmoid_kernel(T* __restrict__ x, const T* __restrict__ g, int64_t n) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, n)
  x[i] = rowwise::from_f32<T>(rowwise::to_f32(x[i]) * rowwise::sigmoid_stable(rowwise::to_f32(g[i])));
}

template <class Tout, class Tin>
__global__ void copy_rows_kernel(Tout* __restrict__ dst, int64_t ld_dst, const Tin* __restrict__ src, int64_t ld_src,
                                 int64_t rows, int64_t cols) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, rows * cols) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[r * ld_dst + c] = rowwise::from_f32<Tout>(rowwise::to_f32(src[r * ld_src + c]));
  }
}

__global__ void gather_kernel(float* __restrict__ dst, const float* __restrict__ src, const int32_t* __restrict__ index,
                              int64_t n, int64_t cols) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, n * cols) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[i] = src[int64_t(index[r]) * cols + c];
  }
}

__global__ void scatter_add_kernel(float* __restrict__ dst, const float* __restrict__ src,
                                   const int32_t* __restrict__ index, const float* __restrict__ weight, int64_t n,
                                   int64_t cols) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, n * cols) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[int64_t(index[r]) * cols + c] += weight[r] * src[i];
  }
}

__global__ void embedding_f32_kernel(float* __restrict__ out, const float* __restrict__ table,
                                     const int32_t* __restrict__ ids, int64_t T, int64_t V, int64_t D) {
  pdl::wait_then_release();
  K3_GRID_STRIDE(i, T * D) {
    const int64_t t = i / D, c = i - t * D, id = ids[t];
    out[i] = (id >= 0 && id < V) ? table[id * D + c] : NAN;
  }
}

void check_n(int64_t n, const char* what) { K3_CHECK(n >= 0, what, " (cuda): negative length ", n); }

constexpr int kColThreads = 256;

__global__ void __launch_bounds__(kColThreads)
    chunk_column_sums_kernel(float* __restrict__ out, const double* __restrict__ part, int64_t chunks, int D) {
  const int d = int(blockIdx.x) * kColThreads + int(threadIdx.x);
  if (d >= D) return;
  double s = 0.0;
  for (int64_t c = 0; c < chunks; ++c) s += part[c * D + d];
  out[d] = float(double(out[d]) + s);
}

}  // namespace

void add_inplace(float* y, const float* x, int64_t n) {
  check_n(n, "add_inplace");
  if (n == 0) return;
  pdl::launch(add_kernel, rowwise::grid_for(n), 256, 0, y, x, n);
  K3_CUDA_LAUNCH_CHECK();
}

void add_chunk_column_sums(float* out, const double* part, int64_t chunks, int64_t D) {
  K3_CHECK(chunks >= 0 && D >= 0 && D <= INT32_MAX, "add_chunk_column_sums (cuda): bad shape ", chunks, " x ", D);
  if (D == 0) return;
  chunk_column_sums_kernel<<<unsigned((D + kColThreads - 1) / kColThreads), kColThreads>>>(out, part, chunks, int(D));
  K3_CUDA_LAUNCH_CHECK();
}

void sigmoid_inplace(float* x, int64_t n) {
  check_n(n, "sigmoid_inplace");
  if (n == 0) return;
  pdl::launch(sigmoid_kernel, rowwise::grid_for(n), 256, 0, x, n);
  K3_CUDA_LAUNCH_CHECK();
}

void mul_sigmoid(float* x, const float* g, int64_t n) {
  check_n(n, "mul_sigmoid");
  if (n == 0) return;
  pdl::launch(mul_sigmoid_kernel<float>, rowwise::grid_for(n), 256, 0, x, g, n);
  K3_CUDA_LAUNCH_CHECK();
}

void mul_sigmoid(uint16_t* x, const uint16_t* g, int64_t n) {
  check_n(n, "mul_sigmoid");
  if (n == 0) return;
  pdl::launch(mul_sigmoid_kernel<bf16>, rowwise::grid_for(n), 256, 0, x, g, n);
  K3_CUDA_LAUNCH_CHECK();
}

void copy_rows(void* dst, DType dst_type, int64_t ld_dst, const void* src, DType src_type, int64_t ld_src, int64_t rows,
               int64_t cols) {
  K3_CHECK(rows >= 0 && cols >= 0 && ld_dst >= cols && ld_src >= cols, "copy_rows (cuda): bad shape rows=", rows,
           " cols=", cols, " ld_dst=", ld_dst, " ld_src=", ld_src);
  const bool ok_types =
      (dst_type == DType::F32 || dst_type == DType::BF16) && (src_type == DType::F32 || src_type == DType::BF16);
  K3_CHECK(ok_types, "copy_rows (cuda): F32/BF16 only, got ", dtype_name(src_type), " -> ", dtype_name(dst_type));
  if (rows == 0 || cols == 0) return;
  const unsigned grid = rowwise::grid_for(rows * cols);
  if (dst_type == DType::F32 && src_type == DType::F32)
    pdl::launch(copy_rows_kernel<float, float>, grid, 256, 0, static_cast<float*>(dst), ld_dst,
                static_cast<const float*>(src), ld_src, rows, cols);
  else if (dst_type == DType::BF16 && src_type == DType::F32)
    pdl::launch(copy_rows_kernel<bf16, float>, grid, 256, 0, static_cast<bf16*>(dst), ld_dst,
                static_cast<const float*>(src), ld_src, rows, cols);
  else if (dst_type == DType::F32 && src_type == DType::BF16)
    pdl::launch(copy_rows_kernel<float, bf16>, grid, 256, 0, static_cast<float*>(dst), ld_dst,
                static_cast<const bf16*>(src), ld_src, rows, cols);
  else
    pdl::launch(copy_rows_kernel<bf16, bf16>, grid, 256, 0, static_cast<bf16*>(dst), ld_dst,
                static_cast<const bf16*>(src), ld_src, rows, cols);
  K3_CUDA_LAUNCH_CHECK();
}

void gather_rows(float* dst, const float* src, const int32_t* index, int64_t n, int64_t cols) {
  check_n(n * cols, "gather_rows");
  if (n == 0 || cols == 0) return;
  pdl::launch(gather_kernel, rowwise::grid_for(n * cols), 256, 0, dst, src, index, n, cols);
  K3_CUDA_LAUNCH_CHECK();
}

void scatter_add_rows(float* dst, const float* src, const int32_t* index, const float* weight, int64_t n,
                      int64_t cols) {
  check_n(n * cols, "scatter_add_rows");
  if (n == 0 || cols == 0) return;
  pdl::launch(scatter_add_kernel, rowwise::grid_for(n * cols), 256, 0, dst, src, index, weight, n, cols);
  K3_CUDA_LAUNCH_CHECK();
}

void embedding_gather_f32(float* out, const float* table, const int32_t* ids, int64_t T, int64_t V, int64_t D) {
  check_n(T * D, "embedding_gather_f32");
  if (T == 0 || D == 0) return;
  pdl::launch(embedding_f32_kernel, rowwise::grid_for(T * D), 256, 0, out, table, ids, T, V, D);
  K3_CUDA_LAUNCH_CHECK();
}

}  // namespace k3::elementwise::cuda
