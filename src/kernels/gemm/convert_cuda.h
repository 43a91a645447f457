// Element conversions and the embedding gather on the GPU. Bit-exact twins of core/dtype.h:
// bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even and keeps NaN a (quiet) NaN with the
// same bits as k3::f32_to_bf16. bf16 is uint16_t bits. Device pointers; default stream.
#pragma once
#include <cstdint>
#include <string>

namespace k3::gemm::cuda {

void convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n);
void convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n);

// out[t, :] = f32(table[ids[t], :]) for t < T: the K3 input embedding (no scaling).
// table is [V, D] bf16 (the checkpoint's embed_tokens), ids are device int32, out is [T, D] f32.
// An id outside [0, V) is never dereferenced: its row is filled with NaN, so a bad id cannot pass
// silently (validate ids on the host first to report which one; core k3::Error cannot come from
// inside a kernel).
void embedding_gather(float* out, const uint16_t* table, const int32_t* ids, int64_t T, int64_t V, int64_t D);

}  // namespace k3::gemm::cuda
