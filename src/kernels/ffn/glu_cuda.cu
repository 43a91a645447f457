// SiTU-GLU / SwiGLU on the GPU (glu_cuda.h). Elementwise, memory-bound: a 2-D grid, x over the
// VEC-element packs of a row (16-byte loads of gate and up when the shape and pointers allow, scalar
// else), y over rows (a stride loop past 65535 rows); no 64-bit division per pack.
//
// The arithmetic per element is that of glu_cpu.cpp, in fp32 with the accurate tanhf/expf:
//   s = sigmoid_stable(g);  out = (b1·tanh(g/b1)·s) · (b2·tanh(u/b2))      (SiTU)
// Cheaper forms of the same bits. With bf16 data the kernel is bound by instruction issue, not by
// bandwidth (it moves half the bytes of fp32 at the same element rate), so the instructions per element
// are what count (docs/CUDA.md, "Dense", has the SASS count and the figures):
//   - g/b1 (u/b2) with b a power of two is g·(1/b) exactly (1/b exact, one rounding of the same real
//     number), done with __fmul_rn so that it is never contracted into an fma: K3's beta_gate = 4.
//   - other betas, and the sigmoid's num/(1+e), run the IEEE division's own fast path (div_fast)
//     only where its range check provably passes, so they get the division's bits without the
//     check; 1/beta is refined once per thread; a pack with any |x| outside [2^-60, 2^60] (a zero,
//     inf, NaN) takes the plain division.
//   - the stable sigmoid selects the numerator (1 or e) and divides once: the same division.
//   - SiTU / SwiGLU and the beta forms are template parameters; a 2-D grid avoids a 64-bit division
//     per pack for the row index; bf16 outputs are narrowed in pairs by the hardware
//     (rowwise::pack2_bf16_rne).
// The rest of the cost is two accurate tanhf and an expf (7 MUFU and ~50 other instructions an
// element), which the exactness requirement keeps.
#include <algorithm>
#include <cmath>

#include "core/cuda_check.cuh"
#include "core/error.h"
#include "kernels/common/pdl_cuda.cuh"
#include "kernels/common/rowwise_cuda.cuh"
#include "kernels/ffn/glu_cuda.h"

namespace k3::ffn::cuda {

namespace {

using rowwise::bf16;

// The IEEE division a/b as CUDA compiles it (div.rn.f32), fast path only: y = rcp(b) refined by one
// Newton step, q = a·y, one correction with the exact remainder:
//   MUFU.RCP y0, b; y = fma(y0, fma(-b, y0, 1), y0); q0 = fma(a, y, 0); q = fma(y, fma(-b, q0, a), q0)
// The compiled division runs exactly these instructions and takes their result whenever its range
// check (FCHK: denormal, zero, infinite or NaN operands, quotients near the exponent limits) passes;
// the callers below use it only where that check provably passes, so the bits are the division's,
// without the check, its branch and its convergence barrier, and with y hoisted when b is constant.
__device__ __forceinline__ float rcp_refined(float b) {
  float y0;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y0) : "f"(b));
  return fmaf(y0, fmaf(-b, y0, 1.0f), y0);
}
__device__ __forceinline__ float div_fast(float a, float b, float y) {
  const float q0 = fmaf(a, y, 0.0f);
  return fmaf(y, fmaf(-b, q0, a), q0);
}

// rowwise::sigmoid_stable (glu_cpu.cpp's sigmoidf_stable) with the same bits, faster: never forms exp
// of a large positive number.
//   x >= 0: 1 / (1 + e),  x < 0 (or NaN): e / (1 + e),  e = exp(-|x|)
// Either way the numerator (1 or e) over 1 + e, divided once. 1 + e rounds to 1 exactly when
// e <= 2^-24, and num / 1 == num; otherwise e > 2^-24, so num is in (2^-24, 1] and 1 + e in (1, 2]:
// normal operands and quotient, where the division's fast path is what it returns.
__device__ __forceinline__ float sigmoid_stable_fast(float x) {
  const float e = expf(-fabsf(x));
  const float num = x >= 0.0f ? 1.0f : e, den = 1.0f + e;
  return den == 1.0f ? num : div_fast(num, den, rcp_refined(den));
}

// How x / beta is formed (same bits every way):
//   kBetaPow2: beta a power of two: x · (1/beta), exact (__fmul_rn: never contracted into an fma);
//   kBetaFast: the division's fast path with 1/beta refined once per thread, for packs whose |x| all
//              lie in [lo, hi] (host: [2^-60, 2^60] for beta in [2^-16, 2^16], else empty), where the
//              division's range check passes; any other pack (a zero, a huge value, inf, NaN) divides.
enum BetaForm { kBetaPow2 = 0, kBetaFast = 1 };

struct Beta {
  float b, rb, lo, hi;  // beta; 1/beta (kBetaPow2); the |x| range of the fast path (kBetaFast)
};

template <int VEC, int FORM>
__device__ __forceinline__ void div_beta(float (&q)[VEC], const float (&x)[VEC], const Beta& be) {
  if constexpr (FORM == kBetaPow2) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) q[k] = __fmul_rn(x[k], be.rb);
  } else {
    const float y = rcp_refined(be.b);
    bool fast = true;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      q[k] = div_fast(x[k], be.b, y);
      fast &= fabsf(x[k]) >= be.lo && fabsf(x[k]) <= be.hi;
    }
    if (!fast) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) q[k] = x[k] / be.b;
    }
  }
}

template <class Tin, class Tout, int VEC, bool SITU, int F1, int F2>
__global__ void __launch_bounds__(256)
    glu_kernel(Tout* out, int64_t ld_out, const Tin* gate, const Tin* up, int64_t ld_in, int64_t rows,
               int64_t vecs_per_row, Beta be1, Beta be2) {
  pdl::wait_then_release();
  const int64_t c_stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const Tin* gr = gate + r * ld_in;
    const Tin* ur = up + r * ld_in;
    Tout* orow = out + r * ld_out;
    for (int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs_per_row; v += c_stride) {
      const int64_t c = v * VEC;
      alignas(16) Tin gp[VEC], upk[VEC];
      rowwise::copy_bytes_stream<int(sizeof(Tin)) * VEC>(gp, gr + c);
      rowwise::copy_bytes_stream<int(sizeof(Tin)) * VEC>(upk, ur + c);
      float g[VEC], u[VEC], o[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[k] = rowwise::to_f32(gp[k]), u[k] = rowwise::to_f32(upk[k]);
      if constexpr (SITU) {
        // (b1·tanh(g/b1)·s) · (b2·tanh(u/b2)), in glu_cpu.cpp's order
        float x1[VEC], x2[VEC];
        div_beta<VEC, F1>(x1, g, be1);
        div_beta<VEC, F2>(x2, u, be2);
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          o[k] = (be1.b * tanhf(x1[k]) * sigmoid_stable_fast(g[k])) * (be2.b * tanhf(x2[k]));
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = g[k] * sigmoid_stable_fast(g[k]) * u[k];
      }
      rowwise::store_vec<Tout, VEC>(orow + c, o);
    }
  }
}

// 1/b when b is a power of two whose reciprocal is a normal float (then x/b == x·(1/b) exactly).
bool pow2_reciprocal(float b, float* rb) {
  int e = 0;
  if (!(b > 0.0f) || std::frexp(b, &e) != 0.5f || e < -120 || e > 120) return false;
  *rb = std::ldexp(1.0f, 1 - e);  // b = 2^(e-1)
  return true;
}

// The form of x / beta for one beta (see BetaForm).
int beta_form(float b, Beta* be) {
  be->b = b;
  be->rb = 0.0f;
  if (pow2_reciprocal(b, &be->rb)) return kBetaPow2;
  const bool fast_ok = b >= 0x1p-16f && b <= 0x1p16f;
  be->lo = fast_ok ? 0x1p-60f : INFINITY;  // an empty range: every pack divides
  be->hi = fast_ok ? 0x1p60f : 0.0f;
  return kBetaFast;
}

template <class Tin, class Tout, int VEC>
void launch_vec(Tout* out, int64_t ld_out, const Tin* g, const Tin* u, int64_t ld_in, int64_t rows, int64_t vpr,
                const GluParams& act) {
  const int threads = 256;
  const int64_t bx = std::min<int64_t>((vpr + threads - 1) / threads, 65536);
  const dim3 grid(unsigned(bx), unsigned(std::min<int64_t>(rows, 65535)));
  Beta be1{}, be2{};
  const int f1 = beta_form(act.beta_gate, &be1), f2 = beta_form(act.beta_up, &be2);
#define K3_GLU_LAUNCH(SITU, F1, F2) \
  pdl::launch(glu_kernel<Tin, Tout, VEC, SITU, F1, F2>, grid, threads, 0, out, ld_out, g, u, ld_in, rows, vpr, be1, be2)
  if (!act.situ) K3_GLU_LAUNCH(false, kBetaFast, kBetaFast);
  else if (f1 == kBetaPow2 && f2 == kBetaPow2) K3_GLU_LAUNCH(true, kBetaPow2, kBetaPow2);
  else if (f1 == kBetaPow2) K3_GLU_LAUNCH(true, kBetaPow2, kBetaFast);
  else if (f2 == kBetaPow2) K3_GLU_LAUNCH(true, kBetaFast, kBetaPow2);
  else K3_GLU_LAUNCH(true, kBetaFast, kBetaFast);
#undef K3_GLU_LAUNCH
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
  if (vec) launch_vec<Tin, Tout, VEC>(out, ld_out, g, u, ld_in, p.rows, p.cols / VEC, p.act);
  else launch_vec<Tin, Tout, 1>(out, ld_out, g, u, ld_in, p.rows, p.cols, p.act);
  K3_CUDA_LAUNCH_CHECK();
}

bool float_like(DType t) { return t == DType::F32 || t == DType::BF16; }

}  // namespace

std::string can_run(const GluLaunch& p) {
  if (!float_like(p.in_type) || !float_like(p.out_type))
    return std::string("glu (cuda): gate/up and out must be F32 or BF16, got ") + dtype_name(p.in_type) + " -> " +
           dtype_name(p.out_type);
  if (p.rows < 0 || p.cols < 0) return "glu (cuda): negative shape";
  if ((p.ld_in && p.ld_in < p.cols) || (p.ld_out && p.ld_out < p.cols))
    return "glu (cuda): row stride smaller than cols";
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
