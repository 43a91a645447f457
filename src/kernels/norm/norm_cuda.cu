// RMSNorm on the GPU (norm_cuda.h). One block per row; the row stays in registers between the
// sum of squares and the scaled store, so each element is read from memory once.
#include <climits>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/norm/norm_cuda.h"

namespace k3::norm::cuda {

namespace {

using rowwise::bf16;

template <class Tin, class Tout, int VEC>
__global__ void __launch_bounds__(rowwise::kRowMaxThreads)
    rmsnorm_row_kernel(Tout* y, int64_t ld_y, const Tin* x, int64_t ld_x,  // may alias (in place)
                       const float* __restrict__ w, float eps, int D, int nv) {
  constexpr int NVMAX = rowwise::kRowElemsPerThread / VEC;
  __shared__ float sh[32][1];
  const int64_t row = blockIdx.x;
  const Tin* xr = x + row * ld_x;
  Tout* yr = y + row * ld_y;
  // The weight first: it is no kernel's output, so its load overlaps the previous kernel (pdl_cuda.cuh) and is no
  // longer a round trip after the block's reduction.
  float wv[NVMAX][VEC];
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (w && j < nv && d0 < D) rowwise::load_vec<float, VEC>(wv[j], w + d0);
  }
  pdl::wait_then_release();
  float v[NVMAX][VEC];
  float ss[1] = {0.0f};
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (j < nv && d0 < D) {
      rowwise::load_vec<Tin, VEC>(v[j], xr + d0);
#pragma unroll
      for (int k = 0; k < VEC; ++k) ss[0] = fmaf(v[j][k], v[j][k], ss[0]);
    }
  }
  rowwise::block_sum<1>(ss, sh);
  const float r = 1.0f / sqrtf(ss[0] / float(D) + eps);
#pragma unroll
  for (int j = 0; j < NVMAX; ++j) {
    const int d0 = (j * int(blockDim.x) + int(threadIdx.x)) * VEC;
    if (j < nv && d0 < D) {
      float o[VEC];
      if (w) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = wv[j][k] * (v[j][k] * r);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = v[j][k] * r;
      }
      rowwise::store_vec<Tout, VEC>(yr + d0, o);
    }
  }
}

template <class Tin, class Tout>
void launch(const RmsNormParams& p) {
  const int64_t ld_x = p.ld_x ? p.ld_x : p.D, ld_y = p.ld_y ? p.ld_y : p.D;
  constexpr int VEC = 16 / int(sizeof(Tin));
  const bool vec = p.D % VEC == 0 && ld_x % VEC == 0 && ld_y % VEC == 0 && rowwise::aligned16(p.x) &&
                   rowwise::aligned16(p.y) && (!p.weight || rowwise::aligned16(p.weight));
  auto* y = static_cast<Tout*>(p.y);
  const auto* x = static_cast<const Tin*>(p.x);
  if (vec) {
    const auto g = rowwise::row_geometry(p.D / VEC, rowwise::kRowElemsPerThread / VEC);
    pdl::launch(rmsnorm_row_kernel<Tin, Tout, VEC>, unsigned(p.N), g.threads, 0, y, ld_y, x, ld_x, p.weight, p.eps,
                int(p.D), g.nv);
  } else {
    const auto g = rowwise::row_geometry(p.D, rowwise::kRowElemsPerThread);
    pdl::launch(rmsnorm_row_kernel<Tin, Tout, 1>, unsigned(p.N), g.threads, 0, y, ld_y, x, ld_x, p.weight, p.eps,
                int(p.D), g.nv);
  }
  K3_CUDA_LAUNCH_CHECK();
}

bool float_like(DType t) { return t == DType::F32 || t == DType::BF16; }

}  // namespace

std::string can_run(const RmsNormParams& p) {
  if (!float_like(p.x_type) || !float_like(p.y_type))
    return std::string("rmsnorm (cuda): x and y must be F32 or BF16, got ") + dtype_name(p.x_type) + " -> " +
           dtype_name(p.y_type);
  if (p.N < 0 || p.D < 0) return "rmsnorm (cuda): negative shape";
  if (p.N > INT_MAX) return "rmsnorm (cuda): N = " + std::to_string(p.N) + " rows exceeds the grid limit 2^31-1";
  if (p.D > rowwise::kRowMaxElems)
    return "rmsnorm (cuda): D = " + std::to_string(p.D) + " exceeds the register-resident row limit " +
           std::to_string(rowwise::kRowMaxElems);
  if ((p.ld_x && p.ld_x < p.D) || (p.ld_y && p.ld_y < p.D)) return "rmsnorm (cuda): row stride smaller than D";
  if (p.N > 0 && p.D > 0 && (!p.x || !p.y)) return "rmsnorm (cuda): null x or y";
  if (p.x == p.y && p.x && (p.x_type != p.y_type || (p.ld_x ? p.ld_x : p.D) != (p.ld_y ? p.ld_y : p.D)))
    return "rmsnorm (cuda): in-place needs the same dtype and stride for x and y";
  return {};
}

void rmsnorm_forward(const RmsNormParams& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail(why);
  if (p.N == 0 || p.D == 0) return;
  const bool in_bf = p.x_type == DType::BF16, out_bf = p.y_type == DType::BF16;
  if (!in_bf && !out_bf) launch<float, float>(p);
  else if (!in_bf && out_bf) launch<float, bf16>(p);
  else if (in_bf && !out_bf) launch<bf16, float>(p);
  else launch<bf16, bf16>(p);
}

void rmsnorm_forward(float* y, const float* x, const float* weight, float eps, int64_t N, int64_t D) {
  RmsNormParams p;
  p.y = y, p.y_type = DType::F32, p.x = x, p.x_type = DType::F32, p.weight = weight, p.eps = eps, p.N = N, p.D = D;
  rmsnorm_forward(p);
}
void rmsnorm_forward(uint16_t* y, const uint16_t* x, const float* weight, float eps, int64_t N, int64_t D) {
  RmsNormParams p;
  p.y = y, p.y_type = DType::BF16, p.x = x, p.x_type = DType::BF16, p.weight = weight, p.eps = eps, p.N = N, p.D = D;
  rmsnorm_forward(p);
}
void rmsnorm_forward(uint16_t* y, const float* x, const float* weight, float eps, int64_t N, int64_t D) {
  RmsNormParams p;
  p.y = y, p.y_type = DType::BF16, p.x = x, p.x_type = DType::F32, p.weight = weight, p.eps = eps, p.N = N, p.D = D;
  rmsnorm_forward(p);
}

}  // namespace k3::norm::cuda
