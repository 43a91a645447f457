// A small register-tiled fp64 matrix product for the many little products of the chunked KDA forms
// (inference prefill, src/kernels/kda/kda_cpu.cpp; training forward/backward, src/kernels/kda/kda_chunk_f64.cpp).
//
//   C[m, nn] += alpha · op(A) · B, row-major with row strides lda, ldb, ldc;
//   op(A) = A (stored [m, kk]) or, with kTransA, Aᵀ (A stored [kk, m]).
//
// Why not cblas_dgemm: the products are 16..128 on a side and there are a dozen per chunk, so OpenBLAS
// spends much of each call in its interface and packing; and with its generic (Prescott) kernels, which
// it picks on CPUs it does not recognise (virtual machines), it is slower still. Here each kMR x kNR tile
// of C is summed in a local array that the compiler keeps in vector registers: per step of p, kNR/8 loads
// of B, kMR broadcasts of A and kMR·kNR/8 fp64 FMAs, several times the plain i-p-j loop's rate
// (docs/BENCHMARKS.md, "The KDA recurrence core on its own"). The summation order is fixed (p
// ascending, then one multiply by alpha and one add into C), whatever the tile, so the result does not
// depend on the BLAS build or the thread count.
#pragma once
#include <algorithm>
#include <cstdint>

namespace k3 {

// The tile: rows of A x columns of B summed in registers (a multiple of the row count of a block
// keeps callers' own row blocking aligned with the tiles).
constexpr int64_t kTiledF64Rows = 8, kTiledF64Cols = 16;

template <bool kTransA>
inline void gemm_acc_f64(double* C, int64_t ldc, const double* A, int64_t lda, const double* B, int64_t ldb, int64_t m,
                         int64_t nn, int64_t kk, double alpha) {
  constexpr int64_t kMR = kTiledF64Rows, kNR = kTiledF64Cols;
  auto a_at = [&](int64_t i, int64_t p) { return kTransA ? A[p * lda + i] : A[i * lda + p]; };
  for (int64_t i0 = 0; i0 < m; i0 += kMR) {
    const int64_t mr = std::min(kMR, m - i0);
    for (int64_t j0 = 0; j0 < nn; j0 += kNR) {
      const int64_t nr = std::min(kNR, nn - j0);
      if (mr == kMR && nr == kNR) {
        double acc[kMR][kNR] = {};
        for (int64_t p = 0; p < kk; ++p) {
          const double* b = B + p * ldb + j0;
          for (int64_t r = 0; r < kMR; ++r) {
            const double a = a_at(i0 + r, p);
#pragma omp simd
            for (int64_t c = 0; c < kNR; ++c) acc[r][c] += a * b[c];
          }
        }
        for (int64_t r = 0; r < kMR; ++r)
          for (int64_t c = 0; c < kNR; ++c) C[(i0 + r) * ldc + j0 + c] += alpha * acc[r][c];
      } else {  // edge tile: the same summation order, plain loops
        for (int64_t r = 0; r < mr; ++r) {
          double acc[kNR] = {};
          for (int64_t p = 0; p < kk; ++p) {
            const double a = a_at(i0 + r, p);
            const double* b = B + p * ldb + j0;
            for (int64_t c = 0; c < nr; ++c) acc[c] += a * b[c];
          }
          for (int64_t c = 0; c < nr; ++c) C[(i0 + r) * ldc + j0 + c] += alpha * acc[c];
        }
      }
    }
  }
}

}  // namespace k3
