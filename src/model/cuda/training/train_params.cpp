// The device mirror of the trainer's parameters, and the training linear layer (train_context.h).
#ifdef K3_HAVE_CUDA
#include <algorithm>

#include "core/error.h"
#include "kernels/common/elementwise_cuda.h"
#include "kernels/gemm/convert_cuda.h"
#include "kernels/moe/expert_gemm_train_cuda.h"
#include "model/cuda/training/train_context.h"

namespace k3::gpu {

DeviceParams::DeviceParams(const train::ParamStore& P, GpuPrecision precision)
    : P_(P), precision_(precision), values_(P.values().size()), grads_(P.values().size()) {
  if (precision_ == GpuPrecision::BF16) values16_ = cuda::DeviceBuffer<uint16_t>(P.values().size());
  upload(P);
}

void DeviceParams::upload(const train::ParamStore& P) {
  K3_CHECK(P.values().size() == values_.size(), "DeviceParams::upload: the store holds ", P.values().size(),
           " values, the device mirror ", values_.size());
  const std::vector<double>& v = P.values();
  std::vector<float> f(v.size());
  const int64_t n = int64_t(v.size());
#pragma omp parallel for schedule(static)  // billions of values at K3's widths
  for (int64_t i = 0; i < n; ++i) f[size_t(i)] = float(v[size_t(i)]);
  values_.upload(f.data(), f.size());
  refresh_bf16();
}

void DeviceParams::download_values(train::ParamStore& P) const {
  std::vector<float> f(values_.size());
  cuda::copy_to_host(f.data(), values_.data(), f.size() * sizeof(float));
  std::vector<double>& v = P.values();
  K3_CHECK(v.size() == f.size(), "DeviceParams::download_values: the store does not match the device mirror");
  std::copy(f.begin(), f.end(), v.begin());
}

void DeviceParams::download_grads(train::ParamStore& P) const {
  std::vector<float> f(grads_.size());
  cuda::copy_to_host(f.data(), grads_.data(), f.size() * sizeof(float));
  std::vector<double>& g = P.grads();
  K3_CHECK(g.size() == f.size(), "DeviceParams::download_grads: the store does not match the device mirror");
  std::copy(f.begin(), f.end(), g.begin());
}

void DeviceParams::zero_grads() { cuda::zero_on_device(grads_.data(), grads_.size() * sizeof(float)); }

void DeviceParams::refresh_bf16() {
  if (precision_ == GpuPrecision::BF16)
    gemm::cuda::convert_f32_to_bf16(values16_.data(), values_.data(), int64_t(values_.size()));
}

TrainParam DeviceParams::at(const std::string& name) const {
  if (!P_.has(name)) fail("GPU training: the model has no parameter '", name, "'");
  const int64_t off = P_.offset(name);
  const std::vector<int64_t>& s = P_.shape(name);
  TrainParam p;
  p.numel = P_.numel(name);
  p.rows = s.empty() ? 1 : s[0];
  p.cols = p.rows == 0 ? 0 : p.numel / p.rows;
  p.w = values_.data() + off;
  p.g = const_cast<float*>(grads_.data()) + off;
  if (precision_ == GpuPrecision::BF16) p.w16 = values16_.data() + off;
  return p;
}

size_t DeviceParams::bytes() const { return values_.size() * sizeof(float) * 2 + values16_.size() * sizeof(uint16_t); }

// ---- the training linear layer ------------------------------------------------------------------
namespace {
// The batch-invariant mode's GEMMs: the grouped expert kernel with one expert owning all M rows. Each
// output element is one fp32 chain over k in a fixed order, owned by one CTA, whatever M is
// (expert_gemm_train_cuda.h), so a row's product never depends on the other rows; cuBLAS's kernel
// choice and split-k depend on M. The kernel's operand grid is checked here, per weight.
void check_fixed_tile(const TrainCtx& t, const TrainParam& W, int64_t M) {
  auto aligned = [](const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; };
  if (W.rows % 8 != 0 || W.cols % 8 != 0 || !aligned(W.w16, 16) || !aligned(W.g, 8))
    fail("batch-invariant GPU training: a [", W.rows, " x ", W.cols,
         "] weight is off the fixed-tile GEMM's grid (rows and columns multiples of 8, 16-byte aligned in the "
         "flat parameter layout); this config cannot train batch-invariant");
  K3_CHECK(M == t.batch.rows, "batch-invariant GPU training: a linear over ", M, " rows of a ", t.batch.rows,
           "-row batch");
}
}  // namespace

const uint16_t* to_bf16(TrainCtx& t, const float* x, int64_t ld, int64_t M, int64_t cols) {
  uint16_t* y = t.take<uint16_t>(M * cols);
  elementwise::cuda::copy_rows(y, DType::BF16, cols, x, DType::F32, ld, M, cols);
  return y;
}

void train_linear_forward(TrainCtx& t, float* y, int64_t ld_y, const float* x, int64_t ld_x, int64_t M,
                          const TrainParam& W, bool accumulate, const uint16_t* x16) {
  const DeviceArena::Mark mark = t.arena.mark();
  if (t.batch_invariant) {
    check_fixed_tile(t, W, M);
    const uint16_t* xb = x16 ? x16 : to_bf16(t, x, ld_x, M, W.cols);
    float* yd = ld_y == W.rows ? y : t.take<float>(M * W.rows);  // a strided y: through a dense copy
    K3_CHECK(yd == y || !accumulate, "batch-invariant GPU training: an accumulating linear with a strided output");
    void* ws = t.arena.take_bytes(moe::cuda::grouped_linear_workspace_bytes(1));
    moe::cuda::grouped_linear_forward_bf16(yd, xb, W.w16, t.batch.all_rows, M, 1, W.rows, W.cols, accumulate, ws);
    if (yd != y) elementwise::cuda::copy_rows(y, DType::F32, ld_y, yd, DType::F32, W.rows, M, W.rows);
    t.arena.rewind(mark);
    return;
  }
  gemm::cuda::LinearParams p;
  p.y = y, p.y_type = DType::F32, p.ld_y = ld_y;
  p.M = M, p.N = W.rows, p.K = W.cols;
  p.accumulate = accumulate;
  if (t.precision == GpuPrecision::BF16) {
    p.x = x16 ? x16 : to_bf16(t, x, ld_x, M, W.cols), p.ld_x = W.cols;
    p.w = W.w16, p.in_type = DType::BF16;
  } else {
    p.x = x, p.ld_x = ld_x, p.w = W.w, p.in_type = DType::F32;
  }
  gemm::cuda::linear_forward(t.gemm, p);
  t.arena.rewind(mark);
}

void train_linear_backward(TrainCtx& t, float* dx, int64_t ld_dx, bool accumulate_dx, const float* dy, int64_t ld_dy,
                           const float* x, int64_t ld_x, int64_t M, const TrainParam& W, const uint16_t* x16) {
  const DeviceArena::Mark mark = t.arena.mark();
  if (t.batch_invariant) {  // the fixed-tile kernels (see train_linear_forward)
    check_fixed_tile(t, W, M);
    const uint16_t* dyb = to_bf16(t, dy, ld_dy, M, W.rows);
    const uint16_t* xb = x16 ? x16 : to_bf16(t, x, ld_x, M, W.cols);
    moe::cuda::grouped_linear_backward_weight_bf16(W.g, dyb, xb, t.batch.all_rows, M, 1, W.rows, W.cols);
    if (dx) {
      K3_CHECK(ld_dx == W.cols, "batch-invariant GPU training: a strided input gradient");
      void* ws = t.arena.take_bytes(moe::cuda::grouped_linear_workspace_bytes(1));
      moe::cuda::grouped_linear_backward_data_bf16(dx, dyb, W.w16, t.batch.all_rows, M, 1, W.rows, W.cols,
                                                   accumulate_dx, ws);
    }
    t.arena.rewind(mark);
    return;
  }
  const bool bf = t.precision == GpuPrecision::BF16;
  const void* dy_in = dy;
  int64_t ld_dy_in = ld_dy;
  if (bf) dy_in = to_bf16(t, dy, ld_dy, M, W.rows), ld_dy_in = W.rows;
  // W.g [rows, cols] += dyᵀ·x
  gemm::cuda::WeightGradParams wg;
  wg.dw = W.g, wg.ld_dw = W.cols;
  wg.dy = dy_in, wg.ld_dy = ld_dy_in;
  wg.M = M, wg.N = W.rows, wg.K = W.cols;
  wg.in_type = bf ? DType::BF16 : DType::F32;
  if (bf) wg.x = x16 ? x16 : to_bf16(t, x, ld_x, M, W.cols), wg.ld_x = W.cols;
  else wg.x = x, wg.ld_x = ld_x;
  gemm::cuda::linear_weight_grad(t.gemm, wg);
  if (dx) {
    // dx[M, cols] = dy[M, rows]·W[rows, cols]: W read as [K = rows, N = cols] (w_in_out).
    gemm::cuda::LinearParams p;
    p.y = dx, p.y_type = DType::F32, p.ld_y = ld_dx;
    p.x = dy_in, p.ld_x = ld_dy_in;
    p.w = bf ? static_cast<const void*>(W.w16) : static_cast<const void*>(W.w), p.ld_w = W.cols;
    p.w_in_out = true;
    p.in_type = bf ? DType::BF16 : DType::F32;
    p.M = M, p.N = W.cols, p.K = W.rows;
    p.accumulate = accumulate_dx;
    gemm::cuda::linear_forward(t.gemm, p);
  }
  t.arena.rewind(mark);
}

}  // namespace k3::gpu
#endif  // K3_HAVE_CUDA
