// Dense linear layers through cuBLASLt / cuBLAS (linear_cuda.h).
#include <cublasLt.h>

#include <climits>
#include <map>
#include <tuple>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/gemm/linear_cuda.h"

#define K3_CUBLASLT_CHECK(call) K3_CUBLAS_CHECK(call)  // cublasLt returns cublasStatus_t too

namespace k3::gemm::cuda {

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS' recommendation for Hopper

// Largest power of two (<= 256) that divides the address: what the cuBLASLt heuristic must assume.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al >>= 1;
  return al;
}

cudaDataType_t cuda_type(DType t) { return t == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F; }

// One cached cuBLASLt plan: descriptors for the TN GEMM and the heuristic's first algorithm.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
};

using PlanKey =
    std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, uint32_t, uint32_t, uint32_t>;

}  // namespace

struct GemmContext::Impl {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;        // default math: BF16 GEMMs on tensor cores
  cublasHandle_t blas_exact = nullptr;  // CUBLAS_PEDANTIC_MATH: fp32 GEMMs, no TF32
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;
  double* scratch_[2] = {nullptr, nullptr};  // the exact GEMM's fp64 operands (widened x, fp64 y)
  size_t scratch_n_[2] = {0, 0};

  // Scratch i of at least n doubles (grown by cudaMalloc; contents not kept).
  double* scratch(int i, size_t n) {
    if (n > scratch_n_[i]) {
      if (scratch_[i]) K3_CUDA_CHECK(cudaFree(scratch_[i]));
      scratch_[i] = nullptr;
      scratch_n_[i] = 0;
      K3_CUDA_CHECK(cudaMalloc(&scratch_[i], n * sizeof(double)));
      scratch_n_[i] = n;
    }
    return scratch_[i];
  }

  ~Impl() {  // teardown: errors are ignored (the process may be exiting)
    for (auto& kv : plans) {
      Plan& p = kv.second;
      if (p.a) cublasLtMatrixLayoutDestroy(p.a);
      if (p.b) cublasLtMatrixLayoutDestroy(p.b);
      if (p.c) cublasLtMatrixLayoutDestroy(p.c);
      if (p.op) cublasLtMatmulDescDestroy(p.op);
    }
    if (blas_exact) cublasDestroy(blas_exact);
    if (blas) cublasDestroy(blas);
    if (lt) cublasLtDestroy(lt);
    if (workspace) cudaFree(workspace);
    for (double* p : scratch_)
      if (p) cudaFree(p);
  }

  const Plan& plan(const LinearParams& p, int64_t ld_x, int64_t ld_y, int64_t ld_w) {
    const PlanKey key{p.M,
                      p.N,
                      p.K,
                      ld_x,
                      ld_y,
                      ld_w,
                      int(p.in_type),
                      int(p.y_type),
                      alignment_of(p.x),
                      alignment_of(p.w),
                      alignment_of(p.y)};
    auto it = plans.find(key);
    if (it != plans.end()) return it->second;
    Plan pl;
    K3_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&pl.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    K3_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    K3_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    // Layouts describe the matrices as stored (column-major): W is K x N (ld_w), x is K x M (ld_x),
    // y is N x M (ld_y). TRANSA makes op(A) = N x K.
    K3_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&pl.a, cuda_type(p.in_type), uint64_t(p.K), uint64_t(p.N), ld_w));
    K3_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&pl.b, cuda_type(p.in_type), uint64_t(p.K), uint64_t(p.M), ld_x));
    K3_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&pl.c, cuda_type(p.y_type), uint64_t(p.N), uint64_t(p.M), ld_y));
    cublasLtMatmulPreference_t pref = nullptr;
    K3_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = kWorkspaceBytes;
    const uint32_t al_a = alignment_of(p.w), al_b = alignment_of(p.x), al_c = alignment_of(p.y);
    cublasStatus_t st =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
    cublasLtMatmulHeuristicResult_t res{};
    int found = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(lt, pl.op, pl.a, pl.b, pl.c, pl.c, pref, 1, &res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    // "not supported" (no algorithm for this shape/alignment) is an answer, not an error.
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
      plans.emplace(key, pl);  // keep the descriptors owned, then report
      K3_CUBLASLT_CHECK(st);
    }
    pl.has_algo = st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS;
    if (pl.has_algo) pl.algo = res.algo;
    return plans.emplace(key, pl).first->second;
  }
};

GemmContext::GemmContext() : impl_(std::make_unique<Impl>()) {
  K3_CUBLAS_CHECK(cublasLtCreate(&impl_->lt));
  K3_CUBLAS_CHECK(cublasCreate(&impl_->blas));
  K3_CUBLAS_CHECK(cublasCreate(&impl_->blas_exact));
  K3_CUBLAS_CHECK(cublasSetMathMode(impl_->blas_exact, CUBLAS_PEDANTIC_MATH));
  K3_CUDA_CHECK(cudaMalloc(&impl_->workspace, kWorkspaceBytes));
  K3_CUBLAS_CHECK(cublasSetWorkspace(impl_->blas, impl_->workspace, kWorkspaceBytes));
  K3_CUBLAS_CHECK(cublasSetWorkspace(impl_->blas_exact, impl_->workspace, kWorkspaceBytes));
  // The calling thread's default stream, as every kernel of the backend (core/cuda.h).
  K3_CUBLAS_CHECK(cublasSetStream(impl_->blas, cudaStreamPerThread));
  K3_CUBLAS_CHECK(cublasSetStream(impl_->blas_exact, cudaStreamPerThread));
}

GemmContext::~GemmContext() = default;

std::string can_run(const LinearParams& p) {
  const bool bf = p.in_type == DType::BF16 && (p.y_type == DType::F32 || p.y_type == DType::BF16);
  const bool f32 = p.in_type == DType::F32 && p.y_type == DType::F32;
  if (!bf && !f32)
    return std::string("linear (cuda): supported are BF16 x BF16 -> F32/BF16 and F32 x F32 -> F32, got ") +
           dtype_name(p.in_type) + " -> " + dtype_name(p.y_type);
  if (p.M < 0 || p.N < 0 || p.K < 0) return "linear (cuda): negative shape";
  if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    return "linear (cuda): M, N, K must each be <= 2^31-1, got " + std::to_string(p.M) + ", " + std::to_string(p.N) +
           ", " + std::to_string(p.K);
  const int64_t ld_x = p.ld_x ? p.ld_x : p.K, ld_w = p.ld_w ? p.ld_w : (p.w_in_out ? p.N : p.K),
                ld_y = p.ld_y ? p.ld_y : p.N;
  if (ld_x < p.K || (!p.w_in_out && ld_w < p.K) || ld_y < p.N)
    return "linear (cuda): a row stride is smaller than its row";
  if (ld_x > INT_MAX || ld_w > INT_MAX || ld_y > INT_MAX) return "linear (cuda): row strides must be <= 2^31-1";
  if (p.M > 0 && p.N > 0 && (!p.y || (p.K > 0 && (!p.x || !p.w)))) return "linear (cuda): null pointer";
  if (f32 && p.backend == GemmBackend::Lt) return "linear (cuda): the F32 exact mode runs on cublasGemmEx, not Lt";
  if (p.batch < 1 || p.batch > INT_MAX)
    return "linear (cuda): batch must be in [1, 2^31-1], got " + std::to_string(p.batch);
  if (p.w_in_out && ld_w < p.N) return "linear (cuda): W is [K, N] (w_in_out) but ld_w < N";
  if ((p.batch > 1 || p.w_in_out) && p.backend == GemmBackend::Lt)
    return "linear (cuda): batched and [K, N] products run on cublasGemmStridedBatchedEx, not Lt";
  return {};
}

void linear_forward(GemmContext& ctx, const LinearParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail(why);
  if (p.M == 0 || p.N == 0) return;
  const int64_t ld_x = p.ld_x ? p.ld_x : p.K, ld_w = p.ld_w ? p.ld_w : (p.w_in_out ? p.N : p.K),
                ld_y = p.ld_y ? p.ld_y : p.N;
  const size_t ysz = dtype_size(p.y_type);
  if (p.K == 0) {  // empty sum: y = 0, or unchanged when accumulating
    if (p.accumulate && p.beta != 1.0f) fail("linear (cuda): K = 0 with beta != 1 is not supported");
    if (!p.accumulate)
      for (int64_t b = 0; b < p.batch; ++b)
        K3_CUDA_CHECK(cudaMemset2D(static_cast<char*>(p.y) + b * p.stride_y * int64_t(ysz), size_t(ld_y) * ysz, 0,
                                   size_t(p.N) * ysz, size_t(p.M)));
    return;
  }
  GemmContext::Impl& c = ctx.impl();
  const float alpha = p.alpha, beta = p.accumulate ? p.beta : 0.0f;
  const int m = int(p.N), n = int(p.M), k = int(p.K);

  if (p.batch > 1 || p.w_in_out) {  // column-major: yᵀ[N, M] = op(W)·xᵀ, op = T for [N, K], N for [K, N]
    const bool exact = p.in_type == DType::F32;
    K3_CUBLAS_CHECK(cublasGemmStridedBatchedEx(exact ? c.blas_exact : c.blas, p.w_in_out ? CUBLAS_OP_N : CUBLAS_OP_T,
                                               CUBLAS_OP_N, m, n, k, &alpha, p.w, cuda_type(p.in_type), int(ld_w),
                                               p.stride_w, p.x, cuda_type(p.in_type), int(ld_x), p.stride_x, &beta, p.y,
                                               cuda_type(p.y_type), int(ld_y), p.stride_y, int(p.batch),
                                               exact ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                                               CUBLAS_GEMM_DEFAULT));
    return;
  }

  if (p.in_type == DType::F32) {
    K3_CUBLAS_CHECK(cublasGemmEx(c.blas_exact, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, p.w, CUDA_R_32F, int(ld_w),
                                 p.x, CUDA_R_32F, int(ld_x), &beta, p.y, CUDA_R_32F, int(ld_y),
                                 CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
    return;
  }
  if (p.backend != GemmBackend::Classic) {
    const Plan& pl = c.plan(p, ld_x, ld_y, ld_w);
    if (pl.has_algo) {
      K3_CUBLAS_CHECK(cublasLtMatmul(c.lt, pl.op, &alpha, p.w, pl.a, p.x, pl.b, &beta, p.y, pl.c, p.y, pl.c, &pl.algo,
                                     c.workspace, kWorkspaceBytes, cudaStreamPerThread));
      return;
    }
    if (p.backend == GemmBackend::Lt)
      fail("linear (cuda): cuBLASLt has no algorithm for M=", p.M, " N=", p.N, " K=", p.K, " ld_x=", ld_x,
           " ld_w=", ld_w, " ld_y=", ld_y, " (", dtype_name(p.in_type), " -> ", dtype_name(p.y_type), ")");
  }
  K3_CUBLAS_CHECK(cublasGemmEx(c.blas, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, p.w, CUDA_R_16BF, int(ld_w), p.x,
                               CUDA_R_16BF, int(ld_x), &beta, p.y, cuda_type(p.y_type), int(ld_y), CUBLAS_COMPUTE_32F,
                               CUBLAS_GEMM_DEFAULT));
}

namespace {
// The three typed entry points below: y = x Wᵀ (+ y), dense rows, W [N, K].
void linear_dense(GemmContext& ctx, void* y, DType y_type, const void* x, const void* w, DType in_type, int64_t M,
                  int64_t N, int64_t K, bool accumulate) {
  LinearParams p;
  p.y = y, p.y_type = y_type, p.x = x, p.w = w, p.in_type = in_type;
  p.M = M, p.N = N, p.K = K, p.accumulate = accumulate;
  linear_forward(ctx, p);
}
}  // namespace

void linear_bf16(GemmContext& ctx, float* y, const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                 bool accumulate) {
  linear_dense(ctx, y, DType::F32, x, w, DType::BF16, M, N, K, accumulate);
}

void linear_bf16(GemmContext& ctx, uint16_t* y, const uint16_t* x, const uint16_t* w, int64_t M, int64_t N, int64_t K,
                 bool accumulate) {
  linear_dense(ctx, y, DType::BF16, x, w, DType::BF16, M, N, K, accumulate);
}

void linear_f32_exact(GemmContext& ctx, float* y, const float* x, const float* w, int64_t M, int64_t N, int64_t K,
                      bool accumulate) {
  linear_dense(ctx, y, DType::F32, x, w, DType::F32, M, N, K, accumulate);
}

namespace {

__global__ void widen_rows_kernel(double* __restrict__ dst, const float* __restrict__ src, int64_t ld_src, int64_t rows,
                                  int64_t cols) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[i] = double(src[r * ld_src + c]);
  }
}

__global__ void narrow_rows_kernel(float* __restrict__ dst, int64_t ld_dst, const double* __restrict__ src,
                                   int64_t rows, int64_t cols) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[r * ld_dst + c] = float(src[i]);
  }
}

}  // namespace

// y64[M, N] (ld_y) = widen(x)[M, K] · W[N, K]ᵀ in fp64.
void linear_exact_f64(GemmContext& ctx, double* y, int64_t ld_y, const float* x, int64_t ld_x, const double* w,
                      int64_t M, int64_t N, int64_t K) {
  K3_CHECK(M >= 0 && N >= 0 && K >= 0 && M <= INT_MAX && N <= INT_MAX && K <= INT_MAX && ld_x >= K && ld_y >= N,
           "linear_exact (cuda): bad shape M=", M, " N=", N, " K=", K, " ld_x=", ld_x, " ld_y=", ld_y);
  if (M == 0 || N == 0) return;
  GemmContext::Impl& c = ctx.impl();
  double* x64 = c.scratch(0, size_t(M * K));
  if (K > 0) {
    widen_rows_kernel<<<rowwise::grid_for(M * K), 256>>>(x64, x, ld_x, M, K);
    K3_CUDA_LAUNCH_CHECK();
  }
  const double alpha = 1.0, beta = 0.0;
  K3_CUBLAS_CHECK(cublasGemmEx(c.blas_exact, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &alpha, w, CUDA_R_64F,
                               int(K > 0 ? K : 1), x64, CUDA_R_64F, int(K > 0 ? K : 1), &beta, y, CUDA_R_64F, int(ld_y),
                               CUBLAS_COMPUTE_64F, CUBLAS_GEMM_DEFAULT));
}

void linear_exact(GemmContext& ctx, float* y, int64_t ld_y, const float* x, int64_t ld_x, const double* w, int64_t M,
                  int64_t N, int64_t K) {
  K3_CHECK(ld_y >= N, "linear_exact (cuda): ld_y ", ld_y, " < N ", N);
  if (M == 0 || N == 0) return;
  double* y64 = ctx.impl().scratch(1, size_t(M * N));
  linear_exact_f64(ctx, y64, N, x, ld_x, w, M, N, K);
  narrow_rows_kernel<<<rowwise::grid_for(M * N), 256>>>(y, ld_y, y64, M, N);
  K3_CUDA_LAUNCH_CHECK();
}

void lm_head_forward(GemmContext& ctx, float* logits, const uint16_t* x, const uint16_t* lm_head, int64_t M, int64_t V,
                     int64_t D) {
  linear_bf16(ctx, logits, x, lm_head, M, V, D, false);
}

std::string can_run(const WeightGradParams& p) {
  if (p.in_type != DType::F32 && p.in_type != DType::BF16)
    return std::string("linear weight gradient (cuda): dy and x must be F32 or BF16, got ") + dtype_name(p.in_type);
  if (p.M < 0 || p.N < 0 || p.K < 0) return "linear weight gradient (cuda): negative shape";
  if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
    return "linear weight gradient (cuda): M, N, K must each be <= 2^31-1, got " + std::to_string(p.M) + ", " +
           std::to_string(p.N) + ", " + std::to_string(p.K);
  const int64_t ld_dw = p.ld_dw ? p.ld_dw : p.K, ld_dy = p.ld_dy ? p.ld_dy : p.N, ld_x = p.ld_x ? p.ld_x : p.K;
  if (ld_dw < p.K || ld_dy < p.N || ld_x < p.K)
    return "linear weight gradient (cuda): a row stride is smaller than its row";
  if (ld_dw > INT_MAX || ld_dy > INT_MAX || ld_x > INT_MAX)
    return "linear weight gradient (cuda): row strides must be <= 2^31-1";
  if (p.batch < 1 || p.batch > INT_MAX)
    return "linear weight gradient (cuda): batch must be in [1, 2^31-1], got " + std::to_string(p.batch);
  if (p.N > 0 && p.K > 0 && (!p.dw || (p.M > 0 && (!p.dy || !p.x))))
    return "linear weight gradient (cuda): null pointer";
  return {};
}

void linear_weight_grad(GemmContext& ctx, const WeightGradParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail(why);
  if (p.N == 0 || p.K == 0) return;
  const int64_t ld_dw = p.ld_dw ? p.ld_dw : p.K, ld_dy = p.ld_dy ? p.ld_dy : p.N, ld_x = p.ld_x ? p.ld_x : p.K;
  if (p.M == 0) {  // empty sum
    if (!p.accumulate)
      for (int64_t b = 0; b < p.batch; ++b)
        K3_CUDA_CHECK(cudaMemset2D(p.dw + b * p.stride_dw, size_t(ld_dw) * sizeof(float), 0,
                                   size_t(p.K) * sizeof(float), size_t(p.N)));
    return;
  }
  GemmContext::Impl& c = ctx.impl();
  const bool exact = p.in_type == DType::F32;
  const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
  // Column-major dWᵀ[K, N] = xᵀ[K, M] · dy[M, N]: x row-major is xᵀ column-major (op N), dy row-major is
  // dyᵀ column-major (op T).
  K3_CUBLAS_CHECK(cublasGemmStridedBatchedEx(exact ? c.blas_exact : c.blas, CUBLAS_OP_N, CUBLAS_OP_T, int(p.K),
                                             int(p.N), int(p.M), &alpha, p.x, cuda_type(p.in_type), int(ld_x),
                                             p.stride_x, p.dy, cuda_type(p.in_type), int(ld_dy), p.stride_dy, &beta,
                                             p.dw, CUDA_R_32F, int(ld_dw), p.stride_dw, int(p.batch),
                                             exact ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F,
                                             CUBLAS_GEMM_DEFAULT));
}

}  // namespace k3::gemm::cuda
