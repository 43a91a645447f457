// Fused Block AttnRes on the GPU: the CUDA twin of kernels/attnres/attnres.h (k3::attnres_forward),
// optionally fused with the RMSNorm that follows it in the decoder (K3-ARCHITECTURE.md §5.2):
//   K_i = V_i / sqrt(mean(V_i²) + eps)          RMS-normalised key, no weight
//   s_i = dot(K_i, query)                        query = res_norm.weight ⊙ res_proj.weight (folded)
//   h   = Σ_i softmax(s)_i V_i                   weights multiply the RAW sources
//   y   = norm_weight ⊙ h / sqrt(mean(h²) + norm_eps)     (when `normed` is set)
// One kernel, one pass over the sources: a block owns a token's row; for each source it
// loads the row slice into registers, reduces (Σv², Σv·q) over the block, and merges the source into
// an online softmax (running max, running denominator, rescaled fp32 accumulator). Scores, softmax,
// accumulation and the norm are fp32.
// Memory-bound, and bound first by what is in flight: a thread issues all its loads of the next
// source (two ahead for BF16 sources) before it reduces the current one, so the DRAM stream does
// not wait on the block reduction (attnres_cuda.cu; the figures are in docs/CUDA.md, "Dense").
// Sources are F32 or BF16 (all the same); h and y share
// out_type (F32 or BF16). With a BF16 out_type the norm reads h rounded to bf16, exactly what the
// unfused pair (AttnRes writes bf16 h, RMSNorm reads it) would compute.
// Device pointers; default stream; plain C++ header.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace k3::attnres::cuda {

constexpr int kMaxSources = 16;  // K3 mixes at most 9 (8 block snapshots + the partial sum)

struct AttnResParams {
  const void* sources[kMaxSources] = {};  // S device pointers, each [N, ld_src]; the partial sum last
  int S = 0;
  DType src_type = DType::F32;
  int64_t ld_src = 0;  // row stride of every source, elements (0: D)
  int64_t N = 0, D = 0;
  const float* query = nullptr;  // [D]
  float eps = 1e-5f;             // key RMS eps (rms_norm_eps)

  DType out_type = DType::F32;         // of `out` and `normed`
  int64_t ld_out = 0;                  // row stride of out and normed, elements (0: D)
  void* out = nullptr;                 // [N, ld_out] h, or null when only the normed rows are wanted
  void* normed = nullptr;              // [N, ld_out] RMSNorm(h), or null for no fused norm
  const float* norm_weight = nullptr;  // [D] or null (plain RMS normalisation)
  float norm_eps = 1e-5f;

  // The decoder's pending residual update, done by the mix that reads it first (F32 sources, dense rows):
  // with last_addend, the last source is sources[S-1] + last_addend and last_store must be sources[S-1] (the
  // partial sum updated in place); with last_store alone, the last source is copied there (a new partial sum).
  // The bits of elementwise::cuda::add_inplace or a copy, then the mix. Fused into the kernel where each thread
  // holds one pack of the row (k3-1b's rows), else a separate launch first.
  const float* last_addend = nullptr;  // [N, D]
  float* last_store = nullptr;         // [N, D]
};

// Empty string when attnres_forward can take p, else why not.
std::string can_run(const AttnResParams& p);
// Throws k3::Error with can_run's reason when it cannot.
void attnres_forward(const AttnResParams& p);

}  // namespace k3::attnres::cuda
