// Block AttnRes for GPU training, fp32: the CUDA twin of the float64 k3::attnres_forward /
// attnres_backward (kernels/attnres/attnres.h). Per row n, over S sources V_i [N, D]:
//   r_i = 1/sqrt(mean(V_i²) + eps)       (saved: rinv [N, S])
//   s_i = r_i (V_i · q)                  (the key is the RMS-normalised source, no weight)
//   α   = softmax(s)                     (saved: alpha [N, S])
//   h   = Σ_i α_i V_i                    (the weights multiply the RAW sources)
// Backward, with g = dh and dα_i = g · V_i:
//   ds_i = α_i (dα_i − Σ_j α_j dα_j),   a_i = ds_i r_i,   b_i = ds_i r_i³ (V_i · q) / D
//   dV_i += α_i g + a_i q − b_i V_i,    dq += Σ_rows Σ_i a_i V_i
// The query is q = a ⊙ b (res_norm.weight ⊙ res_proj.weight), folded by attnres_query_forward.
//
// Kernels: one block per row; pass 1 reduces the 2S row sums (Σv², Σv·q, or Σg·v, Σv·q) with one
// fp32 block reduction of fixed order, pass 2 re-reads the sources (L1/L2) for h or dV. The
// backward keeps the per-row a_i in the workspace; dq, a sum over rows, is then summed without
// atomics: double partial sums per chunk of kDqRowsPerChunk rows, added to dq in chunk order.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/attnres/attnres_cuda.h"

namespace k3::attnres::cuda {

struct AttnResTrainParams {
  const float* sources[kMaxSources] = {};  // S device pointers, each [N, D] (distinct buffers)
  int S = 0;
  int64_t N = 0, D = 0;
  const float* query = nullptr;  // [D]
  float eps = 1e-5f;
  float* h = nullptr;      // [N, D] out
  float* alpha = nullptr;  // [N, S] saved softmax weights
  float* rinv = nullptr;   // [N, S] saved 1/sqrt(mean(V_i²) + eps)
};
void attnres_forward_train(const AttnResTrainParams& p);

struct AttnResBackwardParams {
  const float* sources[kMaxSources] = {};
  int S = 0;
  int64_t N = 0, D = 0;
  const float* query = nullptr;
  float eps = 1e-5f;
  const float* alpha = nullptr;       // [N, S] from the forward
  const float* rinv = nullptr;        // [N, S] from the forward
  const float* dh = nullptr;          // [N, D]
  // ACCUMULATED (+=), [N, D] each, not aliasing any source; null: that source needs no gradient.
  float* dsources[kMaxSources] = {};
  float* dquery = nullptr;            // [D] ACCUMULATED; null: no query gradient
  void* workspace = nullptr;          // attnres_backward_workspace_bytes(N, D, S)
};
// Rows per chunk of dq's partial sums.
constexpr int64_t kDqRowsPerChunk = 128;
// The per-row a_i [N, S] fp32, then (16-byte aligned) double partial sums [chunks, D].
size_t attnres_backward_workspace_bytes(int64_t N, int64_t D, int S);
void attnres_backward_train(const AttnResBackwardParams& p);

// The folded query q = a ⊙ b (res_norm.weight ⊙ res_proj.weight) and its backward
// (da += dq ⊙ b, db += dq ⊙ a: ACCUMULATED; either may be null). All [D].
void attnres_query_forward(float* q, const float* a, const float* b, int64_t D);
void attnres_query_backward(float* da, float* db, const float* dq, const float* a, const float* b, int64_t D);

}  // namespace k3::attnres::cuda
