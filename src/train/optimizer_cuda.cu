// AdamW, Muon (Per-Head Muon) and global-norm clipping on the GPU (optimizer_cuda.h): the twins of
// train/optimizer.cpp's Optimizer::step, newton_schulz and clip_grad_norm.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "train/optimizer_cuda.h"

namespace k3::train {

namespace {

namespace gc = gemm::cuda;

constexpr int kThreads = 256;
// Elements of one segment that one block of the first reduction pass sums (fixed, so the partial sums
// and hence the result depend only on the data and the segment length).
constexpr int64_t kChunk = int64_t(kThreads) * 32;
// Largest Muon batch (elements of X) and block count: bounds the Newton–Schulz scratch and keeps the
// batch within cuBLAS's int batch count and the grid's y dimension. A single larger block is still
// one batch of its own.
constexpr int64_t kMaxBatchElems = int64_t(1) << 26;
constexpr int64_t kMaxBatchBlocks = 65535;

#define K3_GRID_STRIDE(i, n) \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

unsigned grid_for(int64_t work) {
  int64_t b = (work + kThreads - 1) / kThreads;
  return unsigned(std::clamp<int64_t>(b, 1, 65536));
}

int64_t chunks_of(int64_t len) { return std::max<int64_t>(1, (len + kChunk - 1) / kChunk); }

// Sum of v over the block (kThreads threads) in a fixed tree order; every thread gets the result.
template <class T>
__device__ T block_sum(T v) {
  __shared__ T sh[kThreads];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  const T r = sh[0];
  __syncthreads();
  return r;
}

// Pass 1 of a segmented sum of squares: `gridDim.y` segments of `len` floats at x + s·len; block
// (c, s) sums chunk c (kChunk elements) of segment s in double: partial[s·chunks + c]. With `bad`
// (optional) it also counts the non-finite entries.
__global__ void sumsq_partial_kernel(const float* __restrict__ x, int64_t len, int64_t chunks,
                                     double* __restrict__ partial, int64_t* __restrict__ bad) {
  const int64_t s = blockIdx.y, c = blockIdx.x;
  const float* seg = x + s * len;
  const int64_t end = std::min(len, (c + 1) * kChunk);
  double acc = 0.0;
  int64_t nb = 0;
  for (int64_t i = c * kChunk + threadIdx.x; i < end; i += kThreads) {
    const double v = double(seg[i]);
    acc += v * v;  // exact: a float's square fits in a double
    nb += !isfinite(v);
  }
  acc = block_sum(acc);
  if (bad) nb = block_sum(nb);
  if (threadIdx.x == 0) {
    partial[s * chunks + c] = acc;
    if (bad) bad[s * chunks + c] = nb;
  }
}

// Pass 2: block s sums segment s's partials in a fixed order: norm[s] = sqrt(Σ), and with `bad` the
// non-finite count into *bad_out (single segment only).
__global__ void sumsq_final_kernel(const double* __restrict__ partial, const int64_t* __restrict__ bad, int64_t chunks,
                                   double* __restrict__ norm, int64_t* __restrict__ bad_out) {
  const int64_t s = blockIdx.x;
  double acc = 0.0;
  int64_t nb = 0;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    acc += partial[s * chunks + c];
    if (bad) nb += bad[s * chunks + c];
  }
  acc = block_sum(acc);
  if (bad) nb = block_sum(nb);
  if (threadIdx.x == 0) {
    norm[s] = sqrt(acc);
    if (bad) *bad_out = nb;
  }
}

// g *= max_norm / norm when norm > max_norm (the norm is read on the device: no host sync).
__global__ void clip_scale_kernel(float* __restrict__ g, int64_t n, double max_norm, const double* __restrict__ norm) {
  const double nrm = *norm;
  if (!(nrm > max_norm)) return;
  const double f = max_norm / nrm;
  K3_GRID_STRIDE(i, n) g[i] = float(double(g[i]) * f);
}

// AdamW over the concatenation of every AdamW tensor (segments by ascending start), the CPU's
// arithmetic in double: m, v moments; decay; p -= (lr/bc1)·m / (sqrt(v)/sqrt(bc2) + eps).
__global__ void adamw_kernel(float* __restrict__ W, const float* __restrict__ G, float* __restrict__ state,
                             const CudaOptimizer::AdamSegment* __restrict__ segs, int64_t nseg, int64_t total,
                             double lr, double beta1, double beta2, double eps, double wd, double bc1,
                             double sqrt_bc2) {
  K3_GRID_STRIDE(i, total) {
    int64_t lo = 0, hi = nseg;  // the last segment with start <= i
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (segs[mid].start <= i) lo = mid;
      else hi = mid;
    }
    const CudaOptimizer::AdamSegment sg = segs[lo];
    const int64_t k = i - sg.start;
    float* m = state + sg.state + k;
    float* v = m + sg.numel;
    const double g = double(G[sg.param + k]);
    const double mn = beta1 * double(*m) + (1.0 - beta1) * g;
    const double vn = beta2 * double(*v) + (1.0 - beta2) * g * g;
    *m = float(mn);
    *v = float(vn);
    const double lr_t = lr * sg.lr_scale;
    const double keep = sg.decay ? 1.0 - lr_t * wd : 1.0;
    double w = double(W[sg.param + k]);
    w *= keep;
    w -= (lr_t / bc1) * mn / (sqrt(vn) / sqrt_bc2 + eps);
    W[sg.param + k] = float(w);
  }
}

// Where element j (row-major [rows, cols] in the block) sits in X: [rows, cols] as is, or [cols, rows]
// when the block is tall (transposed so that X has rows <= cols, as the CPU's newton_schulz).
__device__ __forceinline__ int64_t x_index(int64_t j, int64_t rows, int64_t cols, bool tall) {
  if (!tall) return j;
  const int64_t row = j / cols, col = j - row * cols;
  return col * rows + row;
}

// Momentum and the Nesterov direction of every block of a batch: buf = μ·buf + g; u = g + μ·buf
// (plain: u = buf) into X (block b at X + b·len, oriented by x_index).
__global__ void muon_momentum_kernel(float* __restrict__ X, float* __restrict__ state, const float* __restrict__ G,
                                     const CudaOptimizer::MuonBlock* __restrict__ blocks, int64_t count, int64_t rows,
                                     int64_t cols, bool tall, double mu, bool nesterov) {
  const int64_t len = rows * cols;
  K3_GRID_STRIDE(i, count * len) {
    const int64_t b = i / len, j = i - b * len;
    const CudaOptimizer::MuonBlock bl = blocks[b];
    const double g = double(G[bl.param + j]);
    const double buf = mu * double(state[bl.state + j]) + g;
    state[bl.state + j] = float(buf);
    X[b * len + x_index(j, rows, cols, tall)] = float(nesterov ? g + mu * buf : buf);
  }
}

// X ← X / ‖X‖_F per block (norm in double, 0 for an exactly zero block: the CPU's zero test), and its
// bf16 copy for the bf16 GEMMs.
__global__ void ns_normalize_kernel(float* __restrict__ X, __nv_bfloat16* __restrict__ Xb,
                                    const double* __restrict__ norm, int64_t count, int64_t len) {
  K3_GRID_STRIDE(i, count * len) {
    const double n = norm[i / len];
    const float x = n == 0.0 ? 0.0f : float(double(X[i]) / n);
    X[i] = x;
    if (Xb) Xb[i] = __float2bfloat16_rn(x);
  }
}

// B = b·A + c·A² (AA holds A², overwritten with B).
__global__ void ns_poly_kernel(float* __restrict__ AA, const float* __restrict__ A, int64_t n, double b, double c) {
  K3_GRID_STRIDE(i, n) AA[i] = float(b * double(A[i]) + c * double(AA[i]));
}

// X ← a·X + Y (Y = B·X).
__global__ void ns_axpy_kernel(float* __restrict__ X, const float* __restrict__ Y, int64_t n, double a) {
  K3_GRID_STRIDE(i, n) X[i] = float(a * double(X[i]) + double(Y[i]));
}

__device__ inline double load_double(const float* p) { return double(*p); }
__device__ inline double load_double(const __nv_bfloat16* p) { return double(__bfloat162float(*p)); }

// W ← W·keep − lr·scale·O per block (the CPU's two steps, in double, rounded once); O fp32 or bf16.
template <class XT>
__global__ void muon_update_kernel(float* __restrict__ W, const XT* __restrict__ X,
                                   const CudaOptimizer::MuonBlock* __restrict__ blocks, int64_t count, int64_t rows,
                                   int64_t cols, bool tall, double lr, double wd, double scale) {
  const int64_t len = rows * cols;
  K3_GRID_STRIDE(i, count * len) {
    const int64_t b = i / len, j = i - b * len;
    const CudaOptimizer::MuonBlock bl = blocks[b];
    const double lr_t = lr * bl.lr_scale;
    const double keep = bl.decay ? 1.0 - lr_t * wd : 1.0;
    const double o = load_double(X + b * len + x_index(j, rows, cols, tall));
    double w = double(W[bl.param + j]);
    w *= keep;
    w -= lr_t * scale * o;
    W[bl.param + j] = float(w);
  }
}

// Per-block Frobenius norms of `count` segments of `len` floats at x: norm[s].
void segment_norms(const float* x, int64_t count, int64_t len, double* partial, double* norm) {
  const int64_t chunks = chunks_of(len);
  sumsq_partial_kernel<<<dim3(unsigned(chunks), unsigned(count)), kThreads>>>(x, len, chunks, partial, nullptr);
  K3_CUDA_LAUNCH_CHECK();
  sumsq_final_kernel<<<unsigned(count), kThreads>>>(partial, nullptr, chunks, norm, nullptr);
  K3_CUDA_LAUNCH_CHECK();
}

// One strided-batched product of the Newton–Schulz iteration over a batch's blocks (block i's operands
// at i·stride): y = alpha·x·op(w), plus beta·y when beta != 0, with operands and result of `type`
// (F32: pedantic fp32 GEMMs, muon_batch; BF16: fp32 accumulation and epilogue, muon_batch_bf16).
void ns_gemm(gc::GemmContext& ctx, DType type, void* y, const void* x, const void* w, int64_t M, int64_t N, int64_t K,
             bool w_in_out, int64_t batch, int64_t stride_x, int64_t stride_w, int64_t stride_y, double alpha = 1.0,
             double beta = 0.0) {
  gc::LinearParams p;
  p.y = y, p.y_type = type, p.x = x, p.w = w, p.in_type = type;
  p.M = M, p.N = N, p.K = K, p.w_in_out = w_in_out;
  p.batch = batch, p.stride_x = stride_x, p.stride_w = stride_w, p.stride_y = stride_y;
  p.alpha = float(alpha), p.beta = float(beta), p.accumulate = beta != 0.0;
  gc::linear_forward(ctx, p);
}

}  // namespace

CudaOptimizer::CudaOptimizer(const Optimizer& plan, const ParamStore& P, float* params, float* grads,
                             gc::GemmContext& ctx, bool newton_schulz_bf16)
    : cfg_(plan.config()), plan_(plan.plan()), params_(params), grads_(grads), ctx_(ctx), ns_bf16_(newton_schulz_bf16) {
  const int64_t n_params = int64_t(P.values().size());
  if (n_params > 0 && (!params || !grads)) fail("CudaOptimizer: null params or grads pointer");
  header_ = plan.state_header();  // in the CPU's own words
  state_size_ = plan.state_size();
  // Check the plan against P and collect the AdamW segments and Muon blocks.
  std::vector<AdamSegment> adam;
  std::map<std::pair<int64_t, int64_t>, std::vector<MuonBlock>> by_shape;  // (rows, cols) -> blocks, plan order
  for (const ParamPlan& pl : plan_) {
    if (!P.has(pl.name)) fail("CudaOptimizer: the plan's tensor '", pl.name, "' is not in the ParamStore");
    if (P.numel(pl.name) != pl.numel)
      fail("CudaOptimizer: '", pl.name, "' has ", P.numel(pl.name), " elements, the plan ", pl.numel);
    const int64_t off = P.offset(pl.name);
    if (off < 0 || off + pl.numel > n_params) fail("CudaOptimizer: '", pl.name, "' lies outside the parameters");
    if (pl.state_offset < 0 || pl.state_size < 0 || pl.state_offset + pl.state_size > state_size_)
      fail("CudaOptimizer: '", pl.name, "' has a state slot outside the optimizer's state");
    if (pl.group == ParamGroup::Frozen || pl.numel == 0) continue;
    if (pl.group == ParamGroup::AdamW) {
      if (pl.state_size != 2 * pl.numel) fail("CudaOptimizer: AdamW tensor '", pl.name, "' needs 2·numel state");
      AdamSegment s;
      s.start = adam_elems_, s.param = off, s.state = pl.state_offset, s.numel = pl.numel;
      s.lr_scale = pl.lr_scale, s.decay = pl.decay;
      adam.push_back(s);
      adam_elems_ += pl.numel;
    } else {
      if (pl.state_size != pl.numel) fail("CudaOptimizer: Muon tensor '", pl.name, "' needs numel state");
      if (pl.heads < 1 || pl.rows % pl.heads != 0 || pl.rows * pl.cols != pl.numel)
        fail("CudaOptimizer: Muon tensor '", pl.name, "' has ", pl.rows, "x", pl.cols, " and ", pl.heads, " heads");
      const int64_t rb = pl.rows / pl.heads;
      for (int64_t h = 0; h < pl.heads; ++h) {
        MuonBlock b;
        b.param = off + h * rb * pl.cols, b.state = pl.state_offset + h * rb * pl.cols;
        b.lr_scale = pl.lr_scale, b.decay = pl.decay;
        by_shape[{rb, pl.cols}].push_back(b);
      }
    }
  }
  state_ = cuda::DeviceBuffer<float>(size_t(state_size_));
  adam_segments_ = int64_t(adam.size());
  if (!adam.empty()) adam_table_ = cuda::DeviceBuffer<AdamSegment>(adam.data(), adam.size());

  // Batches: the blocks of one shape in plan order, cut at kMaxBatchElems / kMaxBatchBlocks.
  std::vector<MuonBlock> table;
  int64_t max_x = 0, max_a = 0, max_partial = 0, max_count = 0;
  for (const auto& [shape, blocks] : by_shape) {
    const auto [rows, cols] = shape;
    const int64_t len = rows * cols;
    for (size_t i = 0; i < blocks.size();) {
      MuonBatch b;
      b.first = int64_t(table.size()), b.rows = rows, b.cols = cols;
      b.tall = rows > cols, b.r = std::min(rows, cols), b.w = std::max(rows, cols);
      b.scale = muon_scale(cfg_.muon_scale, rows, cols, cfg_.muon_rms);
      while (i < blocks.size() &&
             (b.count == 0 || ((b.count + 1) * len <= kMaxBatchElems && b.count < kMaxBatchBlocks))) {
        table.push_back(blocks[i++]);
        ++b.count;
      }
      max_x = std::max(max_x, b.count * len);
      max_a = std::max(max_a, b.count * b.r * b.r);
      max_partial = std::max(max_partial, b.count * chunks_of(len));
      max_count = std::max(max_count, b.count);
      batches_.push_back(b);
    }
  }
  if (!table.empty()) {
    blocks_ = cuda::DeviceBuffer<MuonBlock>(table.data(), table.size());
    x_ = cuda::DeviceBuffer<float>(size_t(max_x));
    partial_ = cuda::DeviceBuffer<double>(size_t(max_partial));
    norm_ = cuda::DeviceBuffer<double>(size_t(max_count));
    if (ns_bf16_) {
      xb_ = cuda::DeviceBuffer<uint16_t>(size_t(max_x));
      xnb_ = cuda::DeviceBuffer<uint16_t>(size_t(max_x));
      ab_ = cuda::DeviceBuffer<uint16_t>(size_t(max_a));
      bb_ = cuda::DeviceBuffer<uint16_t>(size_t(max_a));
    } else {
      y_ = cuda::DeviceBuffer<float>(size_t(max_x));
      a_ = cuda::DeviceBuffer<float>(size_t(max_a));
      b_ = cuda::DeviceBuffer<float>(size_t(max_a));
    }
  }
}

CudaOptimizer::~CudaOptimizer() = default;

void CudaOptimizer::step(double step_lr) {
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t_)), bc2 = 1.0 - std::pow(cfg_.beta2, double(t_));
  if (adam_elems_ > 0) {
    adamw_kernel<<<grid_for(adam_elems_), kThreads>>>(params_, grads_, state_.data(), adam_table_.data(),
                                                      adam_segments_, adam_elems_, step_lr, cfg_.beta1, cfg_.beta2,
                                                      cfg_.eps, cfg_.weight_decay, bc1, std::sqrt(bc2));
    K3_CUDA_LAUNCH_CHECK();
  }
  for (const MuonBatch& b : batches_) ns_bf16_ ? muon_batch_bf16(b, step_lr) : muon_batch(b, step_lr);
}

// Both iterations' input: the momentum step into x_ (each block transposed when tall), then
// X = u/‖u‖_F per block, and X's bf16 copy into x16 when given.
void CudaOptimizer::normalized_momentum(const MuonBatch& b, uint16_t* x16) {
  const int64_t len = b.rows * b.cols, n = b.count * len;
  float* X = x_.data();
  muon_momentum_kernel<<<grid_for(n), kThreads>>>(X, state_.data(), grads_, blocks_.data() + b.first, b.count, b.rows,
                                                  b.cols, b.tall, cfg_.momentum, cfg_.nesterov);
  K3_CUDA_LAUNCH_CHECK();
  segment_norms(X, b.count, len, partial_.data(), norm_.data());
  ns_normalize_kernel<<<grid_for(n), kThreads>>>(X, reinterpret_cast<__nv_bfloat16*>(x16), norm_.data(), b.count, len);
  K3_CUDA_LAUNCH_CHECK();
}

// Newton–Schulz on every block of the batch at once, the CPU's iteration (optimizer.cpp) per block:
//   X = u/‖u‖_F [r, w];  ns_steps × { A = X·Xᵀ [r, r];  B = b·A + c·A·A;  X ← a·X + B·X }
// Each product is one strided-batched pedantic fp32 GEMM over the blocks (block i's operands at
// i·r·w / i·r·r); the polynomial's sums in double.
void CudaOptimizer::muon_batch(const MuonBatch& b, double lr) {
  constexpr double ca = NewtonSchulzQuintic::a, cb = NewtonSchulzQuintic::b, cc = NewtonSchulzQuintic::c;
  const int64_t n = b.count * b.rows * b.cols, na = b.count * b.r * b.r;
  const MuonBlock* blocks = blocks_.data() + b.first;
  float *X = x_.data(), *Y = y_.data(), *A = a_.data(), *B = b_.data();
  normalized_momentum(b, nullptr);
  const int64_t r = b.r, w = b.w;
  for (int s = 0; s < cfg_.ns_steps; ++s) {
    ns_gemm(ctx_, DType::F32, A, X, X, r, r, w, false, b.count, r * w, r * w, r * r);  // A = X·Xᵀ
    ns_gemm(ctx_, DType::F32, B, A, A, r, r, r, true, b.count, r * r, r * r, r * r);   // B = A·A
    ns_poly_kernel<<<grid_for(na), kThreads>>>(B, A, na, cb, cc);                      // B = b·A + c·A·A
    K3_CUDA_LAUNCH_CHECK();
    ns_gemm(ctx_, DType::F32, Y, B, X, r, w, r, true, b.count, r * r, r * w, r * w);  // Y = B·X
    ns_axpy_kernel<<<grid_for(n), kThreads>>>(X, Y, n, ca);                           // X = a·X + Y
    K3_CUDA_LAUNCH_CHECK();
  }
  muon_update_kernel<<<grid_for(n), kThreads>>>(params_, X, blocks, b.count, b.rows, b.cols, b.tall, lr,
                                                cfg_.weight_decay, b.scale);
  K3_CUDA_LAUNCH_CHECK();
}

// The same iteration on bf16 matrices (optimizer_cuda.h): per step
//   A = X·Xᵀ;  B = c·A·A + b·A (B starts as a copy of A: cuBLAS's C);  X' = B·X + a·X (X' starts as X)
// each one strided-batched GEMM with fp32 accumulation and a bf16 result; X and X' alternate between
// xb_ and xnb_.
void CudaOptimizer::muon_batch_bf16(const MuonBatch& b, double lr) {
  constexpr double ca = NewtonSchulzQuintic::a, cb = NewtonSchulzQuintic::b, cc = NewtonSchulzQuintic::c;
  const int64_t n = b.count * b.rows * b.cols, na = b.count * b.r * b.r;
  const MuonBlock* blocks = blocks_.data() + b.first;
  __nv_bfloat16* Xc = reinterpret_cast<__nv_bfloat16*>(xb_.data());
  __nv_bfloat16* Xn = reinterpret_cast<__nv_bfloat16*>(xnb_.data());
  __nv_bfloat16* A = reinterpret_cast<__nv_bfloat16*>(ab_.data());
  __nv_bfloat16* B = reinterpret_cast<__nv_bfloat16*>(bb_.data());
  normalized_momentum(b, xb_.data());
  const int64_t r = b.r, w = b.w;
  const DType bf = DType::BF16;
  for (int s = 0; s < cfg_.ns_steps; ++s) {
    ns_gemm(ctx_, bf, A, Xc, Xc, r, r, w, false, b.count, r * w, r * w, r * r);  // A = X·Xᵀ
    cuda::copy_on_device(B, A, size_t(na) * sizeof(__nv_bfloat16));
    ns_gemm(ctx_, bf, B, A, A, r, r, r, true, b.count, r * r, r * r, r * r, cc, cb);  // B = c·A·A + b·A
    cuda::copy_on_device(Xn, Xc, size_t(n) * sizeof(__nv_bfloat16));
    ns_gemm(ctx_, bf, Xn, B, Xc, r, w, r, true, b.count, r * r, r * w, r * w, 1.0, ca);  // X' = B·X + a·X
    std::swap(Xc, Xn);
  }
  muon_update_kernel<<<grid_for(n), kThreads>>>(params_, Xc, blocks, b.count, b.rows, b.cols, b.tall, lr,
                                                cfg_.weight_decay, b.scale);
  K3_CUDA_LAUNCH_CHECK();
}

OptimizerState CudaOptimizer::save_state() const {
  std::vector<float> f(static_cast<size_t>(state_size_));
  if (state_size_ > 0) state_.download(f.data(), f.size());
  OptimizerState s;
  s.header = header_;
  s.header["step"] = t_;
  s.data.assign(f.begin(), f.end());
  return s;
}

void CudaOptimizer::load_state(const OptimizerState& s) {
  const int64_t t = check_optimizer_state(s, plan_, size_t(state_size_));
  const std::vector<float> f(s.data.begin(), s.data.end());
  if (state_size_ > 0) state_.upload(f.data(), f.size());
  t_ = t;
}

size_t clip_grad_norm_workspace_bytes(int64_t n) {
  K3_CHECK(n >= 0, "clip_grad_norm_workspace_bytes: negative n ", n);
  return size_t(chunks_of(n)) * (sizeof(double) + sizeof(int64_t));
}

void clip_grad_norm_cuda(float* grads, int64_t n, double max_norm, double* norm_out, int64_t* nonfinite,
                         void* workspace) {
  K3_CHECK(n >= 0, "clip_grad_norm_cuda: negative n ", n);
  K3_CHECK(norm_out && nonfinite && workspace && (n == 0 || grads),
           "clip_grad_norm_cuda: null grads, norm_out, nonfinite or workspace");
  const int64_t chunks = chunks_of(n);
  double* partial = static_cast<double*>(workspace);
  int64_t* bad = reinterpret_cast<int64_t*>(partial + chunks);
  sumsq_partial_kernel<<<dim3(unsigned(chunks), 1), kThreads>>>(grads, n, chunks, partial, bad);
  K3_CUDA_LAUNCH_CHECK();
  sumsq_final_kernel<<<1, kThreads>>>(partial, bad, chunks, norm_out, nonfinite);
  K3_CUDA_LAUNCH_CHECK();
  if (max_norm > 0 && n > 0) {
    clip_scale_kernel<<<grid_for(n), kThreads>>>(grads, n, max_norm, norm_out);
    K3_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace k3::train
