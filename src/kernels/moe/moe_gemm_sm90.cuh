// Internal to kernels/moe (.cu files only): the Hopper grouped expert GEMM of moe_gemm_sm90.cu, which
// moe_cuda.cu launches for bf16 weights on 128-row tile lists, and the SiTU-GLU epilogue both GEMM
// kernels share (one definition, so the two kernels differ only in their summation order).
#pragma once
#include <cstdint>

namespace k3::moe::cuda {

// SiTU-GLU of one gate/up accumulator pair, in fp32, in the GEMM epilogue (the CPU twin's formula,
// kernels/ffn/glu.h): situ: (βg·tanh(g/βg)·σ(g)) · (βu·tanh(u/βu)); else SwiGLU g·σ(g)·u.
// With the accurate tanhf, expf and IEEE divisions this formula cost ~75 instructions an element; the
// gate/up epilogue runs 64 of them a thread after every 128 × 128 output tile while the tensor cores
// wait, so it ran at 59% of cuBLAS where the down GEMM (a plain bf16 store) ran at 82% (H200, 64 experts
// of 4,096 rows). The hardware approximations take ~15:
//   - tanh: tanh.approx.f32 (one SFU op; PTX ISA: maximum relative error 2^-11 over the whole range,
//     so also near 0, where a 1 - 2/(1 + e^2x) form would lose all its digits);
//   - σ(g) = 1 / (1 + 2^(-g·log2 e)) with ex2.approx and a fast reciprocal: e^-g overflows to +inf
//     for g < -88 and the reciprocal of +inf is 0, the right limit; nothing needs the two-sided
//     stable form;
//   - g/β as g · (1/β), the reciprocal rounded once.
// Every element is rounded to bf16 next (relative error up to 2^-9), so the approximations' error,
// a few 2^-11 at worst, is below the output's own rounding; test FastGluIsWithinBf16Rounding measures
// it against double precision over g, u in ±60.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// accurate: tanhf, expf and IEEE divisions instead (K3_MOE_VARIANT 256; the reference for both).
__device__ __forceinline__ float moe_glu(float g, float u, bool situ, bool accurate, float beta_gate, float beta_up) {
  if (accurate) {
    const float sg = g >= 0.0f ? 1.0f / (1.0f + expf(-g)) : expf(g) / (1.0f + expf(g));
    return situ ? (beta_gate * tanhf(g / beta_gate) * sg) * (beta_up * tanhf(u / beta_up)) : g * sg * u;
  }
  const float sg = __fdividef(1.0f, 1.0f + __expf(-g));
  if (!situ) return g * sg * u;
  const float gate = beta_gate * tanh_approx(g * __frcp_rn(beta_gate)) * sg;
  return gate * (beta_up * tanh_approx(u * __frcp_rn(beta_up)));
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
  bool glu = false, situ = false;
  bool accurate_glu = false;  // the epilogue with tanhf/expf/IEEE division (moe_glu)
  float beta_gate = 1.0f, beta_up = 1.0f;
  bool raster = true;     // expert-major order with the row tiles of one weight tile side by side
  bool skip_rows = true;  // a consumer warpgroup whose 64 rows are all past the expert's count idles
  int max_ctas = 0;       // > 0: cap on the persistent grid (tests: many tiles per CTA)
  bool dynamic = true;    // CTAs take work items from an atomic counter in raster order (else w, w + grid, ...)
};

void grouped_gemm(const GroupedGemmArgs& a);

}  // namespace sm90
}  // namespace k3::moe::cuda
