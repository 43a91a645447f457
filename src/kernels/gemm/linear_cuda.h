// Dense linear layers on the GPU through cuBLASLt / cuBLAS: the CUDA twin of kernels/gemm/linear.h.
//   y[M, N] (+)= x[M, K] · W[N, K]ᵀ           W is [out, in] row-major (PyTorch layout), as on the CPU
// Modes (picked from the dtypes):
//   - x, W BF16 -> y F32 or BF16: tensor cores, fp32 accumulation (CUBLAS_COMPUTE_32F). The serving path.
//   - x, W F32  -> y F32: CUBLAS_COMPUTE_32F_PEDANTIC on a handle in CUBLAS_PEDANTIC_MATH, i.e. plain
//     fp32 FMAs, TF32 OFF (NVIDIA_TF32_OVERRIDE cannot turn it on). For exact parity runs against the
//     CPU twin; expect relative L2 ~ 2^-24·sqrt(K) (fp32 accumulation), e.g. ~1.5e-6 at K = 7168.
// Row-major y = x·Wᵀ is column-major yᵀ = W·xᵀ, so every call is the "TN" GEMM m=N, n=M, k=K with
// A = W (lda = ld_w), B = x (ldb = ld_x), C = y (ldc = ld_y): no copies, any row strides.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/dtype.h"

namespace k3::gemm::cuda {

// Which cuBLAS entry point runs a BF16 GEMM. Auto = cuBLASLt with its heuristic's first algorithm
// (cached per shape, strides, dtypes and pointer alignment), falling back to cublasGemmEx when the
// heuristic offers none. Lt / Classic force one (Lt throws when it has no algorithm); the benchmark
// times both. F32 exact mode always uses cublasGemmEx (pedantic).
enum class GemmBackend { Auto, Lt, Classic };

// Owns the cuBLASLt handle, two cuBLAS handles (default math; pedantic fp32), a 32 MiB workspace
// and the cache of cuBLASLt plans. Create one per process (or per model) and pass it to every call;
// not thread-safe (one stream, one caller). Needs a GPU (throws k3::Error otherwise).
class GemmContext {
 public:
  GemmContext();
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct LinearParams {
  void* y = nullptr;  // [M, ld_y] of y_type
  DType y_type = DType::F32;
  int64_t ld_y = 0;             // elements (0: N)
  const void* x = nullptr;      // [M, ld_x] of in_type
  int64_t ld_x = 0;             // elements (0: K)
  const void* w = nullptr;      // [N, ld_w] of in_type
  int64_t ld_w = 0;             // elements (0: K)
  DType in_type = DType::BF16;  // of x and W
  int64_t M = 0, N = 0, K = 0;
  bool accumulate = false;  // y += x·Wᵀ (y is read in y_type) instead of y = x·Wᵀ
  // y = alpha·x·Wᵀ (+ beta·y with accumulate), in fp32 before y is rounded: cuBLAS's own epilogue (the
  // Newton–Schulz polynomial's coefficients). Not with K = 0 unless alpha = beta = 1.
  float alpha = 1.0f, beta = 1.0f;
  GemmBackend backend = GemmBackend::Auto;
  // W stored [K, N] (ld_w >= N) instead of [N, K]: y = x·W. MLA's weight absorption reads W_kb that way.
  bool w_in_out = false;
  // `batch` independent products, operand b at x + b·stride_x, W + b·stride_w, y + b·stride_y
  // (elements): one cublasGemmStridedBatchedEx. MLA's per-head products run as one call.
  int64_t batch = 1;
  int64_t stride_x = 0, stride_w = 0, stride_y = 0;
};

// Empty string when linear_forward can take p, else why not (dtype pair, dims over 2^31-1, strides).
std::string can_run(const LinearParams& p);
// Throws k3::Error with can_run's reason, or with cuBLAS's status when a call fails.
void linear_forward(GemmContext& ctx, const LinearParams& p);

// Shorthands for dense operands (ld = K for x and W, N for y).
void linear_bf16(GemmContext& ctx, float* y, const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                 bool accumulate = false);
void linear_bf16(GemmContext& ctx, uint16_t* y, const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                 bool accumulate = false);
void linear_f32_exact(GemmContext& ctx, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                      bool accumulate = false);

// The exact path's GEMM (the CUDA twin of the CPU's default fp64 accumulation, kernels/gemm/linear.h):
// W is held in fp64 on the device; x (fp32) is widened to fp64, the product runs in fp64 FMAs
// (cublasGemmEx, CUBLAS_COMPUTE_64F) and y is rounded once to fp32 (linear_exact) or kept in fp64
// (linear_exact_f64). y[M, N] (ld_y) = x[M, K] (ld_x) · W[N, K]ᵀ (ld_w = K). Scratch is held by the context.
void linear_exact(GemmContext& ctx, float* y, int64_t ld_y, const float* x, int64_t ld_x, const double* w, int64_t M,
                  int64_t N, int64_t K);
void linear_exact_f64(GemmContext& ctx, double* y, int64_t ld_y, const float* x, int64_t ld_x, const double* w,
                      int64_t M, int64_t N, int64_t K);

// The output head: logits[M, V] (fp32) = x[M, D] (bf16, the final-normed rows) · lm_head[V, D]ᵀ.
// A plain BF16 GEMM (no soft-cap, no scaling in K3); its own name so profiles and callers read well.
void lm_head_forward(GemmContext& ctx, float* logits, const uint16_t* x, const uint16_t* lm_head, int64_t M, int64_t V,
                     int64_t D);

// The weight gradient of y = x·Wᵀ (training): dW[N, K] (+)= dyᵀ·x, summed over the M rows.
//   dy [M, N] (ld_dy), x [M, K] (ld_x), both F32 (pedantic fp32, TF32 off: the f32 training mode) or
//   both BF16 (tensor cores, fp32 accumulation: the bf16 mode); dW is always F32 (the fp32 gradient
//   buffer). Column-major this is dWᵀ[K, N] = xᵀ·dy, one cublasGemmEx "NT" with no copies.
//   The input gradient dx = dy·W is linear_forward with w_in_out = true (W read as [N, K] = "[K, N]").
struct WeightGradParams {
  float* dw = nullptr;  // [N, ld_dw] fp32
  int64_t ld_dw = 0;    // elements (0: K)
  const void* dy = nullptr;
  int64_t ld_dy = 0;  // elements (0: N)
  const void* x = nullptr;
  int64_t ld_x = 0;            // elements (0: K)
  DType in_type = DType::F32;  // of dy and x
  int64_t M = 0, N = 0, K = 0;
  bool accumulate = true;  // dW += (the usual: gradients of one step accumulate); false: dW =
  // `batch` independent products at dw + b·stride_dw, dy + b·stride_dy, x + b·stride_x (elements).
  int64_t batch = 1;
  int64_t stride_dw = 0, stride_dy = 0, stride_x = 0;
};
std::string can_run(const WeightGradParams& p);
void linear_weight_grad(GemmContext& ctx, const WeightGradParams& p);

}  // namespace k3::gemm::cuda
