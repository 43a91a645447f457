// Internal to kernels/moe (.cu files only): the Hopper grouped expert GEMM of moe_gemm_sm90.cu, which
// moe_cuda.cu launches for bf16 weights on 128-row tile lists, and the SiTU-GLU epilogue both GEMM
// kernels share (one definition, so the two kernels differ only in their summation order).
#pragma once
#include <cstdint>

#include "kernels/ffn/glu.h"

namespace k3::moe::cuda {

// SiTU-GLU of one gate/up accumulator pair, in fp32, in the GEMM epilogue (the CPU twin's formula,
// kernels/ffn/glu.h): situ: (βg·tanh(g/βg)·σ(g)) · (βu·tanh(u/βu)); else SwiGLU g·σ(g)·u.
// The epilogue runs 64 of these a thread after every 128 × 128 output tile while the tensor cores wait,
// so its cost is the gate/up GEMM's (H200, K3's sizes, 16,384 tokens):
//   - with tanhf, expf and IEEE divisions the gate/up GEMM took 49.3 ms, against 30.4 with the form
//     below in the same run, then still with 1/β rounded per element (__frcp_rn, a multi-instruction
//     IEEE reciprocal) and the accurate form beside it behind a runtime flag. Nsight Compute had that
//     epilogue at 48 executed instructions an element (12,000 SASS instructions of code) and 30% of the
//     consumers' stall samples, against 5 instructions and 15% for the down GEMM's plain store;
//   - with 1/β and βg·βu once per kernel and the flag gone: 23.3 ms, in the next run (there the static
//     schedule, GemmConfig::dynamic_schedule = false, went from 31.1 to 29.5 ms with the same change).
// So the hardware's approximations:
//   - tanh: tanh.approx.f32, one SFU op;
//   - σ(g) = 1 / (1 + e^-g) with ex2.approx and rcp.approx (__expf, __fdividef): e^-g overflows to +inf for
//     g < -88 and 1/inf is 0, the right limit, so no two-sided form is needed;
//   - g/β as g · (1/β), with 1/β and βg·βu computed once per kernel (GluConsts).
// Every element is rounded to bf16 next (relative error up to 2^-9). Test FastGluIsWithinBf16Rounding
// measures the whole formula against double precision over g, u in ±60: at most 1.9e-5 (2^-15.7)
// relative, far below that rounding.
struct GluConsts {
  bool situ;
  float inv_beta_gate, inv_beta_up, beta_prod;
};
inline GluConsts glu_consts(const GluParams& p) {
  return GluConsts{p.situ, 1.0f / p.beta_gate, 1.0f / p.beta_up, p.beta_gate * p.beta_up};
}
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float moe_glu(float g, float u, const GluConsts& c) {
  const float sg = __fdividef(1.0f, 1.0f + __expf(-g));
  if (!c.situ) return g * sg * u;
  return c.beta_prod * (tanh_approx(g * c.inv_beta_gate) * sg) * tanh_approx(u * c.inv_beta_up);
}

// The raster order both GEMM kernels walk (moe_cuda.cu explains it): work index w of tile slot
// q = w / col_tiles, whose expert's R row tiles start at slot t0, runs that expert's column tiles in
// order with its row tiles innermost. Returns the tile slot and sets *ct, the column tile.
__device__ __forceinline__ int raster_tile(int w, int col_tiles, int tile_rows, const int32_t* tiles,
                                           const int32_t* offsets, int* ct) {
  const int q = w / col_tiles;
  const int e = tiles[2 * q];
  const int t0 = q - tiles[2 * q + 1] / tile_rows;  // the expert's first tile slot
  const int R = (offsets[e + 1] - offsets[e] + tile_rows - 1) / tile_rows;
  const int local = w - t0 * col_tiles;
  *ct = local / R;
  return t0 + local % R;
}

namespace sm90 {

// The row tiles this kernel takes: Dispatch::build(tile_m = 128)'s tile list.
inline constexpr int kTileRows = 128;

// y [S, N] bf16 (sorted rows) = X_e W_eᵀ per expert, or with glu = SiTU-GLU(X_e W0_eᵀ, X_e W1_eᵀ) with
// N = the rows of each of W0, W1. Row r of the sorted order reads x + (x_rows ? x_rows[r] : r) · K.
struct GroupedGemmArgs {
  const uint16_t* x = nullptr;
  const int32_t* x_rows = nullptr;
  const void* w0 = nullptr;  // bf16 [E][N][K], expert e at w0 + e·w_stride bytes (gate for glu)
  const void* w1 = nullptr;  // up weights (glu only), same shape and stride
  int64_t w_stride = 0;
  int E = 0, N = 0, K = 0;
  const int32_t* offsets = nullptr;    // Dispatch: [E+1]
  const int32_t* tiles = nullptr;      // Dispatch: (expert, first row) per 128-row tile
  const int32_t* num_tiles = nullptr;  // on the device
  int64_t max_tiles = 0;               // host bound on *num_tiles
  uint16_t* y = nullptr;
  bool glu = false;
  GluConsts act{};        // the SiTU/SwiGLU epilogue's constants (glu only)
  bool raster = true;     // expert-major order with the row tiles of one weight tile side by side
  bool skip_rows = true;  // a consumer warpgroup whose 64 rows are all past the expert's count idles
  int max_ctas = 0;       // > 0: cap on the persistent grid (tests: many tiles per CTA)
  bool dynamic = true;    // CTAs take work items from an atomic counter in raster order (else w, w + grid, ...)
};

void grouped_gemm(const GroupedGemmArgs& a);

}  // namespace sm90
}  // namespace k3::moe::cuda
