// Small memory-bound kernels that glue the model's blocks together on the GPU (model/cuda): residual
// adds, the β and output-gate sigmoids, strided row copies with a dtype change, and the row
// gather / weighted scatter of the exact MoE path. Each is the device twin of a loop in
// model/*_layer.cpp. Elementwise math in fp32 with one rounding at the store; the sigmoid is the
// CPU's overflow-free form (kernels/ffn/glu.h: sigmoidf_stable), evaluated with the accurate expf.
// Device pointers; default stream; plain C++ header. bf16 is uint16_t bits.
#pragma once
#include <cstdint>

#include "core/dtype.h"

namespace k3::elementwise::cuda {

// y[i] += x[i] for i < n (fp32).
void add_inplace(float* y, const float* x, int64_t n);

// out[d] += Σ_c part[c·D + d] for d < D: per-chunk double partial sums of a column reduction (a weight
// gradient summed over rows) added in chunk order, in double, and rounded to fp32 once. The fixed
// order is what makes such gradients deterministic without atomics.
void add_chunk_column_sums(float* out, const double* part, int64_t chunks, int64_t D);

// x[i] <- sigmoid(x[i]) for i < n (fp32): KDA's β.
void sigmoid_inplace(float* x, int64_t n);

// x[i] <- x[i] * sigmoid(g[i]) for i < n: MLA's output gate. x and g of one type.
void mul_sigmoid(float* x, const float* g, int64_t n);
void mul_sigmoid(uint16_t* x, const uint16_t* g, int64_t n);

// dst[r, c] = src[r, c] for r < rows, c < cols, rows strided by ld_dst / ld_src elements; each type
// F32 or BF16 (F32 -> BF16 rounds to nearest even, as core/dtype.h). dst must not overlap src.
void copy_rows(void* dst, DType dst_type, int64_t ld_dst, const void* src, DType src_type, int64_t ld_src, int64_t rows,
               int64_t cols);

// dst[i, :] = src[index[i], :] for i < n (fp32 rows of `cols`). index is a device int32 array.
void gather_rows(float* dst, const float* src, const int32_t* index, int64_t n, int64_t cols);

// dst[index[i], :] += weight[i] * src[i, :] for i < n (fp32), all rows in parallel: the indices of
// one call must be distinct (no two threads add into one row), so each row gets exactly one add.
void scatter_add_rows(float* dst, const float* src, const int32_t* index, const float* weight, int64_t n, int64_t cols);

// out[t, :] = table[ids[t], :] (fp32 table [V, D]); an id outside [0, V) yields a row of NaN (the
// host validates ids first; see gemm/convert_cuda.h for the bf16 twin).
void embedding_gather_f32(float* out, const float* table, const int32_t* ids, int64_t T, int64_t V, int64_t D);

}  // namespace k3::elementwise::cuda
