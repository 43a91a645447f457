// The vision tower (MoonViT-V2) and projector (PatchMergerMLPV2) for training, K3-ARCHITECTURE.md §8: a float64
// forward over a ParamStore's `vision_tower.*` and `mm_projector.*` tensors (names and shapes from the vision
// tensor table, model/tensor_table.h) that saves what the backward reads, and the explicit backward, op by op in
// reverse (llm.c's way). The forward is VisionModel::encode's (model/vision.h) step for step, without rounding to
// float32:
//
//   x = patches · Wpatchᵀ + resize(pos table) (+ each frame's time embedding, for a clip)
//   per block: x += wo(attn(rope2d(wqkv(RMSNorm0 x)))); x += fc1(gelu_tanh(fc0(RMSNorm1 x)))
//   x = RMSNorm(x); merged = sd2_tpool(x); projected = RMSNorm(proj.2 gelu_erf(proj.0 merged))
//
// The tower's norms take eps 2^-7 (VisionModel::kTowerNormEps), the projector's post-norm projector_ln_eps.
// Everything trains: the patch embedding, the position table (through the resize's transpose,
// kernels/vision/vision_f64.h), every block, the final norm and the projector; the time embedding is fixed.
//
// Gradients: the backward ACCUMULATES into P's gradient buffer (so a step may sum several sequences, as the text
// model's backward does) and OVERWRITES the optional gradient of the pixel patches.
//
// Notation: L patches (all items), D = vt_hidden_size, Q = qkv_hidden_size, I = vt_intermediate_size,
// M = merged width (D · merge_h · merge_w), H = text_hidden_size, V = 3 · patch_size² (one patch's values).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/params.h"
#include "model/tensor_table.h"
#include "model/vision.h"
#include "model/vision_config.h"

namespace k3::train {

// What one tower block saved for its backward.
struct VisionBlockTape {
  std::vector<double> x;      // [L, D]   the block's input (the residual stream): norm0's input
  std::vector<double> y0;     // [L, D]   norm0(x): wqkv's input
  std::vector<double> qkv;    // [L, 3Q]  wqkv y0, q and k turned by the 2D RoPE: the attention's inputs
  std::vector<double> lse;    // [heads, n] per item of n patches, from heads · (its first patch): log-sum-exp
  std::vector<double> o;      // [L, Q]   the attention's output: wo's input
  std::vector<double> x_mid;  // [L, D]   x + wo o: norm1's input
  std::vector<double> y1;     // [L, D]   norm1(x_mid): fc0's input
  std::vector<double> f;      // [L, I]   fc0 y1: gelu_tanh's input
  std::vector<double> g;      // [L, I]   gelu_tanh(f): fc1's input
};

// One item (image or clip): where its patches are, its projector's activations and its outputs.
struct VisionItemTape {
  VisionGrid grid;
  int64_t first_patch = 0;        // its first patch among the L
  int64_t tokens = 0;             // (h / merge_h) (w / merge_w)
  std::vector<double> merged;     // [tokens, M]  the tower's output merged (an output): proj.0's input
  std::vector<double> mid;        // [tokens, M]  proj.0 merged: gelu_erf's input
  std::vector<double> act;        // [tokens, M]  gelu_erf(mid): proj.2's input
  std::vector<double> z;          // [tokens, H]  proj.2 act: post_norm's input
  std::vector<double> projected;  // [tokens, H]  post_norm(z): what replaces the item's placeholder in the text
};

struct VisionTape {
  int64_t patches = 0;              // L
  std::vector<double> pixels;       // [L, V]  the input (the patch embedding's)
  std::vector<int32_t> rows, cols;  // [L]     each patch's row and column in its frame (the RoPE's angles)
  std::vector<VisionBlockTape> blocks;
  std::vector<double> final_in;  // [L, D]  the last block's output: the final norm's input
  std::vector<VisionItemTape> items;
};

// The name of vision tensor k (of block b, -1 for the tower's and projector's own), after checking that P holds it
// in the vision tensor table's shape: a k3::Error names a tensor that is missing or misshapen.
std::string checked_vision_name(const ParamStore& P, const VisionConfig& c, VisionTensorKind k, int64_t block = -1);

// The tower and projector of config c over P's vision tensors. pixel_patches [patches, V]: normalised, each
// item's patches in (t, h, w) order, items in order, as VisionModel::encode takes them. A k3::Error names a grid
// the tower cannot take (check_vision_grids) or a vision tensor P lacks or holds in another shape.
VisionTape vision_forward(const ParamStore& P, const VisionConfig& c, const double* pixel_patches, int64_t patches,
                          const std::vector<VisionGrid>& grids);

// The gradients of a loss with respect to the forward's outputs, per item. An absent list (empty) or a null entry
// is zero.
struct VisionOutputGrads {
  std::vector<const double*> projected;  // [tokens, H] per item
  std::vector<const double*> merged;     // [tokens, M] per item
};

// The backward of the forward that wrote `tape` (with P's values unchanged since): every vision tensor's gradient
// ACCUMULATED into P; d_pixel_patches [patches, V] (optional) OVERWRITTEN. A k3::Error when a list of `d` has
// another length than the tape's items.
void vision_backward(ParamStore& P, const VisionConfig& c, const VisionTape& tape, const VisionOutputGrads& d,
                     double* d_pixel_patches = nullptr);

}  // namespace k3::train
