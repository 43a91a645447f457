// SiTU-GLU / SwiGLU on the GPU (glu_cuda.h). Elementwise, memory-bound: a grid-stride loop over
// VEC-element packs (16-byte loads of gate and up when the shape and pointers allow, scalar else).
#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/ffn/glu_cuda.h"
#include "kernels/common/rowwise_cuda.cuh"

namespace k3::ffn::cuda {

namespace {

using rowwise::bf16;

// glu_cpu.cpp's sigmoidf_stable: never forms exp of a large positive number.
__device__ __forceinline__ float sigmoid_stable(float x) {
  const float e = expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}

__device__ __forceinline__ float act(float g, float u, bool situ, float b1, float b2) {
  const float s = sigmoid_stable(g);
  return situ ? (b1 * tanhf(g / b1) * s) * (b2 * tanhf(u / b2)) : g * s * u;
}

template <class Tin, class Tout, int VEC>
__global__ void glu_kernel(Tout* out, int64_t ld_out, const Tin* gate, const Tin* up, int64_t ld_in, int64_t rows,
                           int64_t vecs_per_row, bool situ, float b1, float b2) {
  const int64_t total = rows * vecs_per_row;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / vecs_per_row, c = (i - r * vecs_per_row) * VEC;
    float g[VEC], u[VEC], o[VEC];
    rowwise::load_vec<Tin, VEC>(g, gate + r * ld_in + c);
    rowwise::load_vec<Tin, VEC>(u, up + r * ld_in + c);
#pragma unroll
    for (int k = 0; k < VEC; ++k) o[k] = act(g[k], u[k], situ, b1, b2);
    rowwise::store_vec<Tout, VEC>(out + r * ld_out + c, o);
  }
}

template <class Tin, class Tout>
void launch(const GluLaunch& p) {
  const int64_t ld_in = p.ld_in ? p.ld_in : p.cols, ld_out = p.ld_out ? p.ld_out : p.cols;
  constexpr int VEC = 16 / int(sizeof(Tin));
  const bool vec = p.cols % VEC == 0 && ld_in % VEC == 0 && ld_out % VEC == 0 && rowwise::aligned16(p.gate) &&
                   rowwise::aligned16(p.up) && rowwise::aligned16(p.out);
  auto* out = static_cast<Tout*>(p.out);
  const auto* g = static_cast<const Tin*>(p.gate);
  const auto* u = static_cast<const Tin*>(p.up);
  if (vec) {
    const int64_t vpr = p.cols / VEC;
    glu_kernel<Tin, Tout, VEC><<<rowwise::grid_for(p.rows * vpr), 256>>>(out, ld_out, g, u, ld_in, p.rows, vpr, p.act.situ,
                                                                         p.act.beta_gate, p.act.beta_up);
  } else {
    glu_kernel<Tin, Tout, 1><<<rowwise::grid_for(p.rows * p.cols), 256>>>(out, ld_out, g, u, ld_in, p.rows, p.cols,
                                                                          p.act.situ, p.act.beta_gate, p.act.beta_up);
  }
  K3_CUDA_LAUNCH_CHECK();
}

bool float_like(DType t) { return t == DType::F32 || t == DType::BF16; }

}  // namespace

std::string can_run(const GluLaunch& p) {
  if (!float_like(p.in_type) || !float_like(p.out_type))
    return std::string("glu (cuda): gate/up and out must be F32 or BF16, got ") + dtype_name(p.in_type) + " -> " +
           dtype_name(p.out_type);
  if (p.rows < 0 || p.cols < 0) return "glu (cuda): negative shape";
  if ((p.ld_in && p.ld_in < p.cols) || (p.ld_out && p.ld_out < p.cols)) return "glu (cuda): row stride smaller than cols";
  if (p.rows > 0 && p.cols > 0 && (!p.out || !p.gate || !p.up)) return "glu (cuda): null pointer";
  if ((p.out == p.gate || p.out == p.up) && p.out &&
      (p.out_type != p.in_type || (p.ld_out ? p.ld_out : p.cols) != (p.ld_in ? p.ld_in : p.cols)))
    return "glu (cuda): out may alias gate or up only with the same dtype and stride";
  if (p.act.situ && (!(p.act.beta_gate > 0.0f) || !(p.act.beta_up > 0.0f)))
    return "glu (cuda): SiTU betas must be positive, got " + std::to_string(p.act.beta_gate) + ", " +
           std::to_string(p.act.beta_up);
  return {};
}

void glu_forward(const GluLaunch& p) {
  const std::string why = can_run(p);
  if (!why.empty()) fail(why);
  if (p.rows == 0 || p.cols == 0) return;
  const bool in_bf = p.in_type == DType::BF16, out_bf = p.out_type == DType::BF16;
  if (!in_bf && !out_bf) launch<float, float>(p);
  else if (!in_bf && out_bf) launch<float, bf16>(p);
  else if (in_bf && !out_bf) launch<bf16, float>(p);
  else launch<bf16, bf16>(p);
}

void glu_forward(float* out, const float* gate, const float* up, int64_t n, const GluParams& act) {
  GluLaunch p;
  p.out = out, p.gate = gate, p.up = up, p.rows = 1, p.cols = n, p.act = act;
  glu_forward(p);
}

}  // namespace k3::ffn::cuda
