// The vision tower's own ops for TRAINING on the GPU, in fp32, each forward beside its backward: the CUDA twins
// of kernels/vision/vision_f64.h and of the GELUs' float64 backwards (kernels/ffn/gelu.h) that the GPU trainer's
// tower (model/cuda/training/vision_train.cpp) needs beyond the inference kernels it reuses (the position
// embedding's forward and the merge's, vision_cuda.h) and the text trainer's (the linears, RMSNorm, the
// training attention with causal = false, kernels/mla/mla_train_cuda.h).
// Plain C++ (no CUDA headers): every pointer is a device pointer, every launch goes to the calling thread's
// default stream. Gradient rule as in vision_f64.h: an input's gradient is OVERWRITTEN, the position table's (a
// parameter) ACCUMULATES.
//
// Numerics: the rotations with the inference kernels' fp32 cos/sin table (rope_table, from double); the GELUs'
// forwards in the inference kernels' forms (x σ(2z), x erfc(-x/√2) / 2) and their derivatives in fp32 from the
// same quantities; the transposes of the resize and of the merge sum in double in a fixed order and round once
// (no atomics: the results are bitwise reproducible).
#pragma once
#include <cstdint>
#include <vector>

#include "core/error.h"  // defines: k3::fail (the no-CUDA stubs)
#include "kernels/vision/vision_cuda.h"

namespace k3::vision::cuda {

// ---- 2D RoPE into the training attention's layout ----------------------------------------------------------

// Between qkv [L, ld] = [q | k | v] (heads hd columns each) and the attention's layouts q [L, heads hd] and
// kv [L, heads 2 hd] (per head [k | v]: mla::cuda::attention_forward_train's kv with Dn = Dv = hd, Dr = 0).
//   rope_split:          q and kv OVERWRITTEN from qkv: q and k turned as k3::rope2d_forward turns them (pair 2i
//                        by cols[r] f_i, pair 2i + 1 by rows[r] f_i), v copied;
//   rope_split_backward: the first 3 heads hd columns of qkv OVERWRITTEN from the gradients in q and kv, each
//                        turned back (a rotation's transpose turns by the opposite angle), dv copied.
struct RopeSplitParams {
  float* qkv = nullptr;  // [L, ld]: read by rope_split, written by its backward (then the gradient)
  int64_t ld = 0;
  int64_t L = 0, heads = 0, hd = 0;
  const int32_t* rows = nullptr;  // [L]
  const int32_t* cols = nullptr;  // [L]
  const float* table = nullptr;   // rope_table(hd, positions)
  int64_t positions = 0;
  float* q = nullptr;   // [L, heads hd]: written by rope_split, read by its backward
  float* kv = nullptr;  // [L, heads 2 hd]: likewise
};

// ---- the position table's resize, transposed ---------------------------------------------------------------

// One axis of the resize, transposed (host, no GPU needed): source index s receives from the output indices
// index[start[s] .. start[s + 1]) with weights weight[...] (ascending output index; a tap of weight 0 is left
// out). The taps are kernels/vision/bilinear_taps.h's.
struct TransposedTaps {
  std::vector<int32_t> start, index;
  std::vector<double> weight;
};
TransposedTaps transposed_taps(int64_t n_out, int64_t n_in);

// dtable [H0, W0, D] += Rᵀ Σ_f dx[f]: the gradient of one item's position embedding, dx [t, h, w, D] its rows'
// gradient (every frame's rows read the same resized table). Row and column taps: transposed_taps(h, H0) and
// transposed_taps(w, W0) uploaded (device int32 / double arrays). Per table element, the sum over frames, rows
// and columns in double in that order, added to dtable once.
struct PositionBackwardParams {
  float* dtable = nullptr;
  const float* dx = nullptr;
  int64_t H0 = 0, W0 = 0, D = 0, t = 1, h = 0, w = 0;
  const int32_t *row_start = nullptr, *row_index = nullptr, *col_start = nullptr, *col_index = nullptr;
  const double *row_weight = nullptr, *col_weight = nullptr;
};

#ifdef K3_HAVE_CUDA
void rope_split(const RopeSplitParams& p);
void rope_split_backward(const RopeSplitParams& p);
void position_embedding_backward(const PositionBackwardParams& p);
// y[i] = gelu(x[i]) in fp32 (y may alias x).
void gelu_forward_train(float* y, const float* x, int64_t n, Gelu form);
// dx[i] = dy[i] gelu'(x[i]) (dx may alias dy): tanh form 0.5 (1 + t) + 0.5 x (1 - t²) √(2/π) (1 + 3 · 0.044715 x²)
// with 1 + t = 2 σ(2z) and 1 - t² = 4 σ(2z) σ(-2z); erf form erfc(-x/√2) / 2 + x e^(-x²/2) / √(2π).
void gelu_backward_train(float* dx, const float* dy, const float* x, int64_t n, Gelu form);
// The merge's backward over one item: dx [t, h, w, D] OVERWRITTEN, each frame's copy of a patch taking its merged
// slot's gradient / t (dmerged [(h / mh) (w / mw), mh mw, D], merge_tpool's layout).
void merge_tpool_backward(float* dx, const float* dmerged, int64_t t, int64_t h, int64_t w, int64_t D, int64_t mh,
                          int64_t mw);
#else  // a build without the CUDA backend: the entry points say so
inline void rope_split(const RopeSplitParams&) { fail("vision::cuda::rope_split: this build has no CUDA backend"); }
inline void rope_split_backward(const RopeSplitParams&) {
  fail("vision::cuda::rope_split_backward: this build has no CUDA backend");
}
inline void position_embedding_backward(const PositionBackwardParams&) {
  fail("vision::cuda::position_embedding_backward: this build has no CUDA backend");
}
inline void gelu_forward_train(float*, const float*, int64_t, Gelu) {
  fail("vision::cuda::gelu_forward_train: this build has no CUDA backend");
}
inline void gelu_backward_train(float*, const float*, const float*, int64_t, Gelu) {
  fail("vision::cuda::gelu_backward_train: this build has no CUDA backend");
}
inline void merge_tpool_backward(float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t) {
  fail("vision::cuda::merge_tpool_backward: this build has no CUDA backend");
}
#endif

}  // namespace k3::vision::cuda
