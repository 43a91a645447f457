// Linear layers over weights kept as stored in the checkpoint (F32 / BF16 / F16 / MXFP4).
//
// The CPU path computes in fp32. A weight is widened on use, never copied whole at load, so a
// checkpoint may be larger than RAM (its pages are mmap'ed and faulted in when used):
//   - few rows of x (decode): a fused widen-and-dot per weight row, parallel over rows. Memory-bound,
//     and reads the stored bytes (bf16 = half of fp32) exactly once.
//   - many rows (prefill / training): widen a slab of weight rows to fp32, then cblas_sgemm.
// Dimension letters: N rows of activations, In / Out features. W is [Out, In] (PyTorch layout).
//
// Accumulation precision. Activations are fp32 in and out, but dot products accumulate in fp64 by
// default (dgemm on widened operands; fp64 accumulators in the fused decode kernel). With fp32
// accumulation the golden fixture's long input misses the 1e-4 logits bar: at some tokens AttnRes mixes
// sources that nearly cancel, and across 8 layers that amplifies 1e-7 perturbations ~1e4x, a real
// ill-conditioning, not a bug (docs/NUMERICS.md, "Why linear layers accumulate in fp64", has the
// figures). GemmPrecision::F32 selects the fp32 sgemm path (faster prefill; results differ by ~1e-4
// at such tokens); the k3 CLI sets it from K3_GEMM=f32.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace k3 {

enum class GemmPrecision { F64Accumulate, F32 };
// Process-wide choice, F64Accumulate unless set. The library reads no environment: programs parse
// K3_GEMM themselves (cli::apply_gemm_env, src/cli/args.h).
GemmPrecision gemm_precision();
void set_gemm_precision(GemmPrecision p);

struct WeightRef {
  enum class Format { F32, BF16, F16, MXFP4 };
  Format format = Format::F32;
  int64_t rows = 0, cols = 0;       // logical [Out, In]
  const void* data = nullptr;       // F32/BF16/F16: rows*cols elements; MXFP4: packed [rows, cols/2] bytes
  const uint8_t* scales = nullptr;  // MXFP4 only: E8M0 [rows, cols/32]

  bool empty() const { return data == nullptr; }
  // Rows [r0, r0+n) as a weight of its own (no copy).
  WeightRef row_slice(int64_t r0, int64_t n) const;
  // Widen rows [r0, r0+n) into dst [n, cols] (exact for every format).
  void rows_to_f32(float* dst, int64_t r0, int64_t n) const;
};

// y[N, Out] (row stride ldy) (+)= x[N, In] (row stride ldx) · Wᵀ.
void linear_forward(float* y, int64_t ldy, const float* x, int64_t ldx, int64_t N, const WeightRef& W,
                    bool accumulate = false);
inline void linear_forward(float* y, const float* x, int64_t N, const WeightRef& W) {
  linear_forward(y, W.rows, x, W.cols, N, W, false);
}

// fp64 in and out, for the few places that keep fp64 intermediates (MLA's two attention forms, which
// must agree to fp32 rounding so that cached decoding equals full recomputation; docs/NUMERICS.md).
// y[N, Out] = x[N, In] · Wᵀ
void linear_forward_f64(double* y, const double* x, int64_t N, const WeightRef& W);
// y[N, In] = x[N, Out] · W  (the transpose product: MLA weight absorption)
void linear_transposed_forward_f64(double* y, const double* x, int64_t N, const WeightRef& W);

}  // namespace k3
